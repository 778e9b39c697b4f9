"""Sparse decode attention: each query attends exactly to the top-k tokens an approximate score finds.

RocketKV's hybrid sparse attention (Behnam et al., arXiv 2502.14051, stage 2). Keys are summarised
per chunk of ``chunk`` consecutive tokens by their element-wise min and max per channel (an upper
bound of ``q . k`` over the chunk, as Quest), so a query reads ``channels`` of the ``head_dim``
channels of one summary per chunk -- the channels where the GQA group's ``|q|`` is largest,
taking the max where the group's query is positive and the min elsewhere (SparQ-style) -- instead
of every key: ``1 / c2`` of the key bytes. The approximate softmax (temperature
``sqrt(d * sum|q_sel| / sum|q|)``) summed over the group ranks the chunks, the top ``topk``
tokens are gathered and attended exactly. Chunks of one token read the keys' selected channels
directly (no summary is stored).

Each batch row keeps its own tokens and its own split (``chunk``, ``channels``, ``topk`` follow
its prompt length), so a sequence attends the same in a batch as alone; padding is never stored.
The part is immutable, like the ragged one: tokens arriving later go to the layer's dense store,
and the two attention results merge exactly through their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.cache.attention import attention_with_lse


@dataclass(frozen=True)
class SparseSplit:
    """Stage-2 settings of one sequence: tokens per key summary, channels read, tokens attended."""

    chunk: int
    channels: int
    topk: int


@dataclass
class SparseRow:
    """One batch row's tokens, ``[kv_heads, tokens, dim]``, with their chunk summaries."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor  # [kv_heads, tokens] int32
    split: SparseSplit
    #: Per chunk, the keys' element-wise min (rows ``0..dim-1``) and max (rows ``dim..2 dim-1``), channel-major
    #: ``[kv_heads, 2 dim, chunks]`` so a step reads its channels as whole rows (the paper's code keeps the same
    #: layout); None for one-token chunks and rows read whole.
    key_bounds: torch.Tensor | None

    @classmethod
    def build(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, split: SparseSplit) -> SparseRow:
        bounds = None
        if split.chunk > 1 and split.topk < keys.shape[1]:
            bounds = chunk_bounds(keys, split.chunk)
        return cls(keys, values, positions.to(torch.int32), split, bounds)

    def __len__(self) -> int:
        return self.keys.shape[1]

    @property
    def exact(self) -> bool:
        """True when the top-k covers every token: plain attention, no approximation."""
        return self.split.topk >= len(self)

    def nbytes(self) -> int:
        held = (self.keys, self.values, self.positions, self.key_bounds)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def select(self, query: torch.Tensor) -> torch.Tensor:
        """Slots of the tokens one query attends to, ``[kv_heads, topk]``: ``query [heads, dim]``.

        Whole chunks in descending approximate score, the last one cut to reach ``topk`` tokens
        (its earliest first), as a token-level top-k of the paper's chunk-constant scores would.
        """
        kv_heads, tokens, dim = self.keys.shape
        split = self.split
        grouped = query.float().reshape(kv_heads, -1, dim)  # [H_kv, g, D]
        magnitude = grouped.abs()
        channels = magnitude.sum(dim=1).topk(split.channels, dim=-1).indices  # [H_kv, r]
        selected = grouped.gather(-1, channels[:, None, :].expand(-1, grouped.shape[1], -1))  # [H_kv, g, r]
        if self.key_bounds is None:
            bound = self.keys.transpose(1, 2).gather(1, channels[..., None].expand(-1, -1, tokens))  # [H_kv, r, T]
        else:  # the max where the group's query is positive, else the min: an upper bound of q . k
            bound = rows(self.key_bounds, channels + dim * (selected.sum(dim=1) > 0))  # [H_kv, r, chunks]
        temperature = (dim * selected.abs().sum(-1) / magnitude.sum(-1).clamp(min=1e-30)).sqrt().clamp(min=1e-15)
        logits = torch.matmul(selected, bound.float()) / temperature[..., None]  # [H_kv, g, chunks]
        chunks = logits.shape[-1]
        last = tokens - split.chunk * (chunks - 1)  # tokens in the last chunk
        # Softmax over *tokens*: a chunk's score is shared by its tokens, so it counts its size.
        sizes = torch.full((chunks,), float(split.chunk), device=logits.device)
        sizes[-1] = last
        normaliser = torch.logsumexp(logits + sizes.log(), dim=-1, keepdim=True)
        chunk_scores = (logits - normaliser).exp().sum(dim=1)  # [H_kv, chunks], summed over the group
        needed = min(chunks, -(-split.topk // split.chunk) + 1)  # enough whole chunks even with the short one
        order = chunk_scores.topk(needed, dim=-1).indices  # best first
        ordered_sizes = torch.where(order == chunks - 1, last, split.chunk)
        before = ordered_sizes.cumsum(-1) - ordered_sizes
        take = (split.topk - before).clamp(min=0).minimum(ordered_sizes)  # tokens taken from each ordered chunk
        offsets = torch.arange(split.chunk, device=order.device)
        slots = order[..., None] * split.chunk + offsets  # [H_kv, needed, chunk]
        return slots[offsets < take[..., None]].reshape(kv_heads, split.topk)

    def attend(
        self, query: torch.Tensor, scaling: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [1, H_q, q, D]`` -> ``(output [1, H_q, q, D], lse [1, H_q, q])``; every stored token is
        older than any query (the part is made at the end of the prefill), so no mask is needed."""
        if self.exact or query.shape[2] > 1:  # several queries (a later prompt chunk) read all, as the paper's prefill
            keys, values = self.keys, self.values
        else:
            slots = self.select(query[0, :, 0])
            keys, values = rows(self.keys, slots), rows(self.values, slots)
        return attention_with_lse(query, keys[None], values[None], None, scaling, softcap)


def rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[h, index[h, i]]`` for ``tensor [H, N, ...]`` and ``index [H, k]``: whole rows, copied once."""
    heads, length = tensor.shape[:2]
    offsets = torch.arange(0, heads * length, length, device=index.device)[:, None]
    flat = tensor.reshape(heads * length, *tensor.shape[2:])
    return flat.index_select(0, (index + offsets).flatten()).reshape(*index.shape, *tensor.shape[2:])


def chunk_bounds(keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """Element-wise min and max of ``keys [H, T, D]`` per chunk of ``chunk`` tokens, channel-major:
    ``[H, 2 D, ceil(T / chunk)]``, the mins first."""
    heads, tokens, dim = keys.shape
    padding = keys.new_empty(heads, -tokens % chunk, dim)  # the last chunk's missing tokens count for nothing
    blocks = (heads, -(-tokens // chunk), chunk, dim)
    low = torch.cat([keys, padding.fill_(float("inf"))], dim=1).reshape(blocks).amin(dim=2)
    high = torch.cat([keys, padding.fill_(float("-inf"))], dim=1).reshape(blocks).amax(dim=2)
    return torch.cat([low, high], dim=-1).transpose(1, 2).contiguous()


@dataclass
class SparseKV:
    """A :class:`~kvopt.cache.part.KVPart`: per batch row, tokens read through hybrid sparse attention."""

    kind = "sparse-attention tokens (rocketkv)"
    read_order = 0

    rows: list[SparseRow]

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               splits: list[SparseSplit]) -> SparseKV:  # fmt: skip
        """The valid tokens of dense ``[B, H, T, ...]`` tensors, each row with its split (every KV head of a
        row holds as many valid tokens)."""
        kept = []
        for row, split in enumerate(splits):
            slots = valid[row].nonzero()[:, 1].reshape(keys.shape[1], -1)  # [H, kept], sorted per head
            tokens = rows(keys[row], slots), rows(values[row], slots), positions[row].gather(1, slots)
            kept.append(SparseRow.build(*tokens, split))
        return cls(kept)

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def valid_counts(self) -> torch.Tensor:
        return torch.tensor([len(row) for row in self.rows], dtype=torch.long)

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [B, H_q, q, D], lse [B, H_q, q])`` in fp32, row by row (each with its own split)."""
        parts = [row.attend(query[index : index + 1], scaling, softcap) for index, row in enumerate(self.rows)]
        return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
