"""Any spec in the engine: the sequence holds its own :class:`~kvopt.cache.kv_cache.KVCache`, run as ``generate`` runs it.

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

Memory: the sequence holds blocks of the pool for the bytes its cache holds (every tensor,
slack included, in whole blocks), so admission and preemption count it like any other; the
tensors themselves live outside the pool's preallocated storage (see the README's engine
section). Preempted in ``swap`` mode, its tensors stay where they are and its blocks wait to be free again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvopt.cache import attention
from kvopt.cache.kv_cache import KVCache
from kvopt.engine.kv.base import table_fill
from kvopt.models.forward import cache_kwargs

if TYPE_CHECKING:
    from kvopt.engine.kv.paged import StepPlan
    from kvopt.engine.sequence import Sequence


def with_headroom(tokens: int) -> int:
    """Slots for ``tokens`` more tokens in a cache's own tensors: their keys and values plus 1/16 for positions,
    validity and the dense store's growth slack (:func:`~kvopt.cache.storage.slack_tokens`, ~3%)."""
    return tokens + tokens // 16 + 1


class CacheBackedKV:
    """One sequence's own ``KVCache`` (None until its prompt is computed) and the model that fills it."""

    shares_blocks: ClassVar[bool] = False
    keeps_prompt_state: ClassVar[bool] = False

    def __init__(self, methods: list, model, tokenizer, token_bytes: int) -> None:
        self.methods = methods
        self.model, self.tokenizer = model, tokenizer
        #: Bytes one slot stands for (a block's bytes over its slots): the unit the cache's bytes are charged in.
        self.token_bytes = token_bytes
        self.cache: KVCache | None = None

    # -- accounting ---------------------------------------------------------------------------
    def stored_tokens(self, computed: int) -> int:
        return 0 if self.cache is None else -(-self.cache.nbytes() // self.token_bytes)

    def reserve_tokens(self, tokens: int) -> int:
        """The prompt's pass holds all of it before the methods compress it (:meth:`slots_needed` adds the headroom)."""
        return tokens

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        return self.stored_tokens(computed) + with_headroom(new_tokens)

    def nbytes(self, seq: Sequence, block_bytes: int) -> int:
        return -(-self.stored_tokens(0) * self.token_bytes // block_bytes) * block_bytes

    def held_blocks(self, seq: Sequence, block_size: int) -> list[int]:
        """Its blocks stand for its tensors' bytes (swapping in waits for as many free)."""
        return list(seq.block_table)

    def filled_slots(self, seq, block_size: int) -> dict[int, int]:
        return table_fill(seq.block_table, self.stored_tokens(0), block_size)

    def relocate(self, moved: dict[int, int]) -> None:
        """Nothing of it lies in its blocks: nothing moves."""

    def reset(self) -> None:
        self.cache = None

    # -- one step -----------------------------------------------------------------------------
    def plan(self, plan: StepPlan, seq: Sequence, row: int, count: int) -> bool:
        if self.cache is None:
            plan.alone.append(AloneStep(self, seq, count))
            return False
        plan.own.append(OwnCacheStep(self, row, row + count))
        return True

    def compute_prompt(self, seq: Sequence, count: int) -> torch.Tensor:
        """Compute ``seq``'s first ``count`` tokens into a new cache, as :func:`kvopt.generate` does; fp32 logits of
        the last ``[1, vocab]``."""
        model = self.model
        cache = KVCache.for_model(self.methods, model)
        ids = torch.tensor([seq.token_ids[:count]], device=next(model.parameters()).device)
        if cache.needs_prefill_pass and count > 1:  # kvzip, surprisal: compress all but the last token first
            cache.prefill(model, ids[:, :-1], tokenizer=self.tokenizer)
            ids = ids[:, -1:]
        output = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
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

    def commit(self, seq: Sequence, drafted: int, accepted: int, block_size: int) -> list[int]:
        """Give back the blocks beyond the cache's bytes (its prompt pass, or an eviction, may have shrunk it)."""
        keep = -(-self.stored_tokens(0) // block_size)
        surplus = seq.block_table[keep:]
        del seq.block_table[keep:]
        return surplus[::-1]


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
