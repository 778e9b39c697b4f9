"""Quantized KV storage for the tokens that left a layer's full-precision residual.

Layout (KIVI, arXiv 2402.02750): keys are quantized **per channel** in groups of ``group``
consecutive tokens (outlier channels get their own range), stored token-major
``[B, H, groups, group / k, D]`` (``k`` codes per byte, packed along the tokens of a group);
values **per token** in groups of ``group`` channels, ``[B, H, T, D / group, group / k]``.
Both dequantize with broadcasts over contiguous inner axes, and a range of whole groups is a
contiguous slice. Positions and validity follow the tokens (one row for all heads while the
heads hold the same tokens), so attention masks stay exact after eviction.

Attention never rebuilds the full-precision cache: :meth:`QuantizedKV.attend` dequantizes
``BLOCK_TOKENS`` tokens at a time and combines the blocks through their log-sum-exp, the same
exact merge the layer uses to join this part with its full-precision residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.cache import quant
from kvopt.cache.attention import grouped_eager_attention, merge_with_lse, visibility

#: Tokens dequantized at once by attention: bounds the transient full-precision copy.
BLOCK_TOKENS = 1024
KEY_MODES = ("channel", "token")


def shared_rows(positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``positions/valid [B, H, T]``, one row for all heads when they hold the same tokens
    (bookkeeping per token instead of per head and token)."""
    aligned = bool((positions == positions[:, :1]).all()) and bool((valid == valid[:, :1]).all())
    rows = slice(0, 1) if aligned else slice(None)
    return positions[:, rows].clone(), valid[:, rows].clone()


def _channel_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, T, D / group, group]`` (per-token groups of channels)."""
    size = min(group, x.shape[-1])
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


@dataclass
class QuantizedKV:
    keys: quant.QuantizedGroups
    values: quant.QuantizedGroups
    positions: torch.Tensor  # [B, 1 or H, T] int32
    valid: torch.Tensor  # [B, 1 or H, T] bool
    group: int
    key_mode: str
    dtype: torch.dtype

    @classmethod
    def encode(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
        bits: int, group: int, key_mode: str = "channel",
    ) -> QuantizedKV:  # fmt: skip
        """Quantize ``keys/values [B, H, T, D]`` (T a multiple of ``group`` in channel mode)."""
        batch, heads, tokens, dim = keys.shape
        if key_mode == "channel":
            by_tokens = keys.reshape(batch, heads, tokens // group, group, dim)
            padding = ~valid.reshape(batch, heads, tokens // group, group, 1)  # padding stays out of the ranges
            key_codes = quant.quantize(by_tokens, bits, dim=-2, ignore=padding)
        else:
            key_codes = quant.quantize(_channel_groups(keys, group), bits)
        value_codes = quant.quantize(_channel_groups(values, group), bits)
        return cls(key_codes, value_codes, *shared_rows(positions, valid), group, key_mode, keys.dtype)

    def __len__(self) -> int:
        return self.positions.shape[-1]

    @property
    def bits(self) -> int:
        return self.keys.bits

    def same_format(self, other: QuantizedKV) -> bool:
        return (other.bits, other.group, other.key_mode) == (self.bits, self.group, self.key_mode)

    def extend(self, other: QuantizedKV) -> None:
        """Append newer tokens (quantized with the same settings)."""
        if not self.same_format(other):
            raise ValueError("quantized blocks of one part must share bits, group and key mode")
        self.keys = quant.QuantizedGroups.cat([self.keys, other.keys], 2)
        self.values = quant.QuantizedGroups.cat([self.values, other.values], 2)
        heads = max(self.positions.shape[1], other.positions.shape[1])
        self.positions = torch.cat([self.positions.expand(-1, heads, -1), other.positions.expand(-1, heads, -1)], -1)
        self.valid = torch.cat([self.valid.expand(-1, heads, -1), other.valid.expand(-1, heads, -1)], -1)

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes() + sum(
            t.numel() * t.element_size() for t in (self.positions, self.valid)
        )

    def valid_counts(self) -> torch.Tensor:
        """Real tokens held per batch row."""
        return self.valid[:, 0].sum(dim=-1)

    def dequantize(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, stop - start, D]`` of tokens ``start:stop``.

        In channel mode ``start`` must lie on a group boundary (groups span tokens)."""
        stop = len(self) if stop is None else stop
        if self.key_mode == "channel":
            keys = quant.dequantize(self.keys.select(2, start // self.group, -(-stop // self.group)), self.dtype)
        else:
            keys = quant.dequantize(self.keys.select(2, start, stop), self.dtype)
        values = quant.dequantize(self.values.select(2, start, stop), self.dtype)
        batch, heads = values.shape[:2]
        return keys.reshape(batch, heads, stop - start, -1), values.reshape(batch, heads, stop - start, -1)

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(output [B, H_q, q, D], lse [B, H_q, q])`` in fp32, block by block."""
        parts = []
        step = max(BLOCK_TOKENS // self.group, 1) * self.group
        all_valid = bool(self.valid.all())
        for start in range(0, len(self), step):
            stop = min(start + step, len(self))
            keys, values = self.dequantize(start, stop)
            valid = None if all_valid else self.valid[..., start:stop]
            mask = visibility(self.positions[..., start:stop], valid, query_positions)
            parts.append(grouped_eager_attention(query, keys, values, mask, scaling, softcap))
        return merge_with_lse(parts)
