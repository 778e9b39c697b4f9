"""Asymmetric min-max quantization of groups along one axis, with codes bit-packed into bytes.

The codec every quantized store uses (KIVI, Liu et al., arXiv 2402.02750, section 3): per group
of ``G`` elements along axis ``dim``, ``zero = min`` and ``scale = (max - min) / (2^b - 1)``,
codes ``q = clamp(round((x - zero) / scale), 0, 2^b - 1)`` and ``x^ = q * scale + zero``. Scales
and zero-points are kept in fp16 and the codes are computed against the *stored* fp16 values,
so the round-trip error stays within half a step. Codes of ``b`` bits are packed ``8 / b`` per
byte (uint8) along a packing axis (the group axis unless told otherwise), *planar*: byte ``j``
holds elements ``j, j + n, ...`` (``n`` = packed length), so unpacking is one broadcast
shift and mask with no interleaving (several times faster on CPU than an interleaved layout).
Groups are whole tensors slices, so a
range of groups can be dequantized on its own. This module is the kernel boundary: a GPU
kernel can replace :func:`quantize` / :func:`dequantize` without touching the stores.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch

from kvopt.cache.part import tensor_bytes

BITS = (2, 4, 8)
PARAM_DTYPE = torch.float16


def pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Codes (values < 2^bits) -> ``uint8``, ``8 / bits`` per byte along ``dim`` (planar; size must divide)."""
    per_byte = 8 // bits
    size = codes.shape[dim]
    if size % per_byte:
        raise ValueError(f"cannot pack {size} codes of {bits} bits into whole bytes")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    fields = codes.chunk(per_byte, dim=dim)
    packed = fields[0].clone()
    for index, field in enumerate(fields[1:], 1):
        packed |= field << (index * bits)
    return packed


def unpack(
    packed: torch.Tensor, bits: int, dim: int = -1, dtype: torch.dtype = torch.uint8, into: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Inverse of :func:`pack` along ``dim``: the codes as ``dtype``, ``8 / bits`` times longer on ``dim``.

    All fields at once: one broadcast shift puts field ``i`` of every byte on a new axis just
    before ``dim`` (planar order), one mask clears the neighbours' bits, one copy converts.
    Shifting and masking run on ``int32`` words, four bytes at a time, where the strides allow.
    With ``into``, the intermediate and the result live in the reusable buffers of that name
    (see :func:`workspace`), valid until their next use on this thread.
    """
    shape = list(packed.shape)
    dim = dim % packed.ndim
    shape[dim] *= 8 // bits
    if bits == 8:
        return _convert(packed, shape, dtype, into)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    try:
        source, field_mask = packed.view(torch.int32), mask * 0x01010101
    except RuntimeError:  # the byte layout does not fall into whole words
        source, field_mask = packed, mask
    shifts = _shifts(bits, source.dtype, packed.device).view(-1, *[1] * (packed.ndim - dim))
    fields_shape = [*source.shape[:dim], per_byte, *source.shape[dim:]]
    fields = None if into is None else workspace(f"{into}:fields", fields_shape, source.dtype, packed.device)
    fields = torch.bitwise_right_shift(source.unsqueeze(dim), shifts, out=fields)
    fields &= field_mask
    return _convert(fields.view(torch.uint8).reshape(shape), shape, dtype, into)


def _convert(codes: torch.Tensor, shape: list[int], dtype: torch.dtype, name: str | None) -> torch.Tensor:
    """``codes`` as ``dtype`` (a fresh tensor, or the workspace buffer ``name``)."""
    if name is None:
        return codes.to(dtype)
    return workspace(name, shape, dtype, codes.device).copy_(codes)


_WORKSPACES = threading.local()


def records_gradients(tensor: torch.Tensor) -> bool:
    """Whether autograd records what is computed from ``tensor`` here: the backward pass then keeps each
    intermediate, so reads may neither reuse :func:`workspace` buffers nor go through forward-only kernels."""
    return torch.is_grad_enabled() and tensor.requires_grad


def workspace(name: str, shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of ``shape`` (contents undefined), one per name, dtype, device and thread.

    Decode dequantizes the same amount of data at every step of every layer: writing it into
    memory the process already holds avoids fresh multi-megabyte allocations, whose page faults
    cost about as much as the arithmetic. The buffer grows to the largest request and stays
    (for attention: one block, bounded by ``quantized.block_elements``, not by the context).
    """
    buffers = _WORKSPACES.__dict__.setdefault("buffers", {})
    # Tensors made under inference mode cannot be written outside it: one buffer per mode.
    key, numel = (name, dtype, device, torch.is_inference_mode_enabled()), math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


@functools.lru_cache(maxsize=None)
def _shifts(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``0, bits, 2 * bits, ...``: the shift of each field in a byte (made once per setting)."""
    return torch.arange(0, 8, bits, dtype=dtype, device=device)


@dataclass
class QuantizedGroups:
    """Packed codes (packing axis ``dim`` shortened ``8 / bits`` times) with fp16 ``scale``/``zero``
    (group axis of size 1), one scale and zero-point per group."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    dim: int

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [self.codes, self.scale, self.zero]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def select(self, axis: int, start: int, stop: int) -> QuantizedGroups:
        """Groups ``start:stop`` along ``axis`` (an axis other than the group axis)."""
        part = lambda t: t.narrow(axis, start, stop - start)  # noqa: E731
        return QuantizedGroups(part(self.codes), part(self.scale), part(self.zero), self.bits, self.dim)

    @staticmethod
    def cat(parts: list[QuantizedGroups], axis: int) -> QuantizedGroups:
        first = parts[0]
        joined = [torch.cat([getattr(p, name) for p in parts], axis) for name in ("codes", "scale", "zero")]
        return QuantizedGroups(*joined, first.bits, first.dim)


def quantize(
    x: torch.Tensor, bits: int, dim: int = -1, ignore: torch.Tensor | None = None, pack_dim: int | None = None,
) -> QuantizedGroups:  # fmt: skip
    """Quantize ``x`` with one group per slice along ``dim`` (e.g. ``[..., groups, G]`` with ``dim=-1``).

    Codes are packed along ``pack_dim`` (default ``dim``); packing along an outer axis makes
    unpacking copy long contiguous runs. ``ignore`` (bool, broadcastable to ``x``) marks
    elements left out of the min/max (padding); they are still encoded, clamped into their
    group's range.
    """
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {BITS}")
    codes, scale, zero = min_max_codes(x, bits, dim, ignore)
    pack_dim = dim if pack_dim is None else pack_dim
    return QuantizedGroups(pack(codes, bits, pack_dim), scale, zero, bits, pack_dim)


def min_max_codes(
    x: torch.Tensor, bits: int, dim: int = -1, ignore: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes (fp32 integers in ``[0, 2^bits - 1]``) and fp16 ``scale``/``zero`` (axis ``dim`` of size 1)
    of ``x`` with one group per slice along ``dim``: the quantizer of every store and of the codec's lossy
    encodings, which packs any width (e.g. 5 bits) its own way. ``ignore`` as in :func:`quantize`."""
    x = x.float()
    if ignore is not None:
        hidden = ignore.expand(x.shape)
        low = x.masked_fill(hidden, float("inf")).amin(dim=dim, keepdim=True)
        high = x.masked_fill(hidden, float("-inf")).amax(dim=dim, keepdim=True)
        empty = torch.isinf(low)  # a group of padding only
        low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    else:
        low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    span = high - low
    scale = torch.where(span > 0, span / levels, torch.ones_like(span)).to(PARAM_DTYPE)
    zero = low.to(PARAM_DTYPE)
    return torch.round((x - zero.float()) / scale.float()).clamp_(0, levels), scale, zero


def dequantize(q: QuantizedGroups, dtype: torch.dtype = torch.float32, into: str | None = None) -> torch.Tensor:
    """``x^ = code * scale + zero`` in ``dtype``, the shape ``x`` had (in the :func:`workspace` ``into`` when named)."""
    codes = unpack(q.codes, q.bits, q.dim, torch.float32, into)
    return codes.mul_(q.scale).add_(q.zero).to(dtype)  # fp16 parameters promote in place, no copies
