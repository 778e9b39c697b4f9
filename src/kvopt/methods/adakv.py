"""``adakv``: head-wise adaptive budgets over any scorer, with real (ragged) storage.

Ada-KV (Feng et al., arXiv 2407.11550): a layer's total budget ``kv_heads x B'`` is shared
among its heads by a global top-k over all heads' scores, so heads with concentrated
attention give slots to heads with dispersed attention; a floor ``alpha`` keeps at least about
``alpha x B'`` per head (``b_h = round((1 - alpha) c_h + alpha B')``). Each head then keeps its
own top ``b_h`` tokens plus the protected ``window``. Unlike kvpress, which masks the losers
and keeps their memory, the survivors are packed per head into a ragged store, so the bytes
held follow the budget. Scores come from the wrapped method (``scorer=snapkv`` by default,
any registered eviction method works); compression happens once, at prefill. The layer's total follows
``budgets=`` (:mod:`kvopt.methods.budgets`: uniform by default, ``pyramid`` as Ada-KV's ``pyram_mode``, or ``xkv``).
Deviations: the window is protected for every head (as SnapKV), not re-scored; sliding-window layers
(Mistral, Gemma 2's local layers), which compact parts do not serve, keep the same budget per head (the
scorer's top tokens per head, in the dense store, which forgets what leaves the window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.cache.ragged import RaggedKV
from kvopt.errors import MethodParameterError
from kvopt.methods.base import get, register
from kvopt.methods.budgets import LayerBudgets
from kvopt.methods.eviction import Eviction, keep_top


@register
@dataclass
class AdaKV(LayerBudgets):
    """Share a layer's budget among its KV heads by a global top-k of the wrapped scorer's scores."""

    name = "adakv"
    summary = "head-wise adaptive budgets (global top-k + floor) over a scorer, ragged storage (Ada-KV)"
    #: The survivors move out of the dense store (see :func:`kvopt.methods.spec.storage`).
    storage = "ragged"
    runs_in_engine = True
    uniform_budgets = False  # heads keep different numbers of tokens

    window: int = field(default=64, metadata={"help": "most recent tokens every head keeps, counted in the budget"})
    scorer: str = field(default="snapkv", metadata={"help": "registered eviction method whose scores are used"})
    alpha: float = field(default=0.2, metadata={"help": "floor: share of the uniform budget every head keeps"})

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.alpha <= 1.0:
            raise MethodParameterError(f"adakv: alpha={self.alpha} must lie in [0, 1]")
        scorer = get(self.scorer)
        if not issubclass(scorer, Eviction) or scorer.score is Eviction.score or self.scorer == self.name:
            raise MethodParameterError(
                f"adakv: scorer={self.scorer!r} must name an eviction method that scores at attention time, e.g. snapkv"
            )
        self._scorer = get(self.scorer)(ratio=self.ratio, budget=self.budget, window=self.window)

    def after_attention(self, layer, step) -> None:
        if not step.is_prefill:
            return
        targets = self.targets(layer, step)
        scores = self._scorer.score(layer, step).float()
        if scores.shape[1] == 1:  # a layer-shared scorer: every head sees the same scores
            scores = scores.expand(-1, layer.store.keys.shape[1], -1)
        if layer.sliding_window is not None:
            keep_top(layer, scores, targets, self.window)  # parts do not serve a sliding window
            return
        RaggedKV.move_into(layer, allocate(scores, layer.store.valid, targets, self.window, self.alpha))

    def score(self, layer, step) -> torch.Tensor:
        return self._scorer.score(layer, step)


def allocate(scores: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor, window: int, alpha: float) -> list[torch.Tensor]:
    """Per (row, head) sorted slot indices to keep: window + head-wise share of the row's budget."""
    batch, heads, tokens = scores.shape
    selected = []
    for row in range(batch):
        real = valid[row, 0]
        slots = torch.nonzero(real).squeeze(-1)  # padding never kept
        recent = min(window, int(targets[row]), slots.numel())
        protected, candidates = slots[slots.numel() - recent :], slots[: slots.numel() - recent]
        per_head = min(int(targets[row]) - recent, candidates.numel())  # B'
        row_scores = scores[row][:, candidates]  # [H, n]
        winners = row_scores.flatten().topk(per_head * heads).indices // max(candidates.numel(), 1)
        counts = torch.bincount(winners, minlength=heads).double()
        budgets = ((1 - alpha) * counts + alpha * per_head).round().long().clamp(max=candidates.numel())
        for head in range(heads):
            best = row_scores[head].topk(int(budgets[head])).indices
            selected.append(torch.cat([candidates[best], protected]).sort().values)
    return selected
