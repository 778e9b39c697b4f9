"""Sparse decode attention: each query attends exactly to the top-k tokens an approximate score finds.

RocketKV's hybrid sparse attention (Behnam et al., arXiv 2502.14051, stage 2). Keys are summarised
per chunk of ``chunk`` consecutive tokens by their element-wise min and max per channel (an upper
bound of ``q . k`` over the chunk, as Quest), so a query reads ``channels`` of the ``head_dim``
channels of one summary per chunk -- the channels where the GQA group's ``|q|`` is largest,
taking the max where the group's query is positive and the min elsewhere (SparQ-style) -- instead
of every key: ``1 / c2`` of the key bytes. The approximate softmax (temperature
``sqrt(d * sum|q_sel| / sum|q|)``) summed over the group ranks the chunks; the best whole chunks
covering ``topk`` tokens are gathered and attended exactly. Chunks of one token read the keys'
selected channels directly (no summary is stored).

Cheap on a CPU, where a decode step's small tensor operations cost more than the bytes they read:
a step is about twenty operations per layer (no per-token masks or positions: every stored token is
older than the query), whole chunks are gathered (no cut inside the last one), and the
``len % chunk`` newest tokens, which no whole chunk holds, are always attended (no short last
chunk to correct the softmax for).

Each batch row keeps its own tokens and its own split (``chunk``, ``channels``, ``topk`` follow
its prompt length), so a sequence attends the same in a batch as alone; padding is never stored.
Consecutive rows with as many tokens and the same split are stored as one run whose heads are the
rows' KV heads, so a step costs one set of operations per layer for the run, not one per row.
The part is immutable, like the ragged one: tokens arriving later go to the layer's dense store,
and the two attention results merge exactly through their log-sum-exp.

Quantized (``rocketkv+tokenquant``): each token's key and value are stored in ``bits`` per element
with one fp16 scale and zero-point per group of channels (:class:`QuantizedVectors`, tokenquant's
per-token layout), so a step dequantizes only the tokens it attends to. KIVI's per-channel key
groups span tokens and could not be read chunk by chunk. The summaries are taken from the keys
before quantization and held in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

import torch

from kvopt.cache import quant
from kvopt.cache.attention_math import attention_with_lse
from kvopt.cache.part import tensor_bytes


@dataclass(frozen=True)
class SparseSplit:
    """Stage-2 settings of one sequence: tokens per key summary, channels read, tokens attended."""

    chunk: int
    channels: int
    topk: int

    def skips_tokens_of(self, tokens: int) -> bool:
        """True when a row of ``tokens`` tokens is read sparsely (else it stays dense and is read whole)."""
        return self.topk < tokens


@dataclass(frozen=True)
class Quantizer:
    """Per-token quantization of a sparse part's vectors: ``bits`` per element, groups of ``group`` channels."""

    bits: int
    group: int


@dataclass
class PlainVectors:
    """Vectors ``[kv_heads, tokens, dim]`` held as they came."""

    tensor: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def whole(self) -> torch.Tensor:
        return self.tensor

    def take(self, slots: torch.Tensor) -> torch.Tensor:
        """The vectors at flat indices ``slots`` into ``[kv_heads * tokens]``, as ``[kv_heads, -1, dim]``."""
        heads, _, dim = self.tensor.shape
        return self.tensor.reshape(-1, dim).index_select(0, slots).view(heads, -1, dim)

    def heads(self, start: int, stop: int) -> PlainVectors:
        return PlainVectors(self.tensor[start:stop])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [self.tensor]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())


@dataclass
class QuantizedVectors:
    """Vectors ``[kv_heads, tokens, dim]`` quantized per token in groups of channels (codes packed along each
    group's channels), so any tokens dequantize on their own."""

    groups: quant.QuantizedGroups  # codes [H, T, dim / Gc, Gc * bits / 8], scale and zero [H, T, dim / Gc, 1]
    shape: torch.Size

    @classmethod
    def encode(cls, x: torch.Tensor, quantizer: Quantizer) -> QuantizedVectors:
        heads, tokens, dim = x.shape
        channels = min(quantizer.group, dim)
        grouped = x.reshape(heads, tokens, dim // channels, channels)
        return cls(quant.quantize(grouped, quantizer.bits, dim=-1), x.shape)

    def whole(self) -> torch.Tensor:
        return quant.dequantize(self.groups).view(self.shape)

    def take(self, slots: torch.Tensor) -> torch.Tensor:
        heads, tokens, dim = self.shape
        picked = (t.reshape(heads * tokens, *t.shape[2:]).index_select(0, slots)
                  for t in (self.groups.codes, self.groups.scale, self.groups.zero))  # fmt: skip
        part = quant.QuantizedGroups(*picked, self.groups.bits, self.groups.dim)
        return quant.dequantize(part).view(heads, -1, dim)

    def heads(self, start: int, stop: int) -> QuantizedVectors:
        picked = (t[start:stop] for t in (self.groups.codes, self.groups.scale, self.groups.zero))
        return QuantizedVectors(quant.QuantizedGroups(*picked, self.groups.bits, self.groups.dim),
                                torch.Size((stop - start, *self.shape[1:])))  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return self.groups.tensors()

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())


Vectors = PlainVectors | QuantizedVectors


@dataclass
class SparseRow:
    """One batch row's tokens, ``[kv_heads, tokens, dim]``, with their chunk summaries."""

    keys: Vectors
    values: Vectors
    positions: torch.Tensor  # [kv_heads, tokens] int32
    split: SparseSplit
    #: Per whole chunk, the keys' element-wise min (rows ``0..dim-1``) and max (rows ``dim..2 dim-1``),
    #: channel-major ``[kv_heads, 2 dim, chunks]`` so a step reads its channels as whole rows (the paper's code
    #: keeps the same layout); None for one-token chunks and rows read whole.
    key_bounds: torch.Tensor | None

    @classmethod
    def build(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, split: SparseSplit,
        quantizer: Quantizer | None = None,
    ) -> SparseRow:  # fmt: skip
        """A row of full-precision ``keys/values [kv_heads, tokens, dim]``, stored quantized when a ``quantizer``
        is given (the summaries then come from the keys before quantization, in fp16; one-token chunks, which
        have none, are searched on the stored keys)."""
        store = PlainVectors if quantizer is None else lambda x: QuantizedVectors.encode(x, quantizer)
        row = cls(store(keys), store(values), positions.to(torch.int32), split, None)
        if split.chunk > 1 and not row.exact:
            bounds = chunk_bounds(keys[:, : row.chunks * split.chunk], split.chunk)
            row.key_bounds = bounds if quantizer is None else bounds.to(quant.PARAM_DTYPE)
        return row

    def __len__(self) -> int:
        return self.positions.shape[1]

    def heads(self, start: int, stop: int) -> SparseRow:
        """The KV heads ``start:stop`` (views, no copies)."""
        bounds = None if self.key_bounds is None else self.key_bounds[start:stop]
        return SparseRow(self.keys.heads(start, stop), self.values.heads(start, stop), self.positions[start:stop],
                         self.split, bounds)  # fmt: skip

    @property
    def chunks(self) -> int:
        """Whole chunks; the newest ``len % chunk`` tokens are always attended."""
        return len(self) // self.split.chunk

    @property
    def exact(self) -> bool:
        """True when the chunks attended cover every token: plain attention, no approximation."""
        return -(-self.split.topk // self.split.chunk) >= self.chunks

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        index = [t for t in (self.positions, self.key_bounds) if t is not None]
        return [*self.keys.tensors(), *self.values.tensors(), *index]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def select(self, query: torch.Tensor) -> torch.Tensor:
        """The chunks one query attends to, best first, ``[kv_heads, ceil(topk / chunk)]``: ``query [heads, dim]``."""
        kv_heads, tokens, dim = self.keys.shape
        grouped = query.float().reshape(kv_heads, -1, dim)  # [H_kv, g, D]
        magnitude = grouped.abs()
        channels = magnitude.sum(dim=1).topk(self.split.channels, dim=-1).indices[:, None, :]  # [H_kv, 1, r]
        channels = channels.expand(-1, grouped.shape[1], -1)
        selected = grouped.gather(-1, channels)  # [H_kv, g, r]
        if self.key_bounds is None:
            keys = self.keys.whole().transpose(1, 2)
            bound = keys.gather(1, channels[:, 0, :, None].expand(-1, -1, tokens))  # [H_kv, r, T]
        else:  # the max where the group's query is positive, else the min: an upper bound of q . k
            first = channels[:, 0]
            bound = rows(self.key_bounds, torch.where(selected.sum(dim=1) > 0, first + dim, first))  # [H_kv, r, chunks]
        # 1 / temperature, temperature = sqrt(D sum|q_sel| / sum|q|) per query head
        inverse = (magnitude.sum(-1) / (dim * magnitude.gather(-1, channels).sum(-1)).clamp(min=1e-30)).sqrt()
        # Chunks are equally long, so the softmax over tokens ranks them as the softmax over chunks does.
        logits = torch.matmul(selected, bound.float()) * inverse[..., None]  # [H_kv, g, chunks]
        scores = torch.softmax(logits, dim=-1).sum(dim=1)  # summed over the group
        return scores.topk(-(-self.split.topk // self.split.chunk), dim=-1).indices

    def slots(self, chunks: torch.Tensor) -> torch.Tensor:
        """Flat indices into ``keys.view(kv_heads * tokens, dim)`` of the tokens of ``chunks [kv_heads, n]`` and of
        the newest tokens no whole chunk holds."""
        chunk = self.split.chunk
        inside, tail = _slot_offsets(self.keys.shape[0], len(self), chunk, self.positions.device)
        return torch.cat([(chunks[..., None] * chunk + inside).flatten(1), tail], dim=1)

    def attend(
        self, query: torch.Tensor, scaling: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [1, H_q, q, D]`` -> ``(output [1, H_q, q, D], lse [1, H_q, q])``; every stored token is
        older than any query (the part is made at the end of the prefill), so no mask is needed."""
        # Several queries (a later prompt chunk) read all tokens, as the paper's prefill does.
        if not self.exact and query.shape[2] == 1:
            slots = self.slots(self.select(query[0, :, 0])).flatten()
            keys, values = self.keys.take(slots), self.values.take(slots)
        else:
            keys, values = self.keys.whole(), self.values.whole()
        return attention_with_lse(query, keys[None], values[None], None, scaling, softcap)


@lru_cache(maxsize=256)
def _slot_offsets(kv_heads: int, tokens: int, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inside [H, 1, chunk], tail [H, tokens % chunk])``: flat offsets of a chunk's tokens from its first, per
    head, and the flat indices of the tail tokens (made once per shape: a decode step then adds one product)."""
    heads = torch.arange(kv_heads, device=device)[:, None] * tokens
    whole = tokens // chunk * chunk
    inside = (heads + torch.arange(chunk, device=device))[:, None, :]
    return inside, heads + torch.arange(whole, tokens, device=device)


def rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[h, index[h, i]]`` for ``tensor [H, N, ...]`` and ``index [H, k]``: whole rows, copied once."""
    heads, length = tensor.shape[:2]
    offsets = torch.arange(0, heads * length, length, device=index.device)[:, None]
    flat = tensor.reshape(heads * length, *tensor.shape[2:])
    return flat.index_select(0, (index + offsets).flatten()).reshape(*index.shape, *tensor.shape[2:])


def chunk_bounds(keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """Element-wise min and max of ``keys [H, T, D]`` (``T`` a multiple of ``chunk``) per chunk, channel-major:
    ``[H, 2 D, T / chunk]``, the mins first."""
    heads, tokens, dim = keys.shape
    blocks = keys.reshape(heads, tokens // chunk, chunk, dim)
    return torch.cat([blocks.amin(dim=2), blocks.amax(dim=2)], dim=-1).transpose(1, 2).contiguous()


@dataclass
class SparseRun:
    """Consecutive batch rows holding as many tokens with the same split, stored as one :class:`SparseRow` whose
    heads are the rows' KV heads one row after another: a decode step searches and attends for all of them in
    one pass (a row's query heads map onto its own KV heads, as GQA groups do)."""

    rows: int
    tokens: SparseRow

    def attend(self, query: torch.Tensor, scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [rows, H_q, q, D]`` -> ``(output [rows, H_q, q, D], lse [rows, H_q, q])``."""
        rows, heads, length, dim = query.shape
        output, lse = self.tokens.attend(query.reshape(1, rows * heads, length, dim), scaling, softcap)
        return output.view(rows, heads, length, dim), lse.view(rows, heads, length)


@dataclass
class SparseKV:
    """A :class:`~kvopt.cache.part.KVPart`: per batch row, tokens read through hybrid sparse attention."""

    kind = "sparse-attention tokens (rocketkv)"
    read_order = 0

    runs: list[SparseRun]

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               splits: list[SparseSplit], quantizer: Quantizer | None = None) -> SparseKV:  # fmt: skip
        """The valid tokens of dense ``[B, H, T, ...]`` tensors, each row with its split (every KV head of a
        row holds as many valid tokens), quantized per token when a ``quantizer`` is given."""
        counts = valid[:, 0].sum(dim=-1).tolist()
        runs = []
        for (_, split), members in groupby(range(len(splits)), key=lambda row: (counts[row], splits[row])):
            tokens = []
            for row in members:
                slots = valid[row].nonzero()[:, 1].reshape(keys.shape[1], -1)  # [H, kept], sorted per head
                tokens.append((rows(keys[row], slots), rows(values[row], slots), positions[row].gather(1, slots)))
            stacked = (torch.cat(parts) for parts in zip(*tokens))  # the run's rows' heads one after another
            runs.append(SparseRun(len(tokens), SparseRow.build(*stacked, split, quantizer)))
        return cls(runs)

    def row(self, index: int) -> SparseRow:
        """Batch row ``index``'s tokens (views into its run)."""
        for run in self.runs:
            if index < run.rows:
                heads = run.tokens.keys.shape[0] // run.rows
                return run.tokens.heads(index * heads, (index + 1) * heads)
            index -= run.rows
        raise IndexError(f"no batch row {index}")

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts)."""
        return [t for run in self.runs for t in run.tokens.tensors()]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def valid_counts(self) -> torch.Tensor:
        counts = [len(run.tokens) for run in self.runs for _ in range(run.rows)]
        return torch.tensor(counts, dtype=torch.long, device="cpu")  # bookkeeping from Python lengths, as ragged offsets

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [B, H_q, q, D], lse [B, H_q, q])`` in fp32, run by run (each with its own split)."""
        parts, first = [], 0
        for run in self.runs:
            parts.append(run.attend(query[first : first + run.rows], scaling, softcap))
            first += run.rows
        if len(parts) == 1:
            return parts[0]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
