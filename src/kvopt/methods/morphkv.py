"""``morphkv``: the recent window's queries choose the older tokens; a constant-size cache.

MorphKV (Ghadia et al., arXiv 2503.00979, ICML'25): while generating long responses, keep per
KV head the ``window`` (W) most recent tokens plus the ``budget - W`` (C - W) older tokens the
recent queries attend to most. For each of the W recent queries, the raw logits of the GQA
group's query heads are summed, a softmax is taken over the *older* tokens only, and the
rows are fused by ``aggregation``: ``sum`` (``sum_fused``) or ``max`` (``max_fused``).
Selection is redone whenever the cache is over budget, so the cache stays constant in size
(H2O's accumulated scores, by contrast, favour old tokens).

The W recent queries (post-RoPE) are not part of the KV cache; this method keeps them in
``layer.state`` -- already summed over each GQA group, since the sum of a group's logits
``sum_h q_h . k`` equals ``(sum_h q_h) . k`` -- so the extra memory is W x H_kv x head_dim per
layer and row (fp32), not MorphKV's W x T logit cache.

Deviations from the paper and its code:

* Budget: ``budget`` = C counts every kept token, the window included, so the steady state
  holds C tokens; MorphKV's steady state is C + 1 (its window is W tokens plus the current
  one). ``morphkv:budget=C+1,window=W+1`` is the closest match. ``ratio`` is also accepted.
* The scoring queries are those of the W kept window tokens, the newest one included (kvopt
  evicts after the current token's attention); MorphKV scores with the W queries before the
  current token, and evicts before the current token attends.
* The prompt is compressed right after the prefill with its last W queries, where MorphKV
  does it at the first decode step; ``compress_every`` plays the role of ``evict_after``.
* Logits are scaled like the model's attention (``scaling``) and not soft-capped.
* Defaults: W = 32 and ``sum`` fusion (the repository's LongBench setting; its CLI default
  is ``max``, LongGenBench uses W = 200 with ``max``).
* Batch reordering (beam search) is not supported: the stored queries do not follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.cache.attention_math import default_scale
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction


@register
@dataclass
class MorphKV(Eviction):
    """Keep the recent window plus the older tokens its queries attend to most, per KV head."""

    name = "morphkv"
    summary = "recent-window queries select older tokens; constant-size cache while generating (MorphKV)"
    schedule = "decode"

    window: int = field(
        default=32, metadata={"help": "W: recent tokens always kept (in the budget); their queries score the rest"}
    )
    aggregation: str = field(default="sum", metadata={"help": "fuse the W queries' attention: sum or max"})

    def validate(self) -> None:
        super().validate()
        if self.window < 1:
            raise MethodParameterError(f"morphkv: window={self.window} must be >= 1 (its queries score the tokens)")
        if self.aggregation not in ("sum", "max"):
            raise MethodParameterError(f"morphkv: aggregation={self.aggregation!r}; use sum or max")

    def after_attention(self, layer, step) -> None:
        self.remember_queries(layer, step)
        super().after_attention(layer, step)

    def remember_queries(self, layer, step) -> None:
        """Keep the last W queries, summed per GQA group: ``[B, H_kv, W, D]`` fp32, and their validity ``[B, W]``."""
        key = f"{self.name}.queries"
        store = layer.store
        batch, heads, new, dim = step.query.shape
        kv_heads = store.keys.shape[1]
        last = min(new, self.window)
        queries = step.query[:, :, -last:].float().reshape(batch, kv_heads, heads // kv_heads, last, dim).sum(dim=2)
        valid = self._query_validity(store, step.query_positions[-last:])
        if not step.is_prefill and key in layer.state:
            old_queries, old_valid = layer.state[key]
            if old_queries.shape[0] != batch:
                raise CacheUsageError("morphkv does not support reordering the batch (beam search) yet")
            queries = torch.cat([old_queries, queries], dim=2)[:, :, -self.window :]
            valid = torch.cat([old_valid, valid], dim=1)[:, -self.window :]
        layer.state[key] = (queries.contiguous(), valid.clone())

    @staticmethod
    def _query_validity(store, positions: torch.Tensor) -> torch.Tensor:
        """``[B, queries]``: whether each query's token is real and still stored (it votes, else not)."""
        newest = store.positions[:, 0, -positions.numel() :]
        if newest.shape[-1] == positions.numel() and bool((newest == positions).all()):
            return store.valid[:, 0, -positions.numel() :]  # the new tokens are the newest slots
        # An earlier method of the spec evicted some of this step's tokens: match them by position.
        stored = (store.positions[:, 0, :, None] == positions) & store.valid[:, 0, :, None]
        return stored.any(dim=1)

    def score(self, layer, step) -> torch.Tensor:
        store = layer.store
        queries, query_valid = layer.state[f"{self.name}.queries"]  # [B, H_kv, w, D], [B, w]
        tokens = len(store)
        older = max(0, tokens - self.window)
        scale = default_scale(queries, step.scaling)
        keys = store.keys[:, :, :older].float()
        logits = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [B, H_kv, w, older]
        logits = logits.masked_fill(~store.valid[:, :, None, :older], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # over the older tokens only
        probs = probs * query_valid[:, None, :, None]  # padding queries vote for nothing
        fused = probs.sum(dim=2) if self.aggregation == "sum" else probs.amax(dim=2)
        # Window slots rank above every older token (fused scores are at most W), the newest highest.
        window = torch.arange(tokens - older, device=fused.device, dtype=fused.dtype) + (self.window + 1)
        return torch.cat([fused, window.expand(*fused.shape[:2], -1)], dim=-1)
