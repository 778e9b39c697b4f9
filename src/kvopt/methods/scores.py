"""Scoring building blocks shared by eviction methods (GQA-aware, never expanding stored KV).

Scores are computed at query-head granularity and reduced within each GQA group *before*
selection (mean by default), so selection happens per KV head, the granularity of storage.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvopt.cache.attention_math import default_scale, grouped_logits, visibility

#: Bound on the fp32 attention block scored at once (elements), so long prompts never build n x n probabilities.
CHUNK_ELEMENTS = 1 << 26


def attention_probs(layer, step, last: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention (fp32) of the newest ``last`` queries over the layer's stored keys.

    Returns ``[batch, kv_heads, group, queries, tokens]``: query heads grouped by the KV head
    they read, masked like the real attention (causal by position, padding, per-head slots, the
    sliding window: :func:`~kvopt.cache.attention_math.visibility`).
    """
    store = layer.store
    query = step.query if last is None else step.query[:, :, -last:]
    query_positions = step.query_positions if last is None else step.query_positions[..., -last:]
    batch, heads, queries, _ = query.shape
    kv_heads = store.keys.shape[1]
    logits = grouped_logits(query, store.keys, default_scale(query, step.scaling), softcap)
    logits = logits.reshape(batch, kv_heads, heads // kv_heads, queries, -1)
    key_positions, key_valid = store.mask_rows()
    query_positions = query_positions.to(key_positions.dtype)
    masked = logits
    newest = key_positions[..., -queries:]  # fewer than the queries after an earlier method's eviction
    newest_are_queries = newest.shape[-1] == queries and bool((newest == query_positions.reshape(-1, 1, queries)).all())
    if layer.sliding_window is None and newest_are_queries:
        # The queries are the newest stored tokens: older slots need only their validity bit, only the
        # last ``queries`` slots a causal mask (far less masking work when few queries score many keys).
        if key_valid is not None:
            logits[..., :-queries].masked_fill_(~key_valid[:, :, None, None, :-queries], float("-inf"))
            key_valid = key_valid[..., -queries:]
        masked, key_positions = logits[..., -queries:], newest
    mask = visibility(key_positions, key_valid, query_positions, layer.sliding_window)
    if mask is not None:
        masked.masked_fill_(~mask[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)


def grouped_attention_output(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention output ``[batch, queries, heads, head_dim]`` from :func:`attention_probs`' weights.

    Lets a caller that needs the probabilities anyway (KVzip's scoring pass) skip a second
    attention computation; KV heads are read once per group, never expanded.
    """
    batch, kv_heads, group, queries, tokens = probs.shape
    output = torch.matmul(probs.reshape(batch, kv_heads, group * queries, tokens), values.float())
    return output.reshape(batch, kv_heads * group, queries, -1).transpose(1, 2)


def reduce_group(scores: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """Collapse the GQA group axis (axis 2) of ``[batch, kv_heads, group, ...]`` scores."""
    if how == "mean":
        return scores.mean(dim=2)
    if how == "max":
        return scores.amax(dim=2)
    if how == "sum":
        return scores.sum(dim=2)
    raise ValueError(f"unknown group reduction {how!r}; use mean, max or sum")


def pool(scores: torch.Tensor, kernel: int, kind: str = "avg") -> torch.Tensor:
    """1-D pooling along tokens (stride 1, same length), as SnapKV smooths its scores."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if kind == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)  # zero padding, as SnapKV
    elif kind == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"unknown pooling {kind!r}; use avg or max")
    return pooled[..., : shape[-1]].reshape(shape)


def accumulate_attention(layer, step, name: str, last: int | None = None) -> None:
    """Add the attention of the newest ``last`` queries (all if None) to the store extra ``name``.

    Summed over queries, averaged over each GQA group, per stored token; scored in chunks of
    queries so a long prompt never builds its whole attention matrix (H2O, mixed precision).
    """
    store = layer.store
    if not store.has_extra(name):
        store.add_extra(name)
    scores = store.extra(name)
    query, query_positions = step.query, step.query_positions
    if last is not None:
        query, query_positions = query[:, :, -last:], query_positions[-last:]
    batch, heads, queries, _ = query.shape
    # Two queries at least: a lone query is taken for the newest token (no causal mask), which only a last chunk holds.
    chunk = max(2, CHUNK_ELEMENTS // max(1, batch * heads * len(store)))
    for start in range(0, queries, chunk):
        part = dataclasses.replace(
            step, query=query[:, :, start : start + chunk], query_positions=query_positions[start : start + chunk]
        )
        scores += attention_probs(layer, part).sum(dim=3).mean(dim=2)
