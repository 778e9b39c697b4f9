"""``lava``: one score for entries of every head and layer, so head and layer budgets both adapt.

LAVa (Shen et al., arXiv 2509.09754): evicting entry j of head h loses at most its attention
times what its value adds to the residual stream, so the score of a cache entry is the wrapped
scorer's attention score times the head's largest value norm over the prompt,
``s_hj = a_hj * max_i ||v_hi||_1`` (the public code's bound), which makes entries comparable
across heads: a layer's budget is shared among its heads by Ada-KV's global top-k with a floor
``alpha`` (:func:`kvopt.methods.adakv.allocate`). Across layers, a layer whose scores spread
more needs more entries: each layer's share of the total prefix budget (``L x (B - w)``) is
proportional to the normalised entropy of its scores over all its heads and prefix tokens,
``H_l = -sum p log p / log N`` with ``p = s / sum s``; every layer keeps the ``window`` too.
Survivors are packed per head into ragged storage, so the bytes follow both budgets.

The layer budgets need every layer's scores: each layer scores itself after its attention and
waits, dense, until the last layer of the prefill has scored, then all are compressed at once
(the prefill's peak memory is the lossless one). Sliding-window layers, which compact parts do
not serve, are compressed at once with the uniform share (in the dense store), and take no part in
the layer split.

Deviations: the public code compresses each layer as soon as it is scored with the share the
layers seen so far give it, and later only shrinks it (a layer cannot grow back); here every
layer gets its final share. The code takes the GQA group's max of the scores; here the wrapped
scorer's reduction (mean for snapkv). A layer whose share exceeds its prompt keeps it all and
the rest goes to the others in proportion. Defaults follow the code (window 32, kernel 7, max
pooling, alpha 0.2); ``kernel``/``pooling`` reach scorers that pool.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from kvopt.cache.ragged import RaggedKV
from kvopt.errors import MethodParameterError
from kvopt.methods.adakv import AdaKV, allocate
from kvopt.methods.base import get, register
from kvopt.methods.eviction import keep_top


@register
@dataclass
class LAVa(AdaKV):
    """Ada-KV head budgets on value-weighted scores, with layer budgets from the scores' entropy."""

    name = "lava"
    summary = "value-weighted scores, dynamic head budgets (global top-k) and layer budgets (entropy), ragged (LAVa)"
    runs_in_engine = False  # the last layer compresses every layer together (the whole prompt stays until then)
    ranks_layers_together = True

    window: int = field(default=32, metadata={"help": "most recent tokens every head keeps, counted in the budget"})
    kernel: int = field(default=7, metadata={"help": "pooling kernel of scorers that pool (snapkv)"})
    pooling: str = field(default="max", metadata={"help": "pooling of scorers that pool: avg or max"})

    def validate(self) -> None:
        super().validate()
        if self.pooling not in ("avg", "max") or self.kernel < 1:
            raise MethodParameterError(
                f"lava: pooling={self.pooling!r} must be avg or max and kernel={self.kernel} >= 1, e.g. lava:pooling=max"
            )
        scorer = get(self.scorer)
        pools = {f.name for f in dataclasses.fields(scorer)} & {"kernel", "pooling"}
        self._scorer = scorer(
            ratio=self.ratio, budget=self.budget, window=self.window, **{name: getattr(self, name) for name in pools}
        )

    def after_attention(self, layer, step) -> None:
        if not step.is_prefill:
            return
        targets = self.targets(layer, step)
        scores = self.score(layer, step).float()
        heads = layer.store.keys.shape[1]
        if layer.sliding_window is not None:
            keep_top(layer, scores, targets, self.window)  # parts do not serve a sliding window
        else:
            layer.state[f"{self.name}.scores"] = scores.expand(-1, heads, -1) * value_bound(layer.store, self.window)
        if layer.index == len(layer.siblings) - 1:
            waiting = [other for other in layer.siblings if f"{self.name}.scores" in other.state]
            if waiting:
                self._compress_together(waiting, targets)

    def _compress_together(self, layers: list, targets: torch.Tensor) -> None:
        """Share the layers' prefix budget by the entropy of their scores, then Ada-KV within each layer."""
        scores = [layer.state.pop(f"{self.name}.scores") for layer in layers]
        valid = layers[0].store.valid
        recent = targets.clamp(max=self.window).minimum(valid[:, 0].sum(dim=-1))
        prefix = candidates(valid, recent)  # [B, T]: the tokens heads compete for
        shares = [
            layer_shares([entropy(s[row][:, prefix[row]]) for s in scores], int(targets[row] - recent[row]),
                         int(prefix[row].sum()))
            for row in range(valid.shape[0])
        ]  # fmt: skip
        for index, (layer, layer_scores) in enumerate(zip(layers, scores)):
            layer_targets = torch.tensor([share[index] for share in shares], device=recent.device) + recent
            RaggedKV.move_into(layer, allocate(layer_scores, layer.store.valid, layer_targets, self.window, self.alpha))


def candidates(valid: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: real tokens of each row before its ``recent`` protected ones (head 0's slots)."""
    rank = valid[:, 0].cumsum(dim=-1)
    return valid[:, 0] & (rank <= (valid[:, 0].sum(dim=-1) - recent)[:, None])


def value_bound(store, window: int) -> torch.Tensor:
    """Each head's largest value L1 norm over a row's prefix tokens, ``[B, H_kv, 1]`` (LAVa's ``max ||v||_1``)."""
    real = store.valid[:, 0].sum(dim=-1)
    prefix = candidates(store.valid, real.clamp(max=window))
    norms = store.values.float().abs().sum(dim=-1).masked_fill(~prefix[:, None, :], 0.0)
    return norms.amax(dim=-1, keepdim=True)


def entropy(scores: torch.Tensor) -> float:
    """Normalised entropy of non-negative ``scores`` (any shape) seen as one distribution, in [0, 1]."""
    flat = scores.flatten().double()
    if flat.numel() < 2 or float(flat.sum()) <= 0:
        return 1.0
    p = flat / flat.sum()
    return float(-(p * p.clamp(min=1e-300).log()).sum() / math.log(flat.numel()))


def layer_shares(entropies: list[float], per_layer: int, available: int) -> list[int]:
    """Integer prefix budgets proportional to ``entropies`` summing to ``per_layer x layers``, none above
    ``available`` (the surplus goes to the others in proportion; largest remainders round)."""
    total = min(per_layer * len(entropies), available * len(entropies))
    weights = [max(e, 1e-12) for e in entropies]
    shares = [0.0] * len(weights)
    open_layers = set(range(len(weights)))
    left = float(total)
    while open_layers:
        mass = sum(weights[i] for i in open_layers)
        capped = {i for i in open_layers if left * weights[i] / mass >= available}
        if not capped:
            for i in open_layers:
                shares[i] = left * weights[i] / mass
            break
        for i in capped:
            shares[i] = available
        left -= available * len(capped)
        open_layers -= capped
    floors = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: floors[i] - shares[i])
    for i in by_remainder[: total - sum(floors)]:
        floors[i] += 1
    return floors
