"""Ragged KV storage: per (batch row, KV head) segments of different lengths, flattened.

Head-wise budgets (Ada-KV) leave every head with its own number of tokens. Padding them to a
rectangle would keep the memory they were meant to free, so the survivors are packed into
flat ``[tokens, dim]`` tensors with offsets (the varlen layout of FlashAttention), and
attention runs segment by segment. A ragged prefix is immutable: tokens that arrive later
go to the layer's dense store, and the two attention results are merged exactly through
their log-sum-exp.

The rows may also be held quantized (:meth:`RaggedKV.quantized`: kivi after kvzip), as KIVI
quantizes: keys per channel over groups of a segment's tokens (each segment padded to whole
groups, the padding left out of the ranges: a segment's tokens do not line up with the other
heads'), values per token in groups of channels; each segment is dequantized when attention
reads it. Per channel matters: a few key channels carry outliers (Qwen2.5's reach 20-40x the
median channel), and per-token groups spend their range on them (4-bit, Qwen2.5-Coder-0.5B, 1k
tokens of prose: attention probabilities off by 0.39 in L1 per token groups, 0.10 per channel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvopt.cache import quant
from kvopt.cache.attention_math import attention_with_lse, visibility
from kvopt.cache.part import tensor_bytes
from kvopt.cache.quant import QuantizedGroups
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError

if TYPE_CHECKING:
    from kvopt.cache.layer import KVLayer

#: Rows of a ragged part: ``[tokens, dim]`` at full precision, or quantized per token (``[tokens, dim / G, G]``).
Rows = torch.Tensor | QuantizedGroups


@dataclass
class RaggedKV:
    """A :class:`~kvopt.cache.part.KVPart`: each (batch row, KV head) keeps its own number of tokens."""

    kind = "ragged tokens (head-wise budgets: adakv, kvzip)"
    read_order = 0

    keys: Rows  # [tokens, key_dim]
    values: Rows  # [tokens, value_dim]
    positions: torch.Tensor  # [tokens] int32 sequence indices
    offsets: torch.Tensor  # [batch * kv_heads + 1] int64, segment (b, h) is offsets[b*H+h] : offsets[b*H+h+1]
    batch: int
    kv_heads: int
    #: Keys quantized per channel (:meth:`quantized`): segment ``s``'s tokens are rows ``key_offsets[s]`` to
    #: ``key_offsets[s] + its length`` of the key groups flattened (each segment padded to whole groups). None: keys
    #: are held row by row, as values are (at full precision, or quantized per token by files of older versions).
    key_offsets: torch.Tensor | None = None

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, selected: list[torch.Tensor]) -> RaggedKV:
        """Pack ``selected[b * H + h]`` (slot indices) of dense ``[B, H, T, ...]`` tensors into segments."""
        batch, heads = keys.shape[:2]
        parts_k, parts_v, parts_p, lengths = [], [], [], []
        for segment, index in enumerate(selected):
            b, h = divmod(segment, heads)
            parts_k.append(keys[b, h, index])
            parts_v.append(values[b, h, index])
            parts_p.append(positions[b, h, index])
            lengths.append(index.numel())
        offsets = torch.zeros(len(selected) + 1, dtype=torch.long, device="cpu")  # read by ``tolist``: no device sync
        offsets[1:] = torch.tensor(lengths, device="cpu").cumsum(0)
        return cls(torch.cat(parts_k), torch.cat(parts_v), torch.cat(parts_p), offsets, batch, heads)

    @classmethod
    def move_into(cls, layer: KVLayer, selected: list[torch.Tensor]) -> None:
        """Move ``layer``'s stored tokens at ``selected[b * kv_heads + h]`` into a ragged prefix, emptying its dense
        store (which receives the later tokens)."""
        if layer.parts_of(cls):
            raise CacheUsageError("a layer's tokens can be made ragged once (one head-wise compression per cache)")
        store = layer.store
        layer.add_part(cls.gather(store.keys, store.values, store.positions, selected))
        layer.store = DenseKVStore()

    def quantized(self, bits: int, group: int) -> RaggedKV:
        """The same segments quantized as KIVI does: keys per channel over each segment's tokens in groups of
        ``group`` (a segment padded to whole groups, its padding left out of the ranges), values per token in groups
        of ``group`` channels."""
        lengths = self.offsets[1:] - self.offsets[:-1]
        key_offsets = torch.zeros_like(self.offsets)
        key_offsets[1:] = (-(-lengths // group) * group).cumsum(0)
        segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        rows = (torch.arange(int(self.offsets[-1])) - self.offsets[segment] + key_offsets[segment]).to(self.keys.device)
        padded = self.keys.new_zeros(int(key_offsets[-1]), self.keys.shape[-1])
        padding = torch.ones(padded.shape[0], 1, dtype=torch.bool, device=padded.device)
        padded[rows], padding[rows] = self.keys, False
        keys = quant.quantize(padded.unflatten(0, (-1, group)), bits, dim=-2, ignore=padding.unflatten(0, (-1, group)))
        values = quant.quantize(self.values.unflatten(-1, (-1, min(group, self.values.shape[-1]))), bits)
        return RaggedKV(keys, values, self.positions, self.offsets, self.batch, self.kv_heads, key_offsets)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts)."""
        rows = [t for held in (self.keys, self.values) for t in (held.tensors() if isinstance(held, QuantizedGroups) else [held])]
        return [*rows, self.positions, self.offsets, *([] if self.key_offsets is None else [self.key_offsets])]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def counts(self) -> torch.Tensor:
        """Tokens held per (batch row, KV head), ``[batch, kv_heads]``."""
        return (self.offsets[1:] - self.offsets[:-1]).reshape(self.batch, self.kv_heads)

    def valid_counts(self) -> torch.Tensor:
        """Tokens held per batch row (on KV head 0; padding is never kept)."""
        return self.counts()[:, 0]

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention of ``query [B, H_q, q, D]`` at ``query_positions`` (``[q]`` or ``[B, q]``) over every segment:
        ``(output [B, H_q, q, D], lse [B, H_q, q])``, fp32; soft-capped and windowed as the dense store attends."""
        batch, heads, q_len, _ = query.shape
        group = heads // self.kv_heads
        output = query.new_zeros(batch, heads, q_len, _width(self.values), dtype=torch.float32)
        lse = torch.full((batch, heads, q_len), float("-inf"), dtype=torch.float32, device=query.device)
        bounds = self.offsets.tolist()
        key_bounds = self.key_offsets.tolist() if self.key_offsets is not None else bounds
        for segment in range(self.batch * self.kv_heads):
            start, end = bounds[segment], bounds[segment + 1]
            if start == end:
                continue
            b, h = divmod(segment, self.kv_heads)
            heads_of_group = slice(h * group, (h + 1) * group)
            row_positions = query_positions if query_positions.ndim == 1 else query_positions[b]
            mask = visibility(self.positions[None, None, start:end], None, row_positions, sliding_window)
            keys = self._keys(key_bounds[segment], end - start, query.dtype)[None, None]
            values = _read(self.values, start, end, query.dtype)[None, None]
            segment_output, segment_lse = attention_with_lse(
                query[b : b + 1, heads_of_group], keys, values, mask, scaling, softcap
            )
            output[b, heads_of_group] = segment_output[0]
            lse[b, heads_of_group] = segment_lse[0]
        return output, lse

    def _keys(self, first: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A segment's ``count`` keys from row ``first`` at full precision (``[count, key_dim]``)."""
        if self.key_offsets is None:
            return _read(self.keys, first, first + count, dtype)
        group = self.keys.codes.shape[-2] * 8 // self.keys.bits
        groups = self.keys.select(0, first // group, -(-(first + count) // group))
        return quant.dequantize(groups, dtype).flatten(0, 1)[:count]


def _read(rows: Rows, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:end`` at full precision (quantized rows dequantized)."""
    if isinstance(rows, torch.Tensor):
        return rows[start:end]
    return quant.dequantize(rows.select(0, start, end), dtype).flatten(-2)


def _width(rows: Rows) -> int:
    """Channels of each row."""
    if isinstance(rows, torch.Tensor):
        return rows.shape[-1]
    return rows.scale.shape[-2] * rows.codes.shape[-1] * 8 // rows.bits
