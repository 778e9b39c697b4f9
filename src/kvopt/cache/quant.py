"""Asymmetric min-max quantization in groups along the last axis, with codes bit-packed into bytes.

The codec every quantized store uses (KIVI, Liu et al., arXiv 2402.02750, section 3): per group
of ``G`` consecutive elements, ``zero = min`` and ``scale = (max - min) / (2^b - 1)``, codes
``q = clamp(round((x - zero) / scale), 0, 2^b - 1)`` and ``x^ = q * scale + zero``. Scales and
zero-points are kept in fp16 and the codes are computed against the *stored* fp16 values, so
the round-trip error stays within half a step. Codes of ``b`` bits are packed ``8 / b`` per
byte (uint8), element ``i`` of a byte in bits ``[i*b, (i+1)*b)``: real storage, not int8
tensors holding small numbers. This module is the kernel boundary: a GPU kernel can replace
:func:`quantize` / :func:`dequantize` without touching the stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)
PARAM_DTYPE = torch.float16


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., n]`` (values < 2^bits) -> ``uint8 [..., n * bits / 8]``; ``n`` must be a multiple of ``8 / bits``."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits into whole bytes")
    if bits == 8:
        return codes.to(torch.uint8)
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., m]`` -> codes ``uint8 [..., m * 8 / bits]``."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    # One plain shift-and-mask per field (broadcast shifts over uint8 are ~3x slower on CPU).
    fields = [(packed >> shift) & mask if shift else packed & mask for shift in range(0, 8, bits)]
    return torch.stack(fields, dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass
class QuantizedGroups:
    """Packed codes ``[..., n * bits / 8]`` with fp16 ``scale``/``zero`` ``[..., n / group]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def quantize(x: torch.Tensor, bits: int, group: int, ignore: torch.Tensor | None = None) -> QuantizedGroups:
    """Quantize ``x [..., n]`` in groups of ``group`` consecutive elements of the last axis.

    ``ignore`` (bool, broadcastable to ``x``) marks elements left out of the min/max (padding);
    they are still encoded, clamped into their group's range.
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {BITS}")
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"the quantized axis has {n} elements, not a multiple of group={group}")
    grouped = x.float().reshape(*x.shape[:-1], n // group, group)
    if ignore is not None:
        hidden = ignore.expand(x.shape).reshape(grouped.shape)
        low = grouped.masked_fill(hidden, float("inf")).amin(dim=-1)
        high = grouped.masked_fill(hidden, float("-inf")).amax(dim=-1)
        empty = torch.isinf(low)  # a group of padding only
        low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    else:
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    span = high - low
    scale = torch.where(span > 0, span / levels, torch.ones_like(span)).to(PARAM_DTYPE)
    zero = low.to(PARAM_DTYPE)
    codes = torch.round((grouped - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, levels)
    return QuantizedGroups(pack(codes.reshape(x.shape), bits), scale, zero, bits, group)


def dequantize(q: QuantizedGroups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x^ = code * scale + zero``, shape ``[..., n]``, in ``dtype``."""
    codes = unpack(q.codes, q.bits).to(torch.float32)
    grouped = codes.reshape(*codes.shape[:-1], -1, q.group)
    values = torch.addcmul(q.zero.float()[..., None], grouped, q.scale.float()[..., None])
    return values.reshape(codes.shape).to(dtype)
