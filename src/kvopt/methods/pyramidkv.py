"""``pyramidkv``: SnapKV selection with pyramidal per-layer budgets, compressed once at prefill.

PyramidKV (Cai et al., arXiv 2406.02069): attention "funnels" from broad in the lower layers
to a few tokens in the upper ones, so lower layers get more budget and upper layers less, for
the same total. Scoring and selection are SnapKV's (inherited, not copied); only the number of
tokens each layer keeps changes. Budget schedule from KVCache-Factory ``PyramidKVCluster``,
per batch row, with ``B`` the uniform SnapKV target (window included), ``w`` the window,
``n`` the row's real prompt tokens and ``B̄ = B - w`` the average prefix budget::

    min = B̄ // beta;  max = 2·B̄ - min
    if max >= n - w:  max = n - w;  min = 2·B̄ - max
    budget_l = max - l·(max - min)/(L - 1)   (layer 0 keeps the most), kept_l = budget_l + w

Edge cases as in KVCache-Factory: ``n <= B`` keeps everything; ``n < 2·B̄`` falls back to
uniform SnapKV (so with ``ratio`` below ~0.5 this *is* SnapKV); a window as large as ``B`` or
a one-layer model is uniform too.

Deviation: KVCache-Factory floors the step (``(max - min) // (L - 1)``), so its layers keep on
average up to (L-2)/2 tokens *more* than the uniform budget. Here the step is exact and each
layer's budget is rounded half-to-even; the series is symmetric about ``B̄``, so the total over
layers equals ``L·B`` exactly and pyramidkv holds the same bytes as snapkv at equal settings.
The schedule is :func:`kvopt.methods.budgets.pyramid_budget` (``snapkv:budgets=pyramid`` is this method).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.methods.base import register
from kvopt.methods.budgets import pyramid_budget
from kvopt.methods.snapkv import SnapKV

__all__ = ["PyramidKV", "pyramid_budget"]  # the schedule lives in budgets.py, the one allocation mechanism


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV per KV head, with a budget that decreases linearly from the first layer to the last."""

    name = "pyramidkv"
    runs_in_engine = True
    summary = "SnapKV selection with pyramidal per-layer budgets (more in lower layers), at prefill (PyramidKV)"
    budget_convention = "ratio = fraction removed, or budget = tokens kept, both averaged over layers (window included)"

    budgets: str = field(default="pyramid", metadata={"help": "how layers share the budget: pyramid, uniform or xkv"})
