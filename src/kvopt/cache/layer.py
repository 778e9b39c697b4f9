"""One transformer layer's cache: storage, token accounting and the methods acting on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvopt.cache import attention, ragged
from kvopt.cache.merged import MergedPair
from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError


@dataclass
class AttentionStep:
    """What a method may look at after one attention call of one layer."""

    module: torch.nn.Module
    #: ``[batch, heads, new_tokens, head_dim]``, after RoPE.
    query: torch.Tensor
    #: Sequence indices of the new tokens, ``[new_tokens]``.
    query_positions: torch.Tensor
    scaling: float | None
    is_prefill: bool


class KVLayer(CacheLayerMixin):
    """A ``CacheLayerMixin`` whose reads go through :func:`kvopt.cache.attention.kvopt_attention`.

    ``update`` parks the new keys/values; the attention call stores them (with the padding bits
    only it can see) and attends over the storage. ``seen`` counts sequence indices consumed,
    padding included, which is what HF expects from ``get_seq_length`` to place new tokens.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, methods, sliding_window: int | None = None) -> None:
        super().__init__()
        self.methods = methods
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.store = DenseKVStore()
        #: Tokens compressed with head-wise budgets (different counts per head), when a method did so.
        self.prefix: ragged.RaggedKV | None = None
        #: Tokens that left the full-precision residual window, quantized; one part per setting
        #: (KIVI: one; mixed precision: one per bit width).
        self.quantized: list[QuantizedKV] = []
        #: Tokens merged with an adjacent layer (MiniCache), shared with it; ``pair_role`` 0 or 1.
        self.merged: MergedPair | None = None
        self.pair_role: int | None = None
        #: This layer's index and all layers of its cache (cross-layer methods read a neighbour).
        self.index = 0
        self.siblings: list[KVLayer] = [self]
        self.seen = 0
        #: Real (non-padding) tokens seen, summed over the batch.
        self.seen_real = 0
        #: Per-layer state of the methods (e.g. a budget fixed at prefill), keyed by method name.
        self.state: dict[str, object] = {}
        #: When set, forwards only *score* the stored tokens (into the store extra of this name):
        #: the new tokens are attended with and then forgotten (KVzip's reconstruction pass).
        self.scoring: str | None = None
        self._parked: torch.Tensor | None = None

    # -- HF cache-layer protocol ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._parked is not None:
            raise CacheUsageError(
                "a kvopt cache was updated twice without kvopt attention running in between; "
                "the model must use attn_implementation='kvopt': call kvopt.prepare(model)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._parked = value_states
        attention.park(self, key_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        query_length = args[0] if args and isinstance(args[0], int) else kwargs.get("query_length", 0)
        if isinstance(query_length, torch.Tensor):  # transformers < 5.x passed cache_position
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.3
        return -1

    def reset(self) -> None:
        self.store = DenseKVStore()
        self.prefix = None
        self.quantized = []
        self.merged = None
        self.pair_role = None
        self.seen = self.seen_real = 0
        self.state = {}
        self._parked = None

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
        if self.prefix is not None:
            raise CacheUsageError(f"{action} is not supported after head-wise (ragged) compression such as adakv")
        if self.quantized:
            raise CacheUsageError(f"{action} is not supported once tokens are quantized (kivi)")
        if self.merged is not None:
            raise CacheUsageError(f"{action} is not supported once layers are merged (minicache)")

    # -- the read path ------------------------------------------------------------------------
    def attend(self, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Store the parked tokens, attend over the storage, then let the methods act."""
        if value is not self._parked:
            raise CacheUsageError("kvopt attention received values that this cache layer did not hand out")
        self._parked = None
        batch, new = key.shape[0], key.shape[-2]
        valid = padding[:, -new:] if padding is not None else None
        self.store.append(key, value, self.seen, valid)
        positions = torch.arange(self.seen, self.seen + new, dtype=torch.int32, device=key.device)  # as stored
        is_prefill = self.seen == 0
        self.seen += new
        self.seen_real += batch * new if valid is None else int(valid.sum())
        store = self.store
        if self.scoring is not None:
            real = batch * new if valid is None else int(valid.sum())
            return self._score_and_forget(module, query, positions, scaling, softcap, new, real)
        heads = slice(0, 1) if store.heads_aligned else slice(None)  # aligned heads: one mask for all
        keys = store.keys
        for method in self.methods:
            keys = method.read_keys(self, keys, positions)
        key_positions = store.positions[:, heads]
        key_valid = None if store.all_valid else store.valid[:, heads]
        if self.prefix is None and not self.quantized and self.merged is None:
            output = attention.attend(
                query, keys, store.values, key_positions, key_valid, positions, scaling, sliding_window, softcap
            )
        else:
            output = self._attend_in_parts(query, keys, key_positions, key_valid, positions, scaling, softcap)
        step = AttentionStep(module, query, positions, scaling, is_prefill)
        for method in self.methods:
            method.after_attention(self, step)
        if self.sliding_window is not None:
            self._forget_outside_window()
        return output

    def replay_prefill(self, source: KVLayer, step: AttentionStep) -> None:
        """Take a copy of ``source``'s prefilled tokens and run this layer's methods on them.

        Methods act after attention, so a one-pass prefill's outputs never depend on them: this
        equals prefilling this layer directly, at the cost of a copy (see :meth:`KVCache.replay_prefill`).
        """
        if self.seen or not step.is_prefill:
            raise CacheUsageError("replay_prefill needs an empty cache and a recorded one-pass prefill")
        self.dtype, self.device, self.is_initialized = source.dtype, source.device, True
        self.store = source.store.clone()
        self.seen, self.seen_real = source.seen, source.seen_real
        for method in self.methods:
            method.after_attention(self, step)
        if self.sliding_window is not None:
            self._forget_outside_window()

    def _score_and_forget(self, module, query, positions, scaling, softcap, new: int, new_real: int) -> torch.Tensor:
        """Attend, record the max attention the new queries pay to each older token, drop the new tokens.

        One explicit softmax serves both the scores and the output (no second attention pass).
        """
        if self.prefix is not None or self.quantized or self.merged is not None:
            raise CacheUsageError(
                "kvzip's reconstruction pass needs the prompt dense and in full precision, but this layer already "
                "holds ragged (adakv), quantized (kivi, mixedkv, minikv, tokenquant) or merged (minicache) tokens; "
                "kvzip cannot share a cache with those methods yet: use it alone or with other eviction methods"
            )
        from kvopt.methods.scores import attention_probs, grouped_attention_output

        store = self.store
        step = AttentionStep(module, query, positions, scaling, False)
        probs = attention_probs(self, step, softcap=softcap)  # [B, H_kv, g, q, T]
        old = len(store) - new
        extra = store.extra(self.scoring)[..., :old]
        torch.maximum(extra, probs[..., :old].amax(dim=(2, 3)), out=extra)
        output = grouped_attention_output(probs, store.values).to(query.dtype).contiguous()
        store.end -= new
        self.seen -= new
        self.seen_real -= new_real
        return output

    def _attend_in_parts(self, query, keys, key_positions, key_valid, positions, scaling, softcap) -> torch.Tensor:
        """Attention over the ragged prefix, the quantized tokens and the dense ones, merged exactly."""
        if self.prefix is not None and (softcap is not None or self.sliding_window is not None):
            raise CacheUsageError("head-wise (ragged) budgets do not support soft-capped or sliding-window layers yet")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        parts = []
        if self.prefix is not None:
            parts.append(self.prefix.attend(query, positions, scale))
        parts.extend(part.attend(query, positions, scale, softcap) for part in self.quantized)
        if self.merged is not None:
            parts.append(self.merged.attend(self.pair_role, query, positions, scale, softcap))
        mask = attention.visibility(key_positions, key_valid, positions)
        parts.append(attention.attention_with_lse(query, keys, self.store.values, mask, scale, softcap))
        return attention.merge_with_lse(parts)[0].to(query.dtype).transpose(1, 2).contiguous()

    def quantize_oldest(self, bits: int, group: int, residual: int, key_mode: str = "channel") -> None:
        """Once ``residual`` full-precision tokens are held, quantize all whole groups of ``group``
        (the oldest), leaving fewer than ``group`` in full precision (KIVI's key schedule, so the
        full-precision part stays below ``residual`` tokens). Sliding layers stay in full precision:
        their window already bounds them."""
        if self.sliding_window is not None or self.pair_role is not None or len(self.store) < max(residual, group):
            return  # (a merged layer's tokens are quantized by the merge, as its shared direction)
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
        for part in self.quantized:
            if part.same_format(block):
                part.extend(block)
                return
        self.quantized.append(block)

    def to_ragged(self, selected: list[torch.Tensor]) -> None:
        """Move the stored tokens at ``selected[b * kv_heads + h]`` into a ragged prefix; empty the dense store."""
        if self.prefix is not None:
            raise CacheUsageError("a layer's tokens can be made ragged once (one head-wise compression per cache)")
        store = self.store
        self.prefix = ragged.RaggedKV.gather(store.keys, store.values, store.positions, selected)
        self.store = DenseKVStore()

    def kept_per_row(self) -> torch.Tensor:
        """Real tokens held per batch row (on KV head 0)."""
        kept = self.store.valid_counts()
        for part in self.quantized:
            kept = kept + part.valid_counts()
        if self.merged is not None:
            kept = kept + self.merged.index.valid_counts()
        if self.prefix is not None:
            prefix = self.prefix.counts()[:, 0]
            kept = prefix if kept.numel() == 0 else kept + prefix
        return kept

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
        parts = (self.store, self.prefix, *self.quantized)
        total = sum(part.nbytes() for part in parts if part is not None)
        if self.merged is not None:  # shared by two layers: each counts half (the first the odd byte)
            shared = self.merged.nbytes()
            total += shared // 2 + (shared % 2 if self.pair_role == 0 else 0)
        return total
