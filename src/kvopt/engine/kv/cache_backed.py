"""Any spec in the engine: the sequence's own :class:`~kvopt.cache.kv_cache.KVCache`, run as ``generate`` runs it.

The block layouts (:mod:`.compressed`, :mod:`.headwise`) hold what layer-by-layer methods keep
at full precision or in one code format. Everything else — a ranking over all layers (kvzip,
lava), a changed prefill (fastkv's propagation), the prompt's hidden states (surprisal),
non-uniform codes with outliers (kvquant, aquakv), sparse indexes (rocketkv), merged layer
pairs (minicache), mixed precisions, sliding-window models — is served here, through the very
objects ``model.generate`` uses, so a method added to :mod:`kvopt.methods` runs in the engine
with no engine change:

- the prompt is computed alone, exactly as :func:`kvopt.generate` computes it (a whole-prompt
  pass: ``cache.prefill`` of all but the last token, then the last one; otherwise one forward
  of the whole prompt), and its logits join the step's;
- each decoding step, the sequence's token rides in the flattened batch (its linear layers
  batched with every other sequence's) and each layer's attention call hands its rows to the
  sequence's own ``KVLayer`` (store, attend, let the methods act).

Right after the prompt its cache goes to the KV tiers (when the engine has some) as a session file
would hold it (:class:`CachedPrompt`): the same prompt with the same spec again (a retried request,
another replica, a restarted engine) installs that cache into its blocks and skips the prompt pass,
kvzip's reconstruction included.

Memory: between steps the cache's tensors wait *in the sequence's blocks* (:mod:`.at_rest`: the
tensors its storage parts own, packed into the blocks' bytes, their own memory given up), and are
brought back by one gather when the sequence is scheduled; it holds as many blocks as they take, so
admission, preemption (``swap`` copies those blocks out and back) and ``kv_cache_usage_perc`` count
its real bytes like any other sequence's. Per-layer method state (a few numbers) stays in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvopt.cache import attention
from kvopt.cache.kv_cache import KVCache
from kvopt.codec.session import cache_bytes, cache_from_bytes
from kvopt.engine.kv.at_rest import Packing, Placement, park, restore
from kvopt.engine.kv.base import cut_table, table_fill
from kvopt.methods.spec import spec_text
from kvopt.models.forward import cache_kwargs

if TYPE_CHECKING:
    from kvopt.engine.kv.paged import PagedKVPool, StepPlan
    from kvopt.engine.sequence import Sequence


def with_headroom(tokens: int) -> int:
    """Slots for ``tokens`` more tokens in a cache's own tensors: their keys and values plus 1/16 for positions,
    validity and the dense store's growth slack (:func:`~kvopt.cache.storage.slack_tokens`, ~3%)."""
    return tokens + tokens // 16 + 1


@dataclass
class CachedPrompt:
    """A cache-backed sequence right after its prompt, as a KV tier keeps it: the cache saved in the session
    format (:func:`~kvopt.codec.session.cache_bytes`: every part and method state a cache can hold, with the
    model's fingerprint and checksums) and the logits its first token is sampled from."""

    #: The saved cache ``[bytes]`` (uint8).
    data: torch.Tensor
    #: fp32 logits of the prompt's last position ``[vocab]``.
    logits: torch.Tensor
    #: ``data`` decoded on the model, by :meth:`CacheBackedKV.check_state` (None in the tier).
    cache: KVCache | None = field(default=None, init=False, repr=False)
    #: How the decoded cache's tensors pack into blocks (set with ``cache``).
    packing: Packing | None = field(default=None, init=False, repr=False)


class CacheBackedKV:
    """One sequence's own ``KVCache`` (None until its prompt is computed), at rest in its blocks between steps."""

    shares_blocks: ClassVar[bool] = False
    keeps_prompt_state: ClassVar[bool] = True

    def __init__(self, methods: list, model, tokenizer, pool: PagedKVPool) -> None:
        self.methods = methods
        self.model, self.tokenizer = model, tokenizer
        self.pool = pool
        #: Bytes one slot stands for (a block's bytes over its slots): the unit the cache's bytes are charged in.
        self.token_bytes = pool.chunks.shape[1] * pool.chunks_per_block // pool.block_size
        self.cache: KVCache | None = None
        #: Where its tensors are while it waits in its blocks (None while they are in memory of their own).
        self.parked: list[Placement] | None = None
        #: Bytes its tensors take, packed (what its blocks hold, or must hold to park it).
        self.packed_bytes = 0

    # -- accounting ---------------------------------------------------------------------------
    def stored_tokens(self, computed: int) -> int:
        return -(-self.packed_bytes // self.token_bytes)

    def reserve_tokens(self, tokens: int) -> int:
        """The prompt's pass holds all of it before the methods compress it (:meth:`slots_needed` adds the headroom)."""
        return tokens

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        return self.stored_tokens(computed) + with_headroom(new_tokens)

    def nbytes(self, seq: Sequence, block_bytes: int) -> int:
        return -(-self.packed_bytes // block_bytes) * block_bytes

    def filled_slots(self, seq, block_size: int) -> dict[int, int]:
        return table_fill(seq.block_table, self.stored_tokens(0), block_size)

    def held_blocks(self, seq: Sequence, block_size: int) -> list[int]:
        """Its blocks hold its tensors between steps (swapping copies them out and back)."""
        return list(seq.block_table)

    def relocate(self, moved: dict[int, int]) -> None:
        """Chunks are found from the block table at each restore: nothing to follow."""

    def reset(self) -> None:
        self.cache, self.parked, self.packed_bytes = None, None, 0

    # -- one step -----------------------------------------------------------------------------
    def plan(self, plan: StepPlan, seq: Sequence, row: int, count: int) -> bool:
        if self.cache is None:
            plan.alone.append(AloneStep(self, seq, count))
            return False
        if self.parked is not None:
            restore(self.parked, self.pool.chunks, self._rows(seq.block_table))
            self.parked = None
        plan.own.append(OwnCacheStep(self, row, row + count))
        return True

    def compute_prompt(self, seq: Sequence, count: int) -> torch.Tensor:
        """Compute ``seq``'s first ``count`` tokens into a new cache, as :func:`kvopt.generate` does; fp32 logits of
        the last ``[1, vocab]``."""
        cache = KVCache.for_model(self.methods, self.model)
        ids = torch.tensor([seq.token_ids[:count]], device=next(self.model.parameters()).device)
        return self.continue_prompt(cache, cache.run_prompt_pass(self.model, ids, self.tokenizer))

    def continue_prompt(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` ``[1, new]`` (the prompt's tokens ``cache`` lacks) and hold ``cache`` as the sequence's;
        fp32 logits of the last ``[1, vocab]``."""
        with torch.no_grad():
            output = self.model(input_ids=ids, **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        self.cache = cache
        return output.logits[0, -1:].float()

    def attend(self, index: int, module, query, key, value, scaling, sliding_window, softcap) -> torch.Tensor:
        """Layer ``index`` for this sequence's rows (``[1, heads, new, dim]``), as ``KVLayer.attend`` runs it in
        ``generate``; returns ``[1, new, heads, dim]``."""
        layer = self.cache.layers[index]
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()  # as generate hands them over
        layer.update(key, value, index)
        attention.claim(key)  # the seam's update-then-attend, run here by hand
        return layer.attend(module, query, key, value, None, scaling, sliding_window, softcap)

    @torch.inference_mode()
    def commit(self, seq: Sequence, drafted: int, accepted: int, block_size: int) -> list[int]:
        """Put the cache's tensors into its blocks and give back the blocks beyond them. When the step grew it past
        its blocks, it stays in memory of its own until the next step's allocation gives it enough (it is
        charged its packed bytes there either way)."""
        packing = _packing(self.cache)
        self.packed_bytes = packing.nbytes
        chunk_bytes = self.pool.chunks.shape[1]
        chunks = -(-packing.nbytes // chunk_bytes)
        keep = -(-chunks // self.pool.chunks_per_block)
        if keep > len(seq.block_table):
            return []
        if chunks:
            self.parked = park(packing, self.pool.chunks, self._rows(seq.block_table, chunks))
        return cut_table(seq.block_table, keep)

    def _rows(self, block_table: list[int], chunks: int | None = None) -> torch.Tensor:
        """Pool chunk rows of ``block_table`` holding (or to hold) its packed bytes."""
        if chunks is None:
            chunks = -(-self.packed_bytes // self.pool.chunks.shape[1])
        return self.pool.chunk_rows(block_table, chunks)

    # -- its prompt's state to and from a KV tier ---------------------------------------------------
    @torch.inference_mode()
    def snapshot(self, pool, block_table: list[int], code_table: list[int], logits: torch.Tensor) -> CachedPrompt:
        """Its cache right after the prompt, saved as a session file holds it (brought back from its blocks first:
        the next step would do so anyway)."""
        if self.parked is not None:
            restore(self.parked, pool.chunks, self._rows(block_table))
            self.parked = None
        data = torch.frombuffer(bytearray(cache_bytes(self.cache, self.model)), dtype=torch.uint8)
        return CachedPrompt(data, logits)

    def check_state(self, state: CachedPrompt, pool) -> None:
        """Decode ``state``'s cache on the model (a damaged or foreign one raises the codec's error); raise
        ValueError unless it is this sequence's spec (a decoded tier entry is installed only after this)."""
        if not isinstance(state, CachedPrompt) or state.data.dtype != torch.uint8 or state.logits.dim() != 1:
            raise ValueError("not a cached prompt's state")
        cache, _ = cache_from_bytes(state.data.numpy().tobytes(), self.model, "the tier entry's cache")
        if cache.spec != spec_text(self.methods):
            raise ValueError(f"a cache of {cache.spec!r}, not {spec_text(self.methods)!r}")
        state.cache, state.packing = cache, _packing(cache)

    def state_blocks(self, state: CachedPrompt) -> int:
        """Blocks :meth:`install` needs: the decoded cache's tensors, packed."""
        block_bytes = self.pool.chunks.shape[1] * self.pool.chunks_per_block
        return -(-state.packing.nbytes // block_bytes)

    @torch.inference_mode()
    def install(self, state: CachedPrompt, pool, block_table: list[int]) -> tuple[list[int], list[int]]:
        """Hold a checked ``state``'s cache, parked in ``block_table`` (:meth:`state_blocks` blocks); returns the
        sequence's ``(block table, code table)``."""
        self.cache = state.cache
        self.packed_bytes = state.packing.nbytes
        self.parked = park(state.packing, pool.chunks, self._rows(block_table))
        return block_table, []


def _packing(cache: KVCache) -> Packing:
    """How the tensors the cache's dense stores and parts hold for the sequence pack (per-model tables excluded)."""
    tensors = [[*layer.store.tensors(), *(tensor for part in layer.parts for tensor in part.tensors())] for layer in cache.layers]
    return Packing.of([tensor for layer in tensors for tensor in layer])


@dataclass(slots=True)
class AloneStep:
    """A sequence whose tokens this step are computed outside the flattened batch."""

    kv: CacheBackedKV
    seq: Sequence
    count: int

    def compute(self) -> torch.Tensor:
        return self.kv.compute_prompt(self.seq, self.count)


@dataclass(slots=True)
class OwnCacheStep:
    """A sequence in the step whose layers attend through its own cache (rows ``first:end``)."""

    kv: CacheBackedKV
    first: int
    end: int

    def attend(self, index: int, module, query, key, value, scaling, sliding_window, softcap) -> torch.Tensor:
        return self.kv.attend(index, module, query, key, value, scaling, sliding_window, softcap)
