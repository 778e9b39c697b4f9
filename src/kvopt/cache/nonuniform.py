"""Non-uniform, dense-and-sparse quantized KV storage with pre-RoPE keys (KVQuant, arXiv 2401.18079).

Per token and KV head, a key or value vector of ``D`` channels is stored as:

* ``sparse``: its ``k`` outlier channels in fp16 plus a uint8 channel index each ("per-vector
  dense-and-sparse", section 3.4): a fixed count per vector, so the sparse part is a dense
  ``[B, H, T, k]`` array with no CSR bookkeeping;
* ``dense``: the other channels normalized to ``[-1, 1]`` and rounded to the nearest of ``2^b``
  non-uniform levels (a per-layer look-up table fitted offline, section 3.3), ``b`` bits each,
  packed eight codes into ``b`` bytes (so 3 bits pack as densely as 2 and 4).

Keys are stored **pre-RoPE** (section 3.2, :mod:`kvopt.cache.prerope`) and re-rotated at their
positions after dequantization. They are normalized **per channel** over groups of tokens (fp16
centre and half-range per channel and group, as KIVI does), after each vector's outliers are
found against per-channel ranges calibrated offline (section 3.1). Calibrated ranges alone (no
per-token bytes) lost retrieval on the default model: 17% of passkey/niah prompts right vs 44%
for kivi at 2 bits and 1k tokens. Values are normalized **per token** (fp16 centre and
half-range, 4 bytes per vector) after their outliers are taken out. The first ``sinks`` real
tokens of each row stay at full precision (section 3.5, attention sinks) in a small dense block.

Attention never rebuilds the cache: blocks of ``BLOCK_ELEMENTS`` are dequantized (2 and 4 bits:
one byte-table lookup per byte), attended with the log-sum-exp kept, and merged exactly, as
:class:`~kvopt.cache.quantized.QuantizedKV` does. Unlike it, the blocks are fresh tensors, not
reused workspaces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvopt.cache import prerope
from kvopt.cache.attention import attention_with_lse, merge_with_lse, visibility
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quantized import BLOCK_ELEMENTS

#: Bits of a non-uniform code.
NUQ_BITS = (2, 3, 4)
#: Codes packed into ``bits`` bytes at a time.
PACK = 8
PARAM_DTYPE = torch.float16


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (< 2^bits, ``D`` a multiple of 8) -> uint8 ``[..., D * bits / 8]``: eight codes per ``bits`` bytes."""
    *lead, dim = codes.shape
    words = codes.to(torch.int64).reshape(*lead, dim // PACK, PACK) << (bits * torch.arange(PACK, device=codes.device))
    words = words.sum(dim=-1, keepdim=True)  # the fields do not overlap: a sum is an or
    parts = (words >> (8 * torch.arange(bits, device=codes.device))) & 0xFF
    return parts.to(torch.uint8).reshape(*lead, dim // PACK * bits)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes ``[..., D]``."""
    *lead, size = packed.shape
    parts = packed.to(torch.int64).reshape(*lead, size // bits, bits) << (8 * torch.arange(bits, device=packed.device))
    words = parts.sum(dim=-1, keepdim=True)
    codes = (words >> (bits * torch.arange(PACK, device=packed.device))) & ((1 << bits) - 1)
    return codes.reshape(*lead, size // bits * PACK)


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted ``levels`` for each element of ``x`` (ties to the lower one)."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(x.contiguous(), midpoints.to(x.device))


def lookup(packed: torch.Tensor, bits: int, levels: torch.Tensor) -> torch.Tensor:
    """The levels of :func:`pack_codes`' codes, fp32 ``[..., D]``.

    2 and 4 bits: a byte holds whole consecutive codes, so one table lookup per byte gives its
    ``8 / bits`` levels at once (:func:`byte_table`), about 4x faster than unpacking then indexing.
    """
    if 8 % bits:
        return levels[unpack_codes(packed, bits)]
    return F.embedding(packed.long(), byte_table(levels, bits)).flatten(-2)


@functools.lru_cache(maxsize=256)
def _byte_table(levels: tuple[float, ...], bits: int, device: torch.device) -> torch.Tensor:
    fields = torch.arange(256)[:, None] >> (bits * torch.arange(8 // bits)) & ((1 << bits) - 1)
    return torch.tensor(levels)[fields].to(device)


def byte_table(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``[256, 8 / bits]``: the levels of the codes of each byte value (made once per level set)."""
    return _byte_table(tuple(levels.tolist()), bits, levels.device)


@dataclass
class LayerCodec:
    """What one layer's quantizer learned offline: levels and key ranges (per model, not per token)."""

    bits: int
    #: Outlier channels kept exactly per vector.
    sparse: int
    #: Sorted levels in ``[-1, 1]``, ``[2^bits]`` fp32, for keys and for values.
    key_levels: torch.Tensor
    value_levels: torch.Tensor
    #: Per KV head and channel: centre and half-range of the pre-RoPE keys, ``[H, D]`` fp32.
    key_center: torch.Tensor
    key_half: torch.Tensor

    def nbytes(self) -> int:
        held = (self.key_levels, self.value_levels, self.key_center, self.key_half)
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Vectors:
    """Dense-and-sparse codes of ``[B, H, T, D]`` vectors with fp16 ranges: ``center/half`` ``[B, H, T, 1]`` per
    token (values) or ``[B, H, T / group, D]`` per channel and ``group`` tokens (keys)."""

    codes: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    center: torch.Tensor
    half: torch.Tensor
    #: Tokens sharing one range.
    group: int = 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.sparse_values, self.sparse_index, self.center, self.half]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def narrow(self, start: int, stop: int) -> Vectors:
        """Tokens ``start:stop`` (on range-group boundaries)."""
        first, last = start // self.group, stop // self.group
        return Vectors(
            *(t[:, :, start:stop] for t in (self.codes, self.sparse_values, self.sparse_index)),
            self.center[:, :, first:last], self.half[:, :, first:last], self.group,
        )  # fmt: skip

    @staticmethod
    def cat(first: Vectors, second: Vectors) -> Vectors:
        names = ("codes", "sparse_values", "sparse_index", "center", "half")
        return Vectors(*(torch.cat([getattr(first, n), getattr(second, n)], dim=2) for n in names), first.group)


def split_outliers(normalized: torch.Tensor, sparse: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``[..., sparse]`` (uint8) of each vector's largest ``|normalized|`` entries, and the
    dense remainder with them zeroed."""
    if not sparse:
        return torch.zeros(*normalized.shape[:-1], 0, dtype=torch.uint8, device=normalized.device), normalized
    index = normalized.abs().topk(sparse, dim=-1).indices
    return index.to(torch.uint8), normalized.scatter(-1, index, 0.0)


def key_ranges(keys: torch.Tensor, outlier: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 centre and half-range ``[..., T / group, D]`` per channel of each ``group`` tokens of ``keys [..., T, D]``,
    ``outlier`` entries left out."""
    *lead, tokens, dim = keys.shape
    grouped = keys.reshape(*lead, tokens // group, group, dim)
    hidden = outlier.reshape(grouped.shape)
    low = grouped.masked_fill(hidden, float("inf")).amin(dim=-2)
    high = grouped.masked_fill(hidden, float("-inf")).amax(dim=-2)
    empty = torch.isinf(low)  # every token of the group is an outlier in this channel
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    center = ((high + low) / 2).to(PARAM_DTYPE)
    half = torch.where(high > low, (high - low) / 2, torch.ones_like(high)).to(PARAM_DTYPE)
    return center, half


def in_ranges(x: torch.Tensor, center: torch.Tensor, half: torch.Tensor, group: int, inverse: bool = False):
    """``x [..., T, D]`` normalized by ranges shared by ``group`` tokens (``inverse``: un-normalized, in place)."""
    *lead, tokens, dim = x.shape
    grouped = x.view(*lead, tokens // group, group, dim)
    center, half = center.unsqueeze(-2).float(), half.unsqueeze(-2).float()
    if inverse:
        return grouped.mul_(half).add_(center).view(x.shape)
    return ((grouped - center) / half).view(x.shape)


def encode_keys(pre_rope: torch.Tensor, codec: LayerCodec, group: int) -> Vectors:
    """Pre-RoPE keys ``[B, H, T, D]`` (fp32, ``T`` a multiple of ``group``): each vector's outliers (largest against
    the calibrated channel ranges) exact, the rest normalized per channel over ``group`` tokens and put on the levels."""
    calibrated = (pre_rope - codec.key_center[:, None]) / codec.key_half[:, None]
    index, _ = split_outliers(calibrated, codec.sparse)
    outlier = torch.zeros_like(pre_rope, dtype=torch.bool).scatter_(-1, index.long(), True)
    center, half = key_ranges(pre_rope, outlier, group)
    codes = nearest_level(in_ranges(pre_rope, center, half, group).clamp(-1, 1), codec.key_levels)
    exact = pre_rope.gather(-1, index.long()).to(PARAM_DTYPE)
    return Vectors(pack_codes(codes, codec.bits), exact, index, center, half, group)


def decode_keys(stored: Vectors, codec: LayerCodec) -> torch.Tensor:
    """Pre-RoPE keys ``[B, H, T, D]`` fp32 from :func:`encode_keys`' codes."""
    keys = in_ranges(lookup(stored.codes, codec.bits, codec.key_levels), stored.center, stored.half, stored.group, True)
    return keys.scatter_(-1, stored.sparse_index.long(), stored.sparse_values.float())


def value_ranges(values: torch.Tensor, sparse: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token vector of ``values [..., D]`` (fp32): its outlier channels (farthest from its mean) and the
    fp16 centre and half-range of the others, ``(normalized, outlier index, center, half)``."""
    mean = values.mean(dim=-1, keepdim=True)
    index, _ = split_outliers(values - mean, sparse)
    outlier = torch.zeros_like(values, dtype=torch.bool).scatter_(-1, index.long(), True)
    low = values.masked_fill(outlier, float("inf")).amin(dim=-1, keepdim=True)  # outliers take no part in the range
    high = values.masked_fill(outlier, float("-inf")).amax(dim=-1, keepdim=True)
    low, high = torch.where(outlier.all(dim=-1, keepdim=True), mean, low), torch.where(high < low, low, high)
    center = ((high + low) / 2).to(PARAM_DTYPE)
    half = torch.where(high > low, (high - low) / 2, torch.ones_like(high)).to(PARAM_DTYPE)
    return (values - center.float()) / half.float(), index, center, half


def encode_values(values: torch.Tensor, codec: LayerCodec) -> Vectors:
    """Values ``[B, H, T, D]`` (fp32): outliers exact, the rest normalized per token by its own range
    (:func:`value_ranges`) and put on the levels."""
    normalized, index, center, half = value_ranges(values, codec.sparse)
    codes = nearest_level(normalized.clamp(-1, 1), codec.value_levels)
    exact = values.gather(-1, index.long()).to(PARAM_DTYPE)
    return Vectors(pack_codes(codes, codec.bits), exact, index, center, half)


def decode_values(stored: Vectors, codec: LayerCodec) -> torch.Tensor:
    """Values ``[B, H, T, D]`` fp32 from :func:`encode_values`' codes."""
    values = lookup(stored.codes, codec.bits, codec.value_levels)
    values = values.mul_(stored.half).add_(stored.center)
    return values.scatter_(-1, stored.sparse_index.long(), stored.sparse_values.float())


def bytes_per_vector(dim: int, bits: int, sparse: int, group: int) -> tuple[float, int]:
    """Bytes of one key vector and one value vector: codes, fp16 outliers with uint8 indices, and ranges
    (keys: a share of their ``group``'s per-channel ranges; values: their own)."""
    sparse_bytes = sparse * (PARAM_DTYPE.itemsize + 1)
    ranges = 2 * PARAM_DTYPE.itemsize
    return dim * bits // 8 + sparse_bytes + ranges * dim / group, dim * bits // 8 + sparse_bytes + ranges


@dataclass
class DenseBlock:
    """A few full-precision tokens (the attention sinks), post-RoPE as the model gave them."""

    keys: torch.Tensor
    values: torch.Tensor
    index: TokenIndex

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2 + self.index.nbytes()

    def attend(self, query, query_positions, scaling, softcap):
        mask = visibility(*self.index.span(0, self.index.length), query_positions)
        return attention_with_lse(query, self.keys, self.values, mask, scaling, softcap)


@dataclass
class NonUniformKV:
    """A :class:`~kvopt.cache.part.KVPart`: sinks at full precision plus dense-and-sparse non-uniform codes."""

    kind = "non-uniform quantized tokens (kvquant)"
    read_order = 1

    keys: Vectors
    values: Vectors
    index: TokenIndex
    codec: LayerCodec
    #: The layer's RoPE angles (per model) and each row's left padding (None: none).
    rope: prerope.RopeTable
    offsets: torch.Tensor | None
    sinks: DenseBlock | None = None

    @classmethod
    def encode(
        cls, keys: torch.Tensor, values: torch.Tensor, index: TokenIndex, codec: LayerCodec, rope: prerope.RopeTable,
        offsets: torch.Tensor | None, group: int,
    ) -> NonUniformKV:  # fmt: skip
        """Quantize post-RoPE ``keys`` and ``values [B, H, T, D]`` at the tokens ``index`` describes (``T`` a
        multiple of ``group``, the tokens sharing key ranges)."""
        positions = prerope.rope_positions(index.positions, offsets)
        pre_rope = prerope.rotate(keys, positions, rope, inverse=True)
        stored_keys = encode_keys(pre_rope, codec, group)
        stored_values = encode_values(values.float(), codec)
        return cls(stored_keys, stored_values, index, codec, rope, offsets)

    def __len__(self) -> int:
        return self.index.length

    def extend(self, other: NonUniformKV) -> None:
        """Append newer tokens quantized by the same codec."""
        self.keys = Vectors.cat(self.keys, other.keys)
        self.values = Vectors.cat(self.values, other.values)
        self.index = self.index.cat(other.index)

    def nbytes(self) -> int:
        held = self.keys.nbytes() + self.values.nbytes() + self.index.nbytes()
        offsets = 0 if self.offsets is None else self.offsets.numel() * self.offsets.element_size()
        return held + offsets + (self.sinks.nbytes() if self.sinks is not None else 0)

    def valid_counts(self) -> torch.Tensor:
        counts = self.index.valid_counts()
        return counts + self.sinks.index.valid_counts() if self.sinks is not None else counts

    def dequantize(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values ``[B, H, stop - start, D]`` (fp32) of quantized tokens ``start:stop``."""
        stop = len(self) if stop is None else stop
        pre_rope = decode_keys(self.keys.narrow(start, stop), self.codec)
        positions = prerope.rope_positions(self.index.span(start, stop)[0], self.offsets)
        keys = prerope.rotate(pre_rope, positions, self.rope)
        return keys, decode_values(self.values.narrow(start, stop), self.codec)

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(output, lse)`` in fp32 over the sinks and the quantized tokens, block by block."""
        parts = [self.sinks.attend(query, query_positions, scaling, softcap)] if self.sinks is not None else []
        batch, heads = self.values.codes.shape[:2]
        group = self.keys.group
        step = max(BLOCK_ELEMENTS // (batch * heads * query.shape[-1]) // group, 1) * group
        sees_all = query_positions.numel() == 1 and self.index.valid is None
        for start in range(0, len(self), step):
            stop = min(start + step, len(self))
            keys, values = self.dequantize(start, stop)
            mask = None if sees_all else visibility(*self.index.span(start, stop), query_positions)
            parts.append(attention_with_lse(query, keys, values, mask, scaling, softcap))
        return merge_with_lse(parts)

