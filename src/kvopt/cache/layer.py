"""One transformer layer's cache: storage, token accounting and the methods acting on it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from kvopt.cache import attention_math
from kvopt.cache.part import KVPart
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
    #: different tokens, see :class:`kvopt.methods.fastkv.Propagated`).
    query_positions: torch.Tensor
    scaling: float | None
    is_prefill: bool


class AttentionMode(Protocol):
    """A layer's attention taken over for a while (set as :attr:`KVLayer.mode`, then back to None by its owner):
    kvzip's reconstruction pass scores the stored tokens and forgets the new ones (:mod:`kvopt.methods.kvzip`); a
    speculative block keeps its tokens provisional (:mod:`kvopt.speculative.restore`); FastKV's propagation stores
    one forward's tokens at the sequence indices that reached the layer (:mod:`kvopt.methods.fastkv`)."""

    #: What the mode is doing, for errors (e.g. "kvzip's reconstruction pass").
    purpose: str
    #: The new tokens leave no trace but scores, so they may run past the model's last position (a scoring pass
    #: over a prompt that itself fits).
    forgets_tokens: bool

    def attend(self, layer: KVLayer, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        ...


class KVLayer(SeamLayer):
    """A ``CacheLayerMixin`` whose reads go through :func:`kvopt.cache.attention.kvopt_attention`.

    ``update`` parks the new keys/values; the attention call stores them (with the padding bits only it
    can see) and attends over the storage. ``seen`` counts sequence indices consumed, padding included
    (what HF's ``get_seq_length`` places new tokens by). Storage is the dense store, which receives new
    tokens, plus the compact parts methods made from it, all read as :class:`~kvopt.cache.part.KVPart` s.
    """

    is_croppable = True

    def __init__(self, methods, sliding_window: int | None = None) -> None:
        super().__init__()
        self.methods = methods
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        #: This layer's index and all layers of its cache (cross-layer methods read a neighbour).
        self.index = 0
        self.siblings: list[KVLayer] = [self]
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.store = DenseKVStore()
        #: Tokens methods moved out of the dense store, in :attr:`KVPart.read_order` (see :meth:`add_part`).
        self.parts: list[KVPart] = []
        #: Real (non-padding) tokens seen, summed over the batch.
        self.seen_real = 0
        #: Per-layer state of the methods (e.g. a budget fixed at prefill), keyed by method name, and of the cache's
        #: features (the prefill step a recording cache kept: :data:`kvopt.cache.kv_cache.RECORDED_PREFILL`).
        self.state: dict[str, object] = {}
        #: When set, attention calls go to it instead of :meth:`store_and_attend` (see :class:`AttentionMode`).
        self.mode: AttentionMode | None = None

    # -- HF's batch operations, on a dense store only ------------------------------------------
    def crop(self, length: int) -> None:
        """HF rollback: a negative value removes that many tokens, a non-negative one keeps that many."""
        self._require_dense("rolling back (crop)")
        target = self.seen + length if length < 0 else min(length, self.seen)
        if not self.store.is_empty:
            self.seen_real -= (self.seen - target) * self.store.keys.shape[0]
            self.store.truncate_after(target)
        self.seen = target

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Keep or repeat batch ``rows`` (beam search; ``batch_select_indices`` too)."""
        self._require_dense("selecting batch rows (beam search)")
        self.store.select_batch(rows)

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = 0 if self.store.is_empty else self.store.keys.shape[0]
        self.reorder_cache(torch.arange(rows).repeat_interleave(repeats))

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
        is_prefill = self.seen == 0
        positions, _ = self.store_tokens(key, value, padding[:, -key.shape[-2] :] if padding is not None else None)
        return self.attend_stored(module, query, positions, scaling, sliding_window, softcap, is_prefill)

    def store_tokens(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Append new tokens (``valid [batch, new]`` or None) at the next sequence indices; their positions
        (``[new]``) and how many are real."""
        batch, new = key.shape[0], key.shape[-2]
        positions = torch.arange(self.seen, self.seen + new, dtype=torch.int32, device=key.device)
        self.store.append(key, value, self.seen, valid)
        real = batch * new if valid is None else int(valid.sum())
        self.seen += new
        self.seen_real += real
        return positions, real

    def attend_stored(self, module, query, positions, scaling, sliding_window, softcap, is_prefill: bool) -> torch.Tensor:
        """Attend ``query`` (its tokens stored at ``positions``) over everything held, then let the methods act."""
        dense = self._presented_store(positions)
        if self.parts:
            output = self._attend_in_parts(query, dense, positions, scaling, softcap)
        else:
            output = attention_math.attend(
                query, dense.keys, dense.values, *dense.mask_rows(), positions, scaling, sliding_window, softcap
            )
        self.act(AttentionStep(module, query, positions, scaling, is_prefill))
        return output

    def _presented_store(self, positions: torch.Tensor) -> DenseKVStore:
        """The dense store as attention reads it, its keys as the methods present them
        (:meth:`kvopt.methods.base.Method.read_keys`)."""
        stored = keys = self.store.keys
        for method in self.methods:
            keys = method.read_keys(self, keys, positions)
        return self.store if keys is stored else self.store.presenting(keys)

    def act(self, step: AttentionStep) -> None:
        """Let the methods act on what the layer holds after ``step``'s attention (or a replayed prefill's); a sliding
        layer then frees what its window never reads again (lossless)."""
        for method in self.methods:
            method.after_attention(self, step)
        if self.sliding_window is not None:
            self.store.forget_before(self.seen - self.sliding_window + 1)

    def _attend_in_parts(self, query, dense: DenseKVStore, positions, scaling, softcap) -> torch.Tensor:
        """Attention over every part, then the dense store, merged exactly; or one part's read of itself with the
        dense store in one call (KVPart's optional hook: kivi's GPU decode kernel)."""
        if self.sliding_window is not None:
            raise CacheUsageError(f"{self.parts[0].kind} cannot serve sliding-window layers yet")
        scale = attention_math.default_scale(query, scaling)
        fuse = getattr(self.parts[0], "attend_with_dense", None) if len(self.parts) == 1 else None
        if fuse is not None and (fused := fuse(query, positions, scale, softcap, dense)) is not None:
            return fused
        results = [part.attend(query, positions, scale, softcap) for part in (*self.parts, dense)]
        return attention_math.merge_with_lse(results)[0].to(query.dtype).transpose(1, 2).contiguous()

    def parts_of(self, kind: type[Part]) -> list[Part]:
        """This layer's parts of one kind (e.g. ``layer.parts_of(QuantizedKV)``), in read order."""
        return [part for part in self.parts if isinstance(part, kind)]

    def add_part(self, part: KVPart) -> None:
        """Hold ``part`` among the compact parts, after those it reads after (see :attr:`KVPart.read_order`)."""
        bisect.insort(self.parts, part, key=lambda held: held.read_order)

    # -- accounting ---------------------------------------------------------------------------
    def kept_per_row(self) -> torch.Tensor:
        """Real tokens held per batch row (on KV head 0), on the CPU, wherever each part counts them (device
        tensors for a dense store, CPU offsets for ragged segments); an empty dense store has no rows to add."""
        counts = [count.cpu() for count in (part.valid_counts() for part in (self.store, *self.parts)) if count.numel()]
        return torch.stack(counts).sum(dim=0) if counts else self.store.valid_counts().cpu()

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in (self.store, *self.parts))
