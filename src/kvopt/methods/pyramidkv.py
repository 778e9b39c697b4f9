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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.errors import MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.snapkv import SnapKV


def pyramid_budget(uniform: int, real: int, window: int, layer: int, layers: int, beta: int) -> int:
    """Tokens (window included) layer ``layer`` of ``layers`` keeps for a row of ``real`` tokens.

    ``uniform`` is what uniform SnapKV would keep (window included); averaged over the layers
    the result equals ``uniform`` exactly.
    """
    if real <= uniform:
        return real  # nothing to compress
    average = uniform - window  # B̄, the average prefix budget
    if average <= 0 or layers <= 1 or real < 2 * average:
        return uniform
    low = average // beta
    high = 2 * average - low
    if high >= real - window:
        high = real - window
        low = 2 * average - high
    # budget = high - layer * (high - low) / (layers - 1), rounded half to even, in exact integers.
    quotient, remainder = divmod(high * (layers - 1) - layer * (high - low), layers - 1)
    if 2 * remainder > layers - 1 or (2 * remainder == layers - 1 and quotient % 2):
        quotient += 1
    return quotient + window


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV per KV head, with a budget that decreases linearly from the first layer to the last."""

    name = "pyramidkv"
    runs_in_engine = True
    uniform_budgets = False  # layers keep different numbers of tokens
    summary = "SnapKV selection with pyramidal per-layer budgets (more in lower layers), at prefill (PyramidKV)"
    budget_convention = "ratio = fraction removed, or budget = tokens kept, both averaged over layers (window included)"

    beta: int = field(default=20, metadata={"help": "pyramid steepness: the top layer keeps about budget/beta"})

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise MethodParameterError(f"pyramidkv: beta={self.beta} must be >= 1, e.g. pyramidkv:ratio=0.5,beta=20")

    def targets(self, layer, step) -> torch.Tensor:
        """The uniform SnapKV target per row, re-scaled to this layer's share of the pyramid."""
        key = f"{self.name}.layer_targets"
        if step.is_prefill or key not in layer.state:
            uniform = super().targets(layer, step)
            real = layer.store.valid[:, 0].sum(dim=-1)
            index, layers = step.module.layer_idx, step.module.config.num_hidden_layers
            per_row = [
                pyramid_budget(u, n, self.window, index, layers, self.beta)
                for u, n in zip(uniform.tolist(), real.tolist())
            ]
            layer.state[key] = torch.tensor(per_row, dtype=uniform.dtype, device=uniform.device)
        return layer.state[key]

    def kept_tokens(self, seen_tokens: int) -> int:
        """The average over layers, which equals uniform SnapKV's (the per-layer sizes differ)."""
        return super().kept_tokens(seen_tokens)
