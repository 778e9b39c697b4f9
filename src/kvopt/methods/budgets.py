"""Per-layer budgets: how the layers share a prefill-time eviction's tokens, one mechanism for every scorer.

An eviction method fixes, per batch row, the tokens ``B`` each layer would keep per KV head with equal shares
(window included), from its ``ratio`` or ``budget``. ``budgets=`` decides how the ``L`` layers share ``L·B``:

* ``uniform``: every layer keeps ``B`` (SnapKV, Ada-KV as published).
* ``pyramid``: PyramidKV's linear schedule (arXiv 2406.02069, :func:`pyramid_budget`): the lowest layer the
  most, the top about ``B/beta``.
* ``xkv``: XKV's allocation (arXiv 2412.05896, :func:`xkv_budgets`): each layer's retention curve, the share of
  its attention importance its best tokens keep, is measured once per model
  (:mod:`kvopt.methods.xkv_calibration`); the ``L·(B - w)`` prefix tokens go one at a time to the layer whose
  next token adds the most retention. The marginal gains of a layer never increase, so this greedy is optimal
  for the summed retention (the paper's "globally optimal" allocation), and it equals taking the ``L·(B - w)``
  largest gains of all layers at once, which is how it is computed.

Each allocation sums to ``L·B`` exactly (pyramid: outside its fallbacks to uniform, which do too), so the
memory calculator's per-layer average is exact for the total and one ratio holds the same bytes under every
allocation. A method takes the option by deriving from :class:`LayerBudgets` (snapkv, pyramidkv, adakv).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvopt.errors import MethodParameterError
from kvopt.methods.eviction import Eviction
from kvopt.methods.xkv_calibration import load_or_measure, resample

#: The allocations ``budgets=`` accepts.
ALLOCATIONS = ("uniform", "pyramid", "xkv")


def pyramid_budget(uniform: int, real: int, window: int, layer: int, layers: int, beta: int) -> int:
    """Tokens (window included) layer ``layer`` of ``layers`` keeps for a row of ``real`` tokens under PyramidKV.

    ``uniform`` is what uniform SnapKV would keep (window included); averaged over the layers
    the result equals ``uniform`` exactly (see :mod:`kvopt.methods.pyramidkv` for the schedule).
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


def marginal_gains(retention: torch.Tensor, candidates: int) -> torch.Tensor:
    """``[layers, candidates]``: the retention each layer's i-th best of ``candidates`` prefix tokens adds.

    ``retention [layers, points + 1]`` holds the curves at evenly spaced fractions of the tokens; they are
    read at ``i / candidates`` by linear interpolation. Rounding can break the curves' concavity by an ulp,
    so the gains are made non-increasing (a running minimum): the greedy's optimality rests on it.
    """
    gains = resample(retention.double(), candidates).diff(dim=-1)
    return gains.cummin(dim=-1).values


@functools.lru_cache(maxsize=256)
def xkv_budgets(uniform: int, real: int, window: int, retention: torch.Tensor) -> tuple[int, ...]:
    """Tokens (window included) each layer keeps for a row of ``real`` tokens under XKV's allocation.

    ``uniform`` is the equal share (window included); the layers' ``L·(uniform - window)`` prefix tokens go
    to the largest marginal gains of all layers (ties: the lower layer, then its earlier token, as the
    one-token-at-a-time greedy takes them). Cached per row shape: every layer of a prompt asks once.
    """
    layers = retention.shape[0]
    if real <= uniform:
        return (real,) * layers
    prefix, candidates = uniform - window, real - window
    if prefix <= 0:
        return (uniform,) * layers
    gains = marginal_gains(retention, candidates).flatten()  # layer-major: a stable sort breaks ties as the greedy
    chosen = torch.sort(gains, descending=True, stable=True).indices[: layers * prefix]
    counts = torch.bincount(chosen // candidates, minlength=layers)
    return tuple(int(count) + window for count in counts)


@dataclass
class LayerBudgets(Eviction):
    """A prefill-time eviction whose layers share the row's budget by ``budgets=`` (this module's allocations)."""

    budgets: str = field(
        default="uniform",
        metadata={"help": "how layers share the budget: uniform, pyramid (PyramidKV) or xkv (measured sensitivity, XKV)"},
    )
    beta: int = field(default=20, metadata={"help": "budgets=pyramid: the top layer keeps about budget/beta"})

    def __post_init__(self) -> None:
        #: budgets=xkv: the model's retention curves ``[layers, points + 1]``, set by :meth:`prepare`.
        self.retention: torch.Tensor | None = None
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if self.budgets not in ALLOCATIONS:
            raise MethodParameterError(
                f"{self.name}: budgets={self.budgets!r} is not an allocation; use one of {', '.join(ALLOCATIONS)}, "
                f"e.g. {self.name}:ratio=0.75,budgets=xkv"
            )
        if self.beta < 1:
            raise MethodParameterError(f"{self.name}: beta={self.beta} must be >= 1, e.g. {self.name}:ratio=0.5,beta=20")

    @property
    def uniform_budgets(self) -> bool:  # the engine stores unequal layers in head blocks
        return self.budgets == "uniform"

    def needs_preparation(self) -> bool:
        return self.budgets == "xkv" and self.retention is None

    def prepare(self, model, calibration_text: Callable[[], str]) -> None:
        if self.needs_preparation():
            self.retention = load_or_measure(model, calibration_text)

    def targets(self, layer, step) -> torch.Tensor:
        """The equal share per row, re-scaled to this layer's allocation (fixed at the prefill)."""
        uniform = super().targets(layer, step)
        if self.budgets == "uniform":
            return uniform
        key = f"{self.name}.layer_targets"
        if step.is_prefill or key not in layer.state:
            real = layer.store.valid[:, 0].sum(dim=-1)
            index, layers = step.module.layer_idx, step.module.config.num_hidden_layers
            per_row = [self.layer_budget(u, n, index, layers) for u, n in zip(uniform.tolist(), real.tolist())]
            layer.state[key] = torch.tensor(per_row, dtype=uniform.dtype, device=uniform.device)
        return layer.state[key]

    def layer_budget(self, uniform: int, real: int, layer: int, layers: int) -> int:
        """Tokens (window included) layer ``layer`` keeps for a row of ``real`` tokens whose equal share is ``uniform``."""
        if self.budgets == "pyramid":
            return pyramid_budget(uniform, real, self.window, layer, layers, self.beta)
        if self.retention is None:
            raise MethodParameterError(
                f"{self.name}: budgets=xkv needs the model's layer sensitivity; build the cache with "
                "kvopt.cache(spec, model), or set method.retention = kvopt.methods.xkv_calibration.measure(model, ids)"
            )
        if self.retention.shape[0] != layers:
            raise MethodParameterError(
                f"{self.name}: the layer sensitivity has {self.retention.shape[0]} layers, the model {layers}; "
                "measure it on this model (kvopt.methods.xkv_calibration.measure)"
            )
        return xkv_budgets(uniform, real, self.window, self.retention)[layer]
