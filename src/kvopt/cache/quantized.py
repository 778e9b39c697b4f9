"""Quantized KV storage for the tokens that left a layer's full-precision residual window.

Layout (KIVI, arXiv 2402.02750): keys are quantized **per channel** in groups of ``group``
consecutive tokens (outlier channels get their own range), values **per token** in groups of
``group`` channels; codes are bit-packed (:mod:`kvopt.cache.quant`). Tokens arrive in whole key
groups, oldest first, and are appended; positions and validity follow them (one row for all
heads while the heads hold the same tokens), so attention masks stay exact after eviction.

Attention never rebuilds the full-precision cache: :meth:`QuantizedKV.attend` dequantizes
``block_tokens`` tokens at a time and combines the blocks through their log-sum-exp, the same
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


@dataclass
class QuantizedKV:
    keys: quant.QuantizedGroups  # channel mode: codes [B, H, D, T*bits/8]; token mode: [B, H, T, D*bits/8]
    values: quant.QuantizedGroups  # [B, H, T, D*bits/8], groups along channels
    positions: torch.Tensor  # [B, 1 or H, T] int32
    valid: torch.Tensor  # [B, 1 or H, T] bool
    key_mode: str
    dtype: torch.dtype

    @classmethod
    def encode(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
        bits: int, group: int, key_mode: str = "channel",
    ) -> QuantizedKV:  # fmt: skip
        """Quantize ``keys/values [B, H, T, D]`` (T a multiple of ``group`` in channel mode)."""
        dim = values.shape[-1]
        padding = ~valid[..., None]  # [B, H, T, 1]: padding stays out of the key ranges
        if key_mode == "channel":
            key_codes = quant.quantize(keys.transpose(-1, -2), bits, group, ignore=padding.transpose(-1, -2))
        else:
            key_codes = quant.quantize(keys, bits, min(group, keys.shape[-1]))
        value_codes = quant.quantize(values, bits, min(group, dim))
        aligned = bool((positions == positions[:, :1]).all()) and bool((valid == valid[:, :1]).all())
        rows = slice(0, 1) if aligned else slice(None)
        return cls(key_codes, value_codes, positions[:, rows].clone(), valid[:, rows].clone(), key_mode, keys.dtype)

    def __len__(self) -> int:
        return self.positions.shape[-1]

    @property
    def bits(self) -> int:
        return self.keys.bits

    @property
    def group(self) -> int:
        return self.keys.group

    def same_format(self, other: QuantizedKV) -> bool:
        return (other.bits, other.group, other.key_mode) == (self.bits, self.group, self.key_mode)

    def extend(self, other: QuantizedKV) -> None:
        """Append newer tokens (quantized with the same settings)."""
        if not self.same_format(other):
            raise ValueError("quantized blocks of one part must share bits, group and key mode")
        key_axis = -1 if self.key_mode == "channel" else 2
        self.keys = _cat(self.keys, other.keys, key_axis)
        self.values = _cat(self.values, other.values, 2)
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
        """Keys and values ``[B, H, stop - start, D]`` of tokens ``start:stop`` (``start`` on a group boundary)."""
        stop = len(self) if stop is None else stop
        if self.key_mode == "channel":
            per_byte, group = 8 // self.bits, self.group
            keys = quant.QuantizedGroups(
                self.keys.codes[..., start // per_byte : -(-stop // per_byte)],
                self.keys.scale[..., start // group : -(-stop // group)],
                self.keys.zero[..., start // group : -(-stop // group)],
                self.bits, group,
            )  # fmt: skip
            key_tensor = quant.dequantize(keys, self.dtype).transpose(-1, -2)
        else:
            key_tensor = quant.dequantize(_token_slice(self.keys, start, stop), self.dtype)
        return key_tensor, quant.dequantize(_token_slice(self.values, start, stop), self.dtype)

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


def _token_slice(q: quant.QuantizedGroups, start: int, stop: int) -> quant.QuantizedGroups:
    return quant.QuantizedGroups(
        q.codes[:, :, start:stop], q.scale[:, :, start:stop], q.zero[:, :, start:stop], q.bits, q.group
    )


def _cat(a: quant.QuantizedGroups, b: quant.QuantizedGroups, axis: int) -> quant.QuantizedGroups:
    return quant.QuantizedGroups(
        torch.cat([a.codes, b.codes], axis), torch.cat([a.scale, b.scale], axis), torch.cat([a.zero, b.zero], axis),
        a.bits, a.group,
    )  # fmt: skip
