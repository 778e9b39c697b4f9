"""Non-uniform, dense-and-sparse quantized KV storage with pre-RoPE keys (KVQuant, arXiv 2401.18079).

Per token and KV head, a key or value vector of ``D`` channels is stored as:

* ``sparse``: its ``k`` outlier channels in fp16 plus a uint8 channel index each ("per-vector
  dense-and-sparse", section 3.4): a fixed count per vector, so the sparse part is a dense
  ``[B, H, T, k]`` array with no CSR bookkeeping;
* ``dense``: the other channels normalized to ``[-1, 1]`` and rounded to the nearest of ``2^b``
  non-uniform levels (a per-layer look-up table fitted offline, section 3.3), ``b`` bits each,
  packed eight codes into ``b`` bytes (so 3 bits pack as densely as 2 and 4).

Keys are stored **pre-RoPE** (section 3.2, :mod:`kvopt.cache.prerope`) and re-rotated at their
positions after dequantization. They are normalized **per channel** over groups of tokens (each
range's ends coded in 8 bits on a per-channel envelope calibrated offline: 2 bytes per channel
and group), after each vector's outliers are found against per-channel ranges calibrated offline
(section 3.1). Calibrated ranges alone (no per-token bytes) lost retrieval on the default model:
17% of passkey/niah prompts right vs 44% for kivi at 2 bits and 1k tokens. Values are normalized
**per token** (fp16 ends, 4 bytes per vector) after their outliers (if any) are taken out. The first ``sinks``
real tokens of each row stay at full precision (section 3.5, attention sinks) in a small dense block.
With cross-layer predictors (AQUA-KV, :mod:`kvopt.cache.crosslayer`) the same codes hold the
residual of each key and value from its prediction (:class:`NonUniformKV`).

Attention never rebuilds the cache: blocks (:func:`~kvopt.cache.quantized.block_elements`) are dequantized
(2 and 4 bits: one gather per byte) into reused workspace buffers, rotated, attended with the log-sum-exp kept,
and merged exactly, as :class:`~kvopt.cache.quantized.QuantizedKV` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvopt.cache import prerope
from kvopt.cache.attention_math import attention_with_lse, attention_with_shared_sums, merge_with_lse, visibility
from kvopt.cache.crosslayer import LayerPredictor
from kvopt.cache.part import tensor_bytes
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quant import records_gradients, workspace
from kvopt.cache.quantized import attend_in_blocks, block_tokens

#: Bits of a non-uniform code.
NUQ_BITS = (2, 3, 4)
#: Codes packed into ``bits`` bytes at a time.
PACK = 8
PARAM_DTYPE = torch.float16
#: Key group ranges are coded on a per-channel envelope of this many calibrated half-ranges either side of the
#: calibrated centre, in ``RANGE_STEPS`` steps (uint8 codes of each end).
ENVELOPE = 2.0
RANGE_STEPS = 255


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


def lookup(packed: torch.Tensor, bits: int, levels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The levels of :func:`pack_codes`' codes, fp32 ``[..., D]`` (written into ``out`` when given, contiguous).

    2 and 4 bits: a byte holds whole consecutive codes, so one gather per byte copies its
    ``8 / bits`` levels at once from a table of one wide element per byte value (16 bytes for
    2 bits), about 4x faster than a row-wise embedding lookup and 10x faster than unpacking
    then indexing.
    """
    shape = (*packed.shape[:-1], packed.shape[-1] * PACK // bits)
    if 8 % bits:
        found = levels[unpack_codes(packed, bits)]
        return found if out is None else out.view(shape).copy_(found)
    table = byte_table(levels, bits)
    wide = None if out is None else out.view(-1).view(table.dtype)
    return torch.index_select(table, 0, packed.reshape(-1).int(), out=wide).view(torch.float32).view(shape)


@functools.lru_cache(maxsize=256)
def _byte_table(levels: tuple[float, ...], bits: int, device: torch.device) -> torch.Tensor:
    fields = torch.arange(256, device=device)[:, None] >> (bits * torch.arange(8 // bits, device=device)) & ((1 << bits) - 1)
    table = torch.tensor(levels, device=device)[fields]  # [256, 8 / bits] fp32: 16 or 8 bytes a row
    return table.view(torch.complex128 if bits == 2 else torch.float64).flatten()


def byte_table(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``[256]`` wide elements, each the ``8 / bits`` fp32 levels of one byte value's codes (made once per level set)."""
    return _byte_table(tuple(levels.tolist()), bits, levels.device)


@dataclass
class LayerCodec:
    """What one layer's quantizer learned offline: levels and key ranges (per model, not per token)."""

    bits: int
    #: Outlier channels kept exactly per key vector and per value vector.
    sparse: int
    value_sparse: int
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
    """Dense-and-sparse codes of ``[B, H, T, D]`` vectors and the ends of each normalization range:
    ``lower/upper`` fp16 ``[B, H, T, 1]`` per token (values), or uint8 codes of the ends on the layer's
    calibrated envelope ``[B, H, T / group, D]`` per channel and ``group`` tokens (keys, :func:`encode_keys`)."""

    codes: torch.Tensor
    sparse_values: torch.Tensor
    sparse_index: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor
    #: Tokens sharing one range.
    group: int = 1

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [self.codes, self.sparse_values, self.sparse_index, self.lower, self.upper]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def narrow(self, start: int, stop: int) -> Vectors:
        """Tokens ``start:stop`` (on range-group boundaries)."""
        first, last = start // self.group, stop // self.group
        return Vectors(
            *(t[:, :, start:stop] for t in (self.codes, self.sparse_values, self.sparse_index)),
            self.lower[:, :, first:last], self.upper[:, :, first:last], self.group,
        )  # fmt: skip

    @staticmethod
    def cat(first: Vectors, second: Vectors) -> Vectors:
        names = ("codes", "sparse_values", "sparse_index", "lower", "upper")
        return Vectors(*(torch.cat([getattr(first, n), getattr(second, n)], dim=2) for n in names), first.group)


def split_outliers(normalized: torch.Tensor, sparse: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``[..., sparse]`` (uint8) of each vector's largest ``|normalized|`` entries, and the
    dense remainder with them zeroed."""
    if not sparse:
        return torch.zeros(*normalized.shape[:-1], 0, dtype=torch.uint8, device=normalized.device), normalized
    index = normalized.abs().topk(sparse, dim=-1).indices
    return index.to(torch.uint8), normalized.scatter(-1, index, 0.0)


def center_half(lower: torch.Tensor, upper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 centre and half-range of ranges given by their ends."""
    lower, upper = lower.float(), upper.float()
    return (upper + lower) / 2, (upper - lower) / 2


def normalized(x: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """``x`` mapped to ``[-1, 1]`` by the range ``lower..upper`` (broadcast; an empty range maps to 0)."""
    center, half = center_half(lower, upper)
    return (x - center) / torch.where(half > 0, half, torch.ones_like(half))


def group_extremes(keys: torch.Tensor, outlier: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 min and max ``[..., T / group, D]`` per channel of each ``group`` tokens of ``keys [..., T, D]``,
    ``outlier`` entries left out (a channel of outliers only: both 0)."""
    *lead, tokens, dim = keys.shape
    grouped = keys.reshape(*lead, tokens // group, group, dim)
    hidden = outlier.reshape(grouped.shape)
    low = grouped.masked_fill(hidden, float("inf")).amin(dim=-2)
    high = grouped.masked_fill(hidden, float("-inf")).amax(dim=-2)
    empty = torch.isinf(low)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


def envelope(codec: LayerCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibrated span each channel's group ranges are coded on: its lower end and the step of one of
    the 255 steps, ``[H, 1, D]`` (``ENVELOPE`` times the calibrated half-range either side of its centre)."""
    half = codec.key_half[:, None] * ENVELOPE
    return codec.key_center[:, None] - half, 2 * half / RANGE_STEPS


def range_codes(low: torch.Tensor, high: torch.Tensor, codec: LayerCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes of group ranges' ends on the envelope, rounded outward (the coded range holds the group;
    beyond the envelope it is clamped to it)."""
    start, step = envelope(codec)
    lower = torch.floor((low - start) / step).clamp_(0, RANGE_STEPS)
    upper = torch.ceil((high - start) / step).clamp_(0, RANGE_STEPS)
    return lower.to(torch.uint8), torch.maximum(lower, upper).to(torch.uint8)


def range_ends(stored: Vectors, codec: LayerCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ends of the key group ranges coded by :func:`range_codes`."""
    start, step = envelope(codec)
    return start + stored.lower.float() * step, start + stored.upper.float() * step


def in_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., T, D]`` viewed as ``[..., T / group, group, D]``."""
    *lead, tokens, dim = x.shape
    return x.view(*lead, tokens // group, group, dim)


def encode_keys(pre_rope: torch.Tensor, codec: LayerCodec, group: int) -> Vectors:
    """Pre-RoPE keys ``[B, H, T, D]`` (fp32, ``T`` a multiple of ``group``): each vector's outliers (largest against
    the calibrated channel ranges) exact, the rest normalized per channel over ``group`` tokens and put on the
    levels. The groups' ranges are stored as 8-bit codes of their ends on a per-channel envelope calibrated
    offline (2 bytes per channel and group instead of 4 for fp16 ends)."""
    stored, normalized_keys = normalize_keys(pre_rope, codec, group)
    stored.codes = pack_codes(nearest_level(normalized_keys.clamp(-1, 1), codec.key_levels), codec.bits)
    return stored


def normalize_keys(pre_rope: torch.Tensor, codec: LayerCodec, group: int) -> tuple[Vectors, torch.Tensor]:
    """The outliers and coded group ranges of :func:`encode_keys` (no codes yet), and the keys normalized by
    those ranges (only the calibrated centre and half-range of ``codec`` are read)."""
    calibrated = (pre_rope - codec.key_center[:, None]) / codec.key_half[:, None]
    index, _ = split_outliers(calibrated, codec.sparse)
    outlier = torch.zeros_like(pre_rope, dtype=torch.bool).scatter_(-1, index.long(), True)
    lower, upper = range_codes(*group_extremes(pre_rope, outlier, group), codec)
    stored = Vectors(torch.empty(0), pre_rope.gather(-1, index.long()).to(PARAM_DTYPE), index, lower, upper, group)
    ends = (end.unsqueeze(-2) for end in range_ends(stored, codec))
    return stored, normalized(in_groups(pre_rope, group), *ends).view(pre_rope.shape)


def decode_keys(stored: Vectors, codec: LayerCodec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pre-RoPE keys ``[B, H, T, D]`` fp32 from :func:`encode_keys`' codes (into ``out`` when given)."""
    keys = lookup(stored.codes, codec.bits, codec.key_levels, out)
    center, half = center_half(*range_ends(stored, codec))
    in_groups(keys, stored.group).mul_(half.unsqueeze(-2)).add_(center.unsqueeze(-2))
    return keys.scatter_(-1, stored.sparse_index.long(), stored.sparse_values.float())


def value_ranges(values: torch.Tensor, sparse: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token vector of ``values [..., D]`` (fp32): its outlier channels (farthest from its mean) and the
    fp16 min and max of the others, ``(outlier index, lower, upper)``."""
    mean = values.mean(dim=-1, keepdim=True)
    index, _ = split_outliers(values - mean, sparse)
    outlier = torch.zeros_like(values, dtype=torch.bool).scatter_(-1, index.long(), True)
    low = values.masked_fill(outlier, float("inf")).amin(dim=-1, keepdim=True)  # outliers take no part in the range
    high = values.masked_fill(outlier, float("-inf")).amax(dim=-1, keepdim=True)
    low, high = torch.where(outlier.all(dim=-1, keepdim=True), mean, low), torch.where(high < low, low, high)
    return index, low.to(PARAM_DTYPE), high.to(PARAM_DTYPE)


def encode_values(values: torch.Tensor, codec: LayerCodec) -> Vectors:
    """Values ``[B, H, T, D]`` (fp32): outliers exact, the rest normalized per token by its own range
    (:func:`value_ranges`) and put on the levels."""
    index, lower, upper = value_ranges(values, codec.value_sparse)
    codes = nearest_level(normalized(values, lower, upper).clamp(-1, 1), codec.value_levels)
    exact = values.gather(-1, index.long()).to(PARAM_DTYPE)
    return Vectors(pack_codes(codes, codec.bits), exact, index, lower, upper)


def decode_values(stored: Vectors, codec: LayerCodec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values ``[B, H, T, D]`` fp32 from :func:`encode_values`' codes (into ``out`` when given)."""
    values = lookup(stored.codes, codec.bits, codec.value_levels, out)
    center, half = center_half(stored.lower, stored.upper)
    values.mul_(half).add_(center)
    return values.scatter_(-1, stored.sparse_index.long(), stored.sparse_values.float())


def bytes_per_vector(dim: int, bits: int, key_sparse: int, value_sparse: int, group: int) -> tuple[float, int]:
    """Bytes of one key vector and one value vector: codes, fp16 outliers with uint8 indices, and range ends
    (keys: a share of their ``group``'s uint8 per-channel codes; values: their own fp16 ends)."""
    codes, outlier = dim * bits // 8, PARAM_DTYPE.itemsize + 1
    return codes + key_sparse * outlier + 2 * dim / group, codes + value_sparse * outlier + 2 * PARAM_DTYPE.itemsize


@dataclass
class DenseBlock:
    """A few full-precision tokens (the attention sinks), post-RoPE as the model gave them."""

    keys: torch.Tensor
    values: torch.Tensor
    index: TokenIndex

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [self.keys, self.values, *self.index.tensors()]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def attend(self, query, query_positions, scaling, softcap):
        mask = visibility(*self.index.span(0, self.index.length), query_positions)
        return attention_with_lse(query, self.keys, self.values, mask, scaling, softcap)


@dataclass
class Reconstruction:
    """Pre-RoPE keys ``[B, H, n, D]`` (fp32) of a part's quantized tokens ``first:first + n``, kept between
    layers of one forward pass (see :meth:`NonUniformKV.reconstruct_keys`); valid while the part holds the
    ``codes`` tensor they were decoded from (parts grow into new tensors, and a rollback restores old ones)."""

    codes: torch.Tensor
    first: int
    keys: torch.Tensor

    def covers(self, codes: torch.Tensor, start: int, stop: int) -> bool:
        return codes is self.codes and self.first <= start and stop <= self.first + self.keys.shape[2]

    def slice(self, start: int, stop: int) -> torch.Tensor:
        return self.keys[:, :, start - self.first : stop - self.first]


@dataclass
class NonUniformKV:
    """A :class:`~kvopt.cache.part.KVPart`: sinks at full precision plus dense-and-sparse non-uniform codes.

    With a ``predictor`` (AQUA-KV), the codes hold what it cannot explain: the residual of each
    pre-RoPE key from a linear function of the ``source`` part's reconstructed keys (the previous
    quantized layer's, for the same tokens in the same slots), and of each value from a linear
    function of this layer's and the source's reconstructed keys. Reading a key then needs the
    source's reconstruction of it, and so on down the layers: each part that feeds another keeps
    its reconstructed keys from its attention call (or its encoding) until the next layer has read
    them (:class:`Reconstruction`, transient, not in ``nbytes``), so a forward pass rebuilds each
    layer's keys once. Predicted values are never rebuilt by attention (:meth:`attend`).
    """

    kind = "non-uniform quantized tokens (kvquant, aquakv)"
    read_order = 1

    keys: Vectors
    values: Vectors
    index: TokenIndex
    codec: LayerCodec
    #: The layer's RoPE angles (per model) and each row's left padding (None: none).
    rope: prerope.RopeTable
    offsets: torch.Tensor | None
    sinks: DenseBlock | None = None
    predictor: LayerPredictor | None = None
    source: NonUniformKV | None = None

    def __post_init__(self) -> None:
        #: True once a later layer's part predicts from this one (set by that part; see :meth:`reconstruct_keys`).
        self.feeds = False
        self.memo: Reconstruction | None = None
        if self.source is not None:
            self.source.feeds = True

    @classmethod
    def encode(
        cls, keys: torch.Tensor, values: torch.Tensor, index: TokenIndex, codec: LayerCodec, rope: prerope.RopeTable,
        offsets: torch.Tensor | None, group: int, predictor: LayerPredictor | None = None,
        source: NonUniformKV | None = None, first: int = 0,
    ) -> NonUniformKV:  # fmt: skip
        """Quantize post-RoPE ``keys`` and ``values [B, H, T, D]`` at the tokens ``index`` describes (``T`` a
        multiple of ``group``, the tokens sharing key ranges); with a ``predictor``, only what it cannot
        explain from ``source``'s tokens ``first:first + T`` (the slots these tokens will occupy)."""
        positions = prerope.rope_positions(index.positions, offsets)
        pre_rope = prerope.rotate(prerope.to_pairs(keys, rope), positions, rope, inverse=True)
        values = values.float()
        if predictor is None:
            return cls(encode_keys(pre_rope, codec, group), encode_values(values, codec), index, codec, rope, offsets)
        source_keys = source.reconstruct_keys(first, first + keys.shape[2])
        predicted = predictor.keys(source_keys)
        stored_keys = encode_keys(pre_rope - predicted, codec, group)
        keys = decode_keys(stored_keys, codec).add_(predicted)  # the decoder's keys, which values are predicted from
        stored_values = encode_values(values - predictor.values(keys, source_keys), codec)
        part = cls(stored_keys, stored_values, index, codec, rope, offsets, predictor=predictor, source=source)
        part.memo = Reconstruction(stored_keys.codes, first, keys)
        return part

    def __len__(self) -> int:
        return self.index.length

    def extend(self, other: NonUniformKV) -> None:
        """Append newer tokens quantized by the same codec (and predictor). A kept reconstruction grows by theirs
        (their encoding made it), so the layer this one feeds reads both without decoding."""
        held, memo = len(self), self.memo
        kept = memo if memo is not None and memo.covers(self.keys.codes, memo.first, held) else None
        self.keys = Vectors.cat(self.keys, other.keys)
        self.values = Vectors.cat(self.values, other.values)
        self.index = self.index.cat(other.index)
        new = other.memo
        if new is None or kept is None:
            self.memo = None if new is None else Reconstruction(self.keys.codes, held, new.keys)
        else:
            keys = torch.cat([kept.slice(kept.first, held), new.keys], dim=2)
            self.memo = Reconstruction(self.keys.codes, kept.first, keys)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts): not the codec, RoPE table or
        predictor (per model) nor the transient reconstruction."""
        held = [*self.keys.tensors(), *self.values.tensors(), *self.index.tensors()]
        if self.offsets is not None:
            held.append(self.offsets)
        return held + (self.sinks.tensors() if self.sinks is not None else [])

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def valid_counts(self) -> torch.Tensor:
        counts = self.index.valid_counts()
        return counts + self.sinks.index.valid_counts() if self.sinks is not None else counts

    def reconstruct_keys(
        self, start: int, stop: int, into: str | None = None, source_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Pre-RoPE keys ``[B, H, stop - start, D]`` (fp32) of quantized tokens ``start:stop``: the kept
        reconstruction when it covers them, else decoded (into the reused workspace ``into`` when named) plus
        the prediction from the source's keys (``source_keys`` when the caller has them)."""
        if self.memo is not None and self.memo.covers(self.keys.codes, start, stop):
            return self.memo.slice(start, stop)
        buffer = None if into is None else workspace(into, self._shape(start, stop), torch.float32, self._device)
        keys = decode_keys(self.keys.narrow(start, stop), self.codec, buffer)
        if self.predictor is not None:
            source_keys = self.source.reconstruct_keys(start, stop) if source_keys is None else source_keys
            self.predictor.keys(source_keys, out=keys)
        return keys

    def reconstruct(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values ``[B, H, stop - start, D]`` (fp32) of quantized tokens ``start:stop``."""
        values = decode_values(self.values.narrow(start, stop), self.codec)
        if self.predictor is None:
            return self.reconstruct_keys(start, stop), values
        source_keys = self.source.reconstruct_keys(start, stop)
        keys = self.reconstruct_keys(start, stop, source_keys=source_keys)
        return keys, self.predictor.values(keys, source_keys, out=values)

    def dequantize(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values ``[B, H, stop - start, D]`` (fp32) of quantized tokens ``start:stop``."""
        stop = len(self) if stop is None else stop
        pre_rope, values = self.reconstruct(start, stop)
        return prerope.from_pairs(self._rotate(pre_rope, start, stop), self.rope), values

    @property
    def _device(self) -> torch.device:
        return self.values.codes.device

    def _shape(self, start: int, stop: int) -> list[int]:
        return [*self.values.codes.shape[:2], stop - start, self.values.codes.shape[-1] * PACK // self.codec.bits]

    def _rotate(self, pre_rope: torch.Tensor, start: int, stop: int, into: str | None = None) -> torch.Tensor:
        """``pre_rope`` keys of tokens ``start:stop`` rotated to their RoPE positions, in pair order (into a
        workspace when named)."""
        positions = prerope.rope_positions(self.index.span(start, stop)[0], self.offsets)
        shape = list(pre_rope.shape)
        out = None if into is None else workspace(f"{into}:rotated", shape, torch.float32, pre_rope.device)
        return prerope.rotate(pre_rope, positions, self.rope, out=out)

    def release(self) -> None:
        """Forget the kept reconstruction (once the layer it feeds has read it, or when it feeds none)."""
        self.memo = None

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(output, lse)`` in fp32 over the sinks and the quantized tokens, block by block.

        A part in a chain of predictions rebuilds all its keys first (a buffer of its own that lives until the
        next layer has read them); the others decode each block into
        reused workspaces. Predicted values are not rebuilt: each block's attention also sums this
        layer's and the source's keys by the attention weights, and the value predictor maps those sums
        (:meth:`~kvopt.cache.crosslayer.LayerPredictor.fold_values`; exact, as attention is linear in values)."""
        parts = [self.sinks.attend(query, query_positions, scaling, softcap)] if self.sinks is not None else []
        query = prerope.to_pairs(query, self.rope)  # the order the rotated keys are in
        batch, heads = self.values.codes.shape[:2]
        per_token = batch * max(heads * query.shape[-1], query.shape[1] * query.shape[2])  # keys, or weights
        step = block_tokens(query.device, per_token, self.keys.group)
        into = None if records_gradients(query) else "nonuniform"
        source_keys = self.source.reconstruct_keys(0, len(self)) if self.predictor is not None else None
        chained = self.feeds or self.predictor is not None
        if chained:
            # A buffer of its own, not a reused workspace: the next layer reads it after other sequences' caches (the
            # engine interleaves them layer by layer) may have rebuilt theirs.
            self.memo = Reconstruction(self.keys.codes, 0, self.reconstruct_keys(0, len(self), None, source_keys))

        def attend_block(start: int, stop: int, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            pre_rope = self.reconstruct_keys(start, stop, None if chained or into is None else f"{into}:keys")
            keys = self._rotate(pre_rope, start, stop, into)
            buffer = None if into is None else workspace(f"{into}:values", self._shape(start, stop), torch.float32,
                                                         self._device)  # fmt: skip
            values = decode_values(self.values.narrow(start, stop), self.codec, buffer)
            if source_keys is None:
                return attention_with_lse(query, keys, values, mask, scaling, softcap)
            shared = [pre_rope, source_keys[:, :, start:stop]]
            return self._folded(attention_with_shared_sums(query, keys, values, shared, mask, scaling, softcap))

        return merge_with_lse(parts + attend_in_blocks(query_positions, self.index, step, attend_block))

    def _folded(self, attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, lse)`` of one block: the residual values' output plus the predicted values' share."""
        output, sums, lse = attended
        return output + self.predictor.fold_values(sums, self.values.codes.shape[1]), lse
