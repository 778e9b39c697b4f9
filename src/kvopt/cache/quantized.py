"""Quantized KV storage for the tokens that left a layer's full-precision residual.

Layout (KIVI, arXiv 2402.02750): keys are quantized **per channel** in groups of ``group``
consecutive tokens (outlier channels get their own range), ``[B, H, T / group, group, D]``
with one scale/zero per group and channel; values **per token** in groups of ``group``
channels, ``[B, H, T / group, group, D / group, group]`` with one scale/zero per token and
channel group. Both pack their codes along the *tokens of a group* (axis 3), so unpacking
copies runs of ``group / k * D`` codes and a range of whole token groups is a contiguous
slice; tokens are always quantized a whole number of groups at a time. Positions and
validity are a :class:`~kvopt.cache.positions.TokenIndex` (no bytes per token while the
tokens are a run of real, head-aligned ones).

Attention never rebuilds the full-precision cache. On a GPU, one query per row (decoding) attends
straight from the codes in a fused kernel (:mod:`kvopt.kernels.quantized_attention`), which also reads
the layer's full-precision residual when this is the layer's only part; otherwise
:meth:`QuantizedKV.attend` dequantizes ``block_elements`` per key/value tensor at a time (into reused
workspace buffers, in fp32, the precision attention computes in) and combines the blocks through their
log-sum-exp, the same exact merge the layer uses to join this part with its full-precision residual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvopt import kernels
from kvopt.cache import quant
from kvopt.cache.attention_math import attention_with_lse, merge_with_lse, visibility
from kvopt.cache.part import tensor_bytes
from kvopt.cache.positions import TokenIndex

if TYPE_CHECKING:
    from kvopt.cache.layer import KVLayer
    from kvopt.cache.storage import DenseKVStore

#: Elements (batch x KV heads x tokens x head dim) of keys, and of values, dequantized at once by
#: attention: bounds the transient full-precision copy whatever the batch and head shape (its
#: buffers are reused by every layer and step). Fewer, larger blocks cost fewer small ops: on the
#: default model (3 KV heads x 64, batch 1), 2 threads, 4-bit at 4k, one layer's attention took
#: 0.52 ms with 4,096-token blocks (this size: 3 MB of fp32 keys) vs 0.54-0.65 ms (2,048) and
#: 0.67 ms (1,024).
BLOCK_ELEMENTS = 4096 * 3 * 64
#: The same bound on an accelerator, where every tensor operation is a kernel launch that costs more than
#: dequantizing megabytes: an H200 decoding the default model after 8k tokens was busy 11.8 of the 66.8 ms
#: a `kivi:bits=2` step took (BENCHMARKS.md, "On a GPU"), so there a block is as large as memory allows
#: (256 MB of fp32 keys: one block per layer for any context of the default model below 340k tokens).
ACCELERATOR_BLOCK_ELEMENTS = 64 * 2**20
KEY_MODES = ("channel", "token")
#: The axis of the tokens within a group, along which codes are packed.
PACK_AXIS = 3


def block_elements(device: torch.device) -> int:
    """Elements of keys (and of values) attention dequantizes at once on ``device``."""
    return BLOCK_ELEMENTS if device.type == "cpu" else ACCELERATOR_BLOCK_ELEMENTS


def attend_in_blocks(
    query_positions: torch.Tensor, index: TokenIndex, step: int,
    attend_block: Callable[[int, int, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """``(output, lse)`` of each block of ``step`` tokens of a coded part, in order, to merge by log-sum-exp.

    ``attend_block(start, stop, mask)`` decodes tokens ``start:stop`` and attends over them under ``mask``
    (:func:`~kvopt.cache.attention_math.visibility` of their positions, None when every query sees them),
    so the full-precision copy never exceeds one block whatever the context (``step``: :func:`block_tokens`).
    """
    # One query sees every stored real token: no positions needed (they are older than it).
    sees_all = query_positions.numel() == 1 and index.valid is None
    parts = []
    for start in range(0, index.length, step):
        stop = min(start + step, index.length)
        mask = None if sees_all else visibility(*index.span(start, stop), query_positions)
        parts.append(attend_block(start, stop, mask))
    return parts


def block_tokens(device: torch.device, per_token: int, group: int) -> int:
    """Tokens per block (whole groups of ``group``) when one token's decoded keys, or values, are ``per_token``
    elements: :func:`block_elements` of them, at least one group."""
    return max(block_elements(device) // per_token // group, 1) * group


def _per_token_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, T / group, group, D / Gc, Gc]`` (per-token groups of ``Gc`` channels)."""
    batch, heads, tokens, dim = x.shape
    channels = min(group, dim)
    return x.reshape(batch, heads, tokens // group, group, dim // channels, channels)


@dataclass
class QuantizedKV:
    """A :class:`~kvopt.cache.part.KVPart`: bit-packed keys and values of one setting (bits, group, key mode)."""

    kind = "quantized tokens (kivi, mixedkv, minikv, tokenquant)"
    read_order = 1

    keys: quant.QuantizedGroups
    values: quant.QuantizedGroups
    index: TokenIndex
    group: int
    key_mode: str
    dtype: torch.dtype

    @classmethod
    def encode(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
        bits: int, group: int, key_mode: str = "channel",
    ) -> QuantizedKV:  # fmt: skip
        """Quantize ``keys/values [B, H, T, D]``, ``T`` a multiple of ``group``."""
        batch, heads, tokens, dim = keys.shape
        if tokens % group:
            raise ValueError(f"quantized blocks hold whole groups: {tokens} tokens is not a multiple of {group}")
        if key_mode == "channel":
            by_tokens = keys.reshape(batch, heads, tokens // group, group, dim)
            padding = ~valid.reshape(batch, -1, tokens // group, group, 1)  # padding stays out of the ranges
            key_codes = quant.quantize(by_tokens, bits, dim=PACK_AXIS, ignore=padding)
        else:
            key_codes = quant.quantize(_per_token_groups(keys, group), bits, dim=-1, pack_dim=PACK_AXIS)
        value_codes = quant.quantize(_per_token_groups(values, group), bits, dim=-1, pack_dim=PACK_AXIS)
        return cls(key_codes, value_codes, TokenIndex.of(positions, valid), group, key_mode, keys.dtype)

    @classmethod
    def move_oldest(cls, layer: KVLayer, count: int, bits: int, group: int, key_mode: str = "channel") -> None:
        """Quantize the ``count`` oldest tokens of ``layer``'s dense store (whole groups) into its quantized parts."""
        store = layer.store
        cls.encode(
            store.keys[:, :, :count], store.values[:, :, :count], store.positions[:, :, :count],
            store.valid[:, :, :count], bits, group, key_mode,
        ).add_to(layer)  # fmt: skip
        store.drop_oldest(count)

    def add_to(self, layer: KVLayer) -> None:
        """Hold these tokens in ``layer``: appended to its part of the same format, or as a new part."""
        for part in layer.parts_of(QuantizedKV):
            if part.same_format(self):
                part.extend(self)
                return
        layer.add_part(self)

    def __len__(self) -> int:
        return self.index.length

    @property
    def bits(self) -> int:
        return self.keys.bits

    @property
    def positions(self) -> torch.Tensor:
        return self.index.positions

    def same_format(self, other: QuantizedKV) -> bool:
        return (other.bits, other.group, other.key_mode) == (self.bits, self.group, self.key_mode)

    def extend(self, other: QuantizedKV) -> None:
        """Append newer tokens (quantized with the same settings)."""
        if not self.same_format(other):
            raise ValueError("quantized blocks of one part must share bits, group and key mode")
        self.keys = quant.QuantizedGroups.cat([self.keys, other.keys], 2)
        self.values = quant.QuantizedGroups.cat([self.values, other.values], 2)
        self.index = self.index.cat(other.index)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts)."""
        return [*self.keys.tensors(), *self.values.tensors(), *self.index.tensors()]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def valid_counts(self) -> torch.Tensor:
        """Real tokens held per batch row."""
        return self.index.valid_counts()

    def dequantize(
        self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None, into: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Keys and values ``[B, H, stop - start, D]`` of tokens ``start:stop`` (on group boundaries).

        ``dtype`` defaults to the dtype the tokens had; with ``into``, they are written into
        :func:`~kvopt.cache.quant.workspace` buffers of that name (valid until their next use).
        """
        stop = len(self) if stop is None else stop
        if start % self.group or stop % self.group:
            raise ValueError(f"dequantize whole groups: {start}:{stop} does not fall on multiples of {self.group}")
        first, last = start // self.group, stop // self.group
        dtype = dtype or self.dtype
        names = (f"{into}:keys", f"{into}:values") if into else (None, None)
        keys = quant.dequantize(self.keys.select(2, first, last), dtype, names[0])
        values = quant.dequantize(self.values.select(2, first, last), dtype, names[1])
        batch, heads = values.shape[:2]
        return keys.reshape(batch, heads, stop - start, -1), values.reshape(batch, heads, stop - start, -1)

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(output [B, H_q, q, D], lse [B, H_q, q])`` in fp32: in the fused kernel where it serves
        (:meth:`decodes_fused`), else block by block."""
        if self.decodes_fused(query, query_positions, softcap) and (fused := self.decode_fused(query, scaling)):
            output, lse = fused
            return output.unsqueeze(2), lse.unsqueeze(2)
        # Autograd keeps each block's keys for the backward pass: then blocks get their own memory.
        into = None if quant.records_gradients(query) else "attend"
        batch, heads, *_, channel_groups, channels = self.values.codes.shape  # [B, H, T/G, G/k, D/Gc, Gc]
        step = block_tokens(query.device, batch * heads * channel_groups * channels, self.group)

        def attend_block(start: int, stop: int, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.dequantize(start, stop, torch.float32, into)
            return attention_with_lse(query, keys, values, mask, scaling, softcap)

        return merge_with_lse(attend_in_blocks(query_positions, self.index, step, attend_block))

    def decodes_fused(self, query: torch.Tensor, query_positions: torch.Tensor, softcap: float | None) -> bool:
        """Whether :meth:`decode_fused` serves this read: one query position (decoding: every stored token is
        older, only padding is hidden), no soft-capping, no autograd, on a device with the kernel, in a layout it
        reads."""
        return (
            query_positions.numel() == 1 and softcap is None
            and not quant.records_gradients(query)
            and kernels.quantized_decode_serves(query.device, self.group, self.bits)
        )  # fmt: skip

    def attend_with_dense(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None,
        dense: DenseKVStore,
    ) -> torch.Tensor | None:  # fmt: skip
        """KVPart's optional hook: a decode step over these codes and the layer's dense residual in one kernel (no
        merges), ``[B, 1, H_q, D]`` in the query's dtype; None where :meth:`decodes_fused` says it does not serve."""
        if not self.decodes_fused(query, query_positions, softcap):
            return None
        batch, heads, _, dim = query.shape
        output = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
        residual = (dense.keys, dense.values, dense.mask_rows()[1])
        return output if self.decode_fused(query, scaling, residual, out=output[:, 0]) else None

    def decode_fused(
        self, query: torch.Tensor, scaling: float,
        dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None, out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``(output [B, H_q, D], lse [B, H_q])`` of one query per row over these codes and the full-precision
        ``dense`` keys, values and validity (the layer's residual, read in the same launch), in two kernel
        launches (:mod:`kvopt.kernels.quantized_attention`); the output in ``out`` when given, else fp32.
        None when the kernel cannot run on this machine (warned once; reads then take the torch path)."""
        from kvopt.kernels import quantized_attention

        packed = [(part.codes, part.scale, part.zero) for part in (self.keys, self.values)]
        return quantized_attention.decode(
            query, *packed, self.bits, self.group, scaling, self.index.valid, dense, out
        )
