"""One transformer layer's cache: storage, token accounting and the methods acting on it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from kvopt.cache import attention_math
from kvopt.cache.part import KVPart
from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.ragged import RaggedKV
from kvopt.cache.seam_layer import SeamLayer
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError

Part = TypeVar("Part", bound=KVPart)


@dataclass
class AttentionStep:
    """What a method may look at after one attention call of one layer."""

    module: torch.nn.Module
    #: ``[batch, heads, new_tokens, head_dim]``, after RoPE.
    query: torch.Tensor
    #: Sequence indices of the new tokens, ``[new_tokens]`` (``[batch, new_tokens]`` when rows propagated
    #: different tokens, see :class:`Propagated`).
    query_positions: torch.Tensor
    scaling: float | None
    is_prefill: bool


@dataclass
class Propagated:
    """Which tokens of the next forward reach a layer: FastKV's token-selective propagation lets only
    the selected tokens' hidden states flow past its selection layer (see :mod:`kvopt.methods.fastkv`)."""

    #: ``[batch, kept]`` columns of the forward's tokens that reach the layer, ascending per row.
    columns: torch.Tensor
    #: Tokens in the forward: the sequence indices it consumes, whatever reaches the layer.
    width: int
    #: Real (non-padding) tokens of the forward, summed over the batch: the tokens the layer has seen.
    real: int
    #: The first layer they reach, whose input hidden states are narrowed to them (later ones get them narrowed).
    first_layer: int

    def positions(self, seen: int) -> torch.Tensor:
        """Sequence indices of the tokens reaching the layer: ``[kept]`` if the rows agree, else ``[batch, kept]``."""
        positions = (self.columns + seen).to(torch.int32)
        return positions[0] if bool((positions == positions[:1]).all()) else positions


class AttentionMode(Protocol):
    """A layer's attention taken over for a while: kvzip's reconstruction pass scores the stored tokens and
    forgets the new ones (:mod:`kvopt.methods.kvzip`); a speculative block keeps its tokens provisional
    (:mod:`kvopt.speculative.restore`). Set as :attr:`KVLayer.mode`; the owner sets it back to None."""

    #: What the mode is doing, for errors (e.g. "kvzip's reconstruction pass").
    purpose: str

    def attend(self, layer: KVLayer, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        ...


class KVLayer(SeamLayer):
    """A ``CacheLayerMixin`` whose reads go through :func:`kvopt.cache.attention.kvopt_attention`.

    ``update`` parks the new keys/values; the attention call stores them (with the padding bits
    only it can see) and attends over the storage. ``seen`` counts sequence indices consumed,
    padding included, which is what HF expects from ``get_seq_length`` to place new tokens.

    Storage is the dense store, which receives new tokens, plus the compact parts methods made
    from it (:class:`~kvopt.cache.part.KVPart`: ragged, quantized, merged), read through one interface.
    """

    is_croppable = True

    def __init__(self, methods, sliding_window: int | None = None) -> None:
        super().__init__()
        self.methods = methods
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.store = DenseKVStore()
        #: Tokens methods moved out of the dense store, in :attr:`KVPart.read_order` (see :meth:`add_part`).
        self.parts: list[KVPart] = []
        #: This layer's index and all layers of its cache (cross-layer methods read a neighbour).
        self.index = 0
        self.siblings: list[KVLayer] = [self]
        #: Real (non-padding) tokens seen, summed over the batch.
        self.seen_real = 0
        #: Per-layer state of the methods (e.g. a budget fixed at prefill), keyed by method name.
        self.state: dict[str, object] = {}
        #: When set, attention calls go to it instead of :meth:`store_and_attend` (see :class:`AttentionMode`).
        self.mode: AttentionMode | None = None
        #: The prefill step a recording cache kept (:func:`kvopt.methods.recording.record_prefill`), for replays.
        self.recorded_prefill: AttentionStep | None = None
        #: Set for one forward when only some of its tokens reach this layer (FastKV), else None.
        self.propagated: Propagated | None = None

    def reset(self) -> None:
        super().reset()
        self.store = DenseKVStore()
        self.parts = []
        self.seen_real = 0
        self.state = {}
        self.recorded_prefill = None
        self.mode = None
        self.propagated = None

    def crop(self, length: int) -> None:
        """HF rollback: a negative value removes that many tokens, a non-negative one keeps that many."""
        self._require_dense("rolling back (crop)")
        target = self.seen + length if length < 0 else min(length, self.seen)
        if not self.store.is_empty:
            self.seen_real -= (self.seen - target) * self.store.keys.shape[0]
            self.store.truncate_after(target)
        self.seen = target

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._require_dense("beam search")
        self.store.select_batch(beam_idx.to(self.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._require_dense("selecting batch rows")
        self.store.select_batch(indices.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._require_dense("repeating batch rows")
        if not self.store.is_empty:
            batch = self.store.keys.shape[0]
            self.store.select_batch(torch.arange(batch, device=self.device).repeat_interleave(repeats))

    def _require_dense(self, action: str) -> None:
        if self.parts:
            raise CacheUsageError(f"{action} is not supported once a layer holds {self.parts[0].kind}")

    # -- the read path ------------------------------------------------------------------------
    def attend(self, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Store the parked tokens, attend over the storage, then let the methods act."""
        self.take_parked(value)
        if self.mode is not None:
            return self.mode.attend(self, module, query, key, value, padding, scaling, sliding_window, softcap)
        return self.store_and_attend(module, query, key, value, padding, scaling, sliding_window, softcap)

    def store_and_attend(self, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Store the new tokens, attend over everything held, then let the methods act."""
        new = key.shape[-2]
        is_prefill = self.seen == 0
        positions, _ = self.store_tokens(key, value, padding[:, -new:] if padding is not None else None)
        store = self.store
        keys = store.keys
        for method in self.methods:
            keys = method.read_keys(self, keys, positions)
        if not self.parts:
            key_positions, key_valid = store.mask_rows()
            output = attention_math.attend(
                query, keys, store.values, key_positions, key_valid, positions, scaling, sliding_window, softcap
            )
        else:
            output = self._attend_in_parts(query, keys, positions, scaling, softcap)
        self.act(AttentionStep(module, query, positions, scaling, is_prefill))
        return output

    def store_tokens(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Append new tokens (``valid [batch, new]`` or None); their positions as stored (``[new]``, or
        ``[batch, new]`` when propagated rows differ), and how many are real."""
        batch, new = key.shape[0], key.shape[-2]
        propagated, self.propagated = self.propagated, None
        if propagated is None:
            positions = torch.arange(self.seen, self.seen + new, dtype=torch.int32, device=key.device)
            self.store.append(key, value, self.seen, valid)
            consumed, real = new, batch * new if valid is None else int(valid.sum())
        else:
            positions = propagated.positions(self.seen)
            self.store.append(key, value, self.seen, valid, positions)
            consumed, real = propagated.width, propagated.real
        self.seen += consumed
        self.seen_real += real
        return positions, real

    def act(self, step: AttentionStep) -> None:
        """Let the methods act on what the layer holds after ``step``'s attention."""
        for method in self.methods:
            method.after_attention(self, step)
        if self.sliding_window is not None:
            self._forget_outside_window()

    def replay_prefill(self, source: KVLayer) -> None:
        """Take a copy of ``source``'s prefilled tokens and run this layer's methods on them.

        Methods act after attention, so a one-pass prefill's outputs never depend on them: this
        equals prefilling this layer directly, at the cost of a copy (see :meth:`KVCache.replay_prefill`).
        """
        step = source.recorded_prefill
        if self.seen or not step.is_prefill:
            raise CacheUsageError("replay_prefill needs an empty cache and a recorded one-pass prefill")
        self.dtype, self.device, self.is_initialized = source.dtype, source.device, True
        self.store = source.store.clone()
        self.seen, self.seen_real = source.seen, source.seen_real
        for method in self.methods:
            method.after_attention(self, step)
        if self.sliding_window is not None:
            self._forget_outside_window()

    def _attend_in_parts(self, query, keys, positions, scaling, softcap) -> torch.Tensor:
        """Attention over every part, then the dense store (with the keys as methods present them), merged exactly."""
        if self.sliding_window is not None:
            raise CacheUsageError(f"{self.parts[0].kind} cannot serve sliding-window layers yet")
        scale = attention_math.default_scale(query, scaling)
        # A part may read the dense store with itself in one call (KVPart's optional hook; kivi's GPU decode kernel).
        fuse = getattr(self.parts[0], "attend_with_dense", None) if len(self.parts) == 1 else None
        if fuse is not None:
            fused = fuse(query, positions, scale, softcap, (keys, self.store.values, self.store.mask_rows()[1]))
            if fused is not None:
                return fused
        results = [part.attend(query, positions, scale, softcap) for part in self.parts]
        results.append(self.store.attend(query, positions, scale, softcap, keys=keys))
        return attention_math.merge_with_lse(results)[0].to(query.dtype).transpose(1, 2).contiguous()

    def drop_parked(self) -> None:
        """Forget keys parked by an ``update`` whose attention call never came (a forward that failed)."""
        self._parked = None

    def parts_of(self, kind: type[Part]) -> list[Part]:
        """This layer's parts of one kind (e.g. ``layer.parts_of(QuantizedKV)``), in read order."""
        return [part for part in self.parts if isinstance(part, kind)]

    def add_part(self, part: KVPart) -> None:
        """Hold ``part`` among the compact parts, after those it reads after (see :attr:`KVPart.read_order`)."""
        bisect.insort(self.parts, part, key=lambda held: held.read_order)

    def quantize_oldest(self, bits: int, group: int, residual: int, key_mode: str = "channel") -> None:
        """Once ``residual`` full-precision tokens are held, quantize all whole groups of ``group``
        (the oldest), leaving fewer than ``group`` in full precision (KIVI's key schedule, so the
        full-precision part stays below ``residual`` tokens). Sliding layers stay in full precision:
        their window already bounds them; so do layers a cross-layer method owns (MiniCache
        quantizes their merged directions itself)."""
        owned = any(method.owns_layer(self.index) for method in self.methods)
        if self.sliding_window is not None or owned or len(self.store) < max(residual, group):
            return
        count = len(self.store) // group * group
        store = self.store
        block = QuantizedKV.encode(
            store.keys[:, :, :count], store.values[:, :, :count], store.positions[:, :, :count],
            store.valid[:, :, :count], bits, group, key_mode,
        )  # fmt: skip
        self.add_quantized(block)
        store.drop_oldest(count)

    def add_quantized(self, block: QuantizedKV) -> None:
        """Append quantized tokens to the part with the same settings (or start a new part)."""
        for part in self.parts_of(QuantizedKV):
            if part.same_format(block):
                part.extend(block)
                return
        self.add_part(block)

    def to_ragged(self, selected: list[torch.Tensor]) -> None:
        """Move the stored tokens at ``selected[b * kv_heads + h]`` into a ragged prefix; empty the dense store."""
        if self.parts_of(RaggedKV):
            raise CacheUsageError("a layer's tokens can be made ragged once (one head-wise compression per cache)")
        store = self.store
        self.add_part(RaggedKV.gather(store.keys, store.values, store.positions, selected))
        self.store = DenseKVStore()

    def kept_per_row(self) -> torch.Tensor:
        """Real tokens held per batch row (on KV head 0), on the CPU: parts keep their counts where they keep
        their bookkeeping (device tensors for a dense store, CPU offsets for ragged segments). An empty dense
        store has no rows to add."""
        counts = [count.cpu() for count in (part.valid_counts() for part in (self.store, *self.parts)) if count.numel()]
        return torch.stack(counts).sum(dim=0) if counts else self.store.valid_counts().cpu()

    def _forget_outside_window(self) -> None:
        """A sliding layer never reads tokens older than its window again: free them (lossless)."""
        if not self.store.heads_aligned:
            return  # heads hold different tokens: the attention mask still applies the window
        oldest_needed = self.seen - self.sliding_window + 1
        stale = int((self.store.positions[0, 0] < oldest_needed).sum())
        if stale:
            self.store.drop_oldest(stale)

    # -- accounting ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(part.nbytes() for part in (self.store, *self.parts))
