"""``h2o``: Heavy-Hitter Oracle, accumulated attention plus a recent window, at every step.

H2O (Zhang et al., arXiv 2306.14048): a few "heavy-hitter" tokens receive most of the
attention mass. Each stored token carries its *accumulated* attention -- a sum, not a mean,
as in the paper: at the prefill the column sums over all prompt queries, then the new row
of every later forward pass. Whenever the cache is over budget, each KV head keeps its
``window`` most recent tokens plus the ``budget - window`` older tokens with the largest
accumulated attention; evicted tokens and their scores are gone for good (the real-drop
variant). The accumulators live in a store extra, so they follow the tokens through every
eviction and compaction; a new token starts at 0 and is credited the attention it receives
from its own query onward.

Deviations from the paper and its code:

* GQA: the official code targets MHA. Here scores are kept per KV head, the mean over the
  query heads of the group (sum over steps and mean over the group commute, so this is the
  mean of per-query-head accumulators); storage is never expanded.
* Budget: ``budget`` (tokens kept, recent window included) or ``ratio`` (fraction of the
  prefill removed); the paper sizes heavy and recent parts as fractions of the prompt (10% +
  10%). ``window`` defaults to half of the kept tokens, the paper's equal heavy/recent split.
* The prompt is compressed right after the prefill (the paper's simulation keeps the prompt
  whole and masks from the next step on); later forward passes evict after their attention,
  so a new token first attends to the full cache of the previous step plus itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction
from kvopt.methods.scores import accumulate_attention


@register
@dataclass
class H2O(Eviction):
    """Keep, per KV head, the recent window plus the tokens with the most accumulated attention."""

    name = "h2o"
    summary = "accumulated attention (heavy hitters) + recent window, per KV head, every step (H2O)"
    schedule = "decode"

    window: int | None = field(
        default=None,
        metadata={"help": "recent tokens always kept, counted in the budget (default: half of it, as H2O)"},
    )

    def validate(self) -> None:
        if self.window is None:  # the default (half the kept tokens) always fits; check the rest
            dataclasses.replace(self, window=0)
        else:
            super().validate()

    def recent_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """Recent tokens protected per batch row, ``[batch]``."""
        if self.window is None:
            return targets // 2
        return targets.clamp(max=self.window)

    def after_attention(self, layer, step) -> None:
        self.accumulate(layer, step)
        super().after_attention(layer, step)  # the recent window is protected by ``score`` (it may differ per row)

    def accumulate(self, layer, step) -> None:
        accumulate_attention(layer, step, self.name)

    def score(self, layer, step) -> torch.Tensor:
        scores = layer.store.extra(self.name)  # [B, H_kv, T]
        tokens = scores.shape[-1]
        recent = self.recent_tokens(self.targets(layer, step))
        slots = torch.arange(tokens, device=scores.device)
        is_recent = slots[None, :] >= (tokens - recent.to(scores.device))[:, None]  # [B, T]
        return scores.masked_fill(is_recent[:, None, :], float("inf"))
