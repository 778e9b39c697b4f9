"""``snapkv``: observation-window scoring with pooling, compressed once at prefill.

SnapKV (Li et al., arXiv 2404.14469): the last ``window`` queries of the prompt predict which
prompt tokens each head will attend to while generating. Scores are the window queries'
softmax attention summed over the window (kvpress and AdaKV use the mean: same ranking),
reduced over the GQA group by the mean (the official code repeats KV heads instead; we never
expand them), smoothed by 1-D pooling, and the top tokens per KV head are kept together with
the window itself. Defaults follow kvpress (window 64, kernel 5, avg pooling). ``budgets=pyramid`` or
``budgets=xkv`` shares the layers' tokens unequally (:mod:`kvopt.methods.budgets`), same total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.errors import MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.budgets import LayerBudgets
from kvopt.methods.scores import attention_probs, pool, reduce_group


@register
@dataclass
class SnapKV(LayerBudgets):
    """Keep, per KV head, the tokens the observation window attends to most (plus the window)."""

    name = "snapkv"
    summary = "observation-window attention + pooling, per KV head, at prefill (SnapKV)"

    window: int = field(default=64, metadata={"help": "observation window (last prompt tokens), always kept"})
    kernel: int = field(default=5, metadata={"help": "pooling kernel over tokens"})
    pooling: str = field(default="avg", metadata={"help": "avg or max"})

    def validate(self) -> None:
        super().validate()
        if self.pooling not in ("avg", "max"):
            raise MethodParameterError(f"{self.name}: pooling={self.pooling!r}; use avg or max")
        if self.kernel < 1:
            raise MethodParameterError(f"{self.name}: kernel={self.kernel} must be >= 1")

    def score(self, layer, step) -> torch.Tensor:
        window = max(1, min(self.window, step.query.shape[-2]))
        probs = attention_probs(layer, step, last=window)  # [B, H_kv, g, w, T]
        scores = reduce_group(probs.sum(dim=3))  # sum over the window, mean over the group
        return pool(scores, self.kernel, self.pooling)
