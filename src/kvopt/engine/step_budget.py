"""How many prompt tokens the next step may compute: stall-free batching sized from measured step times.

A step that computes a long prompt's prefill makes every decoding sequence wait for it: one 3,000-token prefill
beside four chat users took their p99 inter-token latency from 0.19 s to 10.3 s on a 2-core CPU (issue 72). As in
Sarathi-Serve (OSDI 2024), every running decode goes into every step and prompt chunks fill the rest of a budget;
unlike vLLM's and SGLang's fixed token budgets, the budget here is sized for an inter-token latency target from a
model of step time fitted online to the steps this engine has just run, on this machine, under its present load:

    seconds ~= fixed + per_token * tokens computed + per_pair * (query, key) pairs attended

A chunk of ``n`` prompt tokens after ``p`` computed ones attends ``n * p + n * (n + 1) / 2`` pairs; a decode attends
the tokens its sequence holds (fewer for a compressed sequence: its real cost). The fit is least squares over the
recent steps, kept per torch thread count (a change of threads is a different machine), with the steps that
computed prompts kept apart from decode-only ones so that a long run of decodes does not forget what a prompt costs.

With nothing decoding, a step may run :data:`IDLE_TARGET_STEPS` times the target: a prompt alone keeps nearly all of
its throughput (a step's fixed cost is a few percent of such a step), and a request arriving meanwhile waits that
long at most for its turn, not for a whole 6,000-token prefill. Every step gives the first prompt part-way through,
and the first waiting prompt, at least :data:`MIN_PREFILL_CHUNK` tokens each, so both always progress, even under a
target no step can meet.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvopt.engine.metrics import Histogram

#: Prompt tokens every step grants (when a prompt waits and the token budget allows), whatever the target says.
MIN_PREFILL_CHUNK = 32
#: ``itl_target_ms="auto"``: each step's target is this many times the decode-only step of the sequences decoding in
#: it (as the model predicts it; at least this many times one sequence's decode step timed at start-up): a chat
#: user's p99 stays within about that many of its p50 steps, and prompts get the rest, about two thirds of the time.
AUTO_TARGET_STEPS = 3.0
#: With nothing decoding, a step may take this many times the target (a prompt alone is nearly unchunked).
IDLE_TARGET_STEPS = 10.0
#: Steps kept per kind (decode-only, with prompt tokens) for the fit: recent enough to follow a contended machine.
WINDOW = 48
#: Once the decode window is full, decode-only steps refit the model every this many (a fit is a few least-squares
#: solves, ~0.3 ms: 3% of a single request's decode step on one core); a step with prompt tokens refits at once.
REFIT_EVERY = 8
#: Feature scales (tokens in thousands, pairs in millions) keep the least-squares problem well conditioned.
_SCALE = np.array([1.0, 1e-3, 1e-6])
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a step computes: tokens, and (query, key) pairs attended."""

    tokens: int = 0
    pairs: int = 0

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(self.tokens + other.tokens, self.pairs + other.pairs)


def chunk_work(position: int, tokens: int) -> StepWork:
    """``tokens`` consecutive tokens after ``position`` held ones, each attending to all before it and itself."""
    return StepWork(tokens, tokens * position + tokens * (tokens + 1) // 2)


class StepTimeModel:
    """Seconds of a step from its work, fitted to observed steps (non-negative coefficients)."""

    def __init__(self) -> None:
        self.decode_steps: deque[tuple[StepWork, float]] = deque(maxlen=WINDOW)
        self.prompt_steps: deque[tuple[StepWork, float]] = deque(maxlen=WINDOW)
        self.coefficients: np.ndarray | None = None
        #: Steps observed since the latest fit.
        self.unfitted = 0

    def observe(self, work: StepWork, seconds: float, computed_prompt: bool) -> None:
        (self.prompt_steps if computed_prompt else self.decode_steps).append((work, seconds))
        self.unfitted += 1
        if computed_prompt or len(self.decode_steps) < WINDOW or self.unfitted >= REFIT_EVERY:
            self.coefficients = self._fit()
            self.unfitted = 0

    def _fit(self) -> np.ndarray | None:
        steps = [*self.decode_steps, *self.prompt_steps]
        if not steps:
            return None
        features = np.array([[1.0, work.tokens, work.pairs] for work, _ in steps]) * _SCALE
        seconds = np.array([s for _, s in steps])
        active = [0, 1, 2]
        while True:  # least squares, dropping a feature whose coefficient comes out negative (a cheap NNLS)
            solution = np.linalg.lstsq(features[:, active], seconds, rcond=None)[0]
            if (solution >= 0).all() or len(active) == 1:
                coefficients = np.zeros(3)
                coefficients[active] = np.maximum(solution, 0.0)
                return coefficients * _SCALE
            active.pop(int(np.argmin(solution)))

    def predict(self, work: StepWork) -> float | None:
        """Seconds for ``work``; None before any step was seen."""
        if self.coefficients is None:
            return None
        fixed, per_token, per_pair = self.coefficients
        return float(fixed + per_token * work.tokens + per_pair * work.pairs)

    def most_tokens(self, work: StepWork, position: int, seconds: float) -> int:
        """The most prompt tokens after ``position`` that ``work`` can take on and still be predicted within
        ``seconds`` (0 when it already is not)."""
        spare = seconds - self.predict(work)
        _, per_token, per_pair = self.coefficients
        if spare <= 0:
            return 0
        # per_pair / 2 * n^2 + (per_token + per_pair * (position + 1/2)) * n <= spare
        linear = per_token + per_pair * (position + 0.5)
        if per_pair <= 0:
            return sys.maxsize if linear <= 0 else int(spare / linear)
        return int((-linear + math.sqrt(linear * linear + 2 * per_pair * spare)) / per_pair)


@dataclass
class StepBudget:
    """One step's budget: decodes first, then prompt chunks up to the token cap and, while sequences decode, the
    latency target."""

    token_cap: int
    #: Seconds the step should stay within (None: no target).
    target: float | None
    model: StepTimeModel
    #: A prompt's chunk per step at most (``long_prefill_token_threshold``); None: the token cap.
    chunk_cap: int | None = None
    work: StepWork = field(default_factory=StepWork)
    tokens: int = 0
    prompt_tokens: int = 0
    #: :meth:`room` of a fresh prompt once the step's decodes were in (the scheduler records it).
    opening_room: int = 0
    #: Whether sequences decode in this step (the target is then the inter-token latency they see).
    decoding: bool = False

    @property
    def spare_tokens(self) -> int:
        return self.token_cap - self.tokens

    def room(self, position: int, floor: int = 0) -> int:
        """Tokens after ``position`` held ones that the step can still take: within the token cap, a prompt's chunk
        cap and, when timed, the target, but at least ``floor`` of them (the scheduler gives a long prompt, and the
        first waiting one, :data:`MIN_PREFILL_CHUNK` each step, so both always progress)."""
        room = self.spare_tokens if self.chunk_cap is None else min(self.spare_tokens, self.chunk_cap)
        timed = self.timed_room(position)
        if timed is not None:
            room = min(room, max(timed, floor))
        return max(room, 0)

    def timed_room(self, position: int) -> int | None:
        """Tokens after ``position`` the target leaves room for (None: no limit in time)."""
        if self.target is None or self.model.coefficients is None:
            return None
        return self.model.most_tokens(self.work, position, self.target)

    def take(self, position: int, tokens: int, prompt: bool = True) -> None:
        """Count ``tokens`` after ``position`` into the step (a prompt's chunk, or a decode and its drafts)."""
        if tokens > 0:
            self.work = self.work + chunk_work(position, tokens)
            self.tokens += tokens
            self.prompt_tokens += tokens if prompt else 0

    def grant_prompt(self, position: int, wanted: int, floor: int = 0) -> int:
        """A prompt chunk: as many of ``wanted`` tokens after ``position`` as :meth:`room` allows, counted."""
        granted = min(wanted, self.room(position, floor))
        self.take(position, granted)
        return granted


class StepClock:
    """The engine's step-time models (per torch thread count), its latency target, and how well they held."""

    def __init__(self, itl_target_ms: float | str | None = None) -> None:
        """``itl_target_ms`` as the engine's setting: milliseconds, ``"auto"`` or None (no target)."""
        self.models: dict[int, StepTimeModel] = {}
        #: ``auto``: the target is set from the start-up decode step (:meth:`set_auto_target`).
        self.auto = itl_target_ms == "auto"
        self.target = None if itl_target_ms is None or self.auto else itl_target_ms / 1000
        #: Predicted over measured seconds of every step the model predicted (1: exact).
        self.prediction_ratio = Histogram(RATIO_BUCKETS)
        #: Steps that decoded and ran past the target.
        self.missed = 0
        #: Prompt tokens the latest step's budget allowed a fresh prompt (the token cap when not timed).
        self.prompt_budget = 0
        #: The target of the latest step that decoded (``auto``: it follows the decoding batch).
        self.last_target = self.target

    @property
    def model(self) -> StepTimeModel:
        return self.models.setdefault(torch.get_num_threads(), StepTimeModel())

    def budget(self, token_cap: int, chunk_cap: int | None, decodes: list[int]) -> StepBudget:
        """The next step's budget, with the tokens of its decoding sequences counted first (``decodes``: the tokens
        each holds; those beyond the token cap wait), and the step's target: the latency target while they decode,
        :data:`IDLE_TARGET_STEPS` times it when none does."""
        budget = StepBudget(token_cap, None, self.model, chunk_cap)
        for held in decodes[:token_cap]:
            budget.take(held, 1, prompt=False)
        budget.decoding = bool(decodes)
        budget.target = self.step_target(budget.work, budget.decoding)
        if budget.decoding:
            self.last_target = budget.target
        return budget

    def step_target(self, decode_work: StepWork, decoding: bool) -> float | None:
        """Seconds a step with ``decode_work`` counted should stay within (None: no target)."""
        if self.target is None:
            return None
        target = self.target
        predicted = self.model.predict(decode_work) if self.auto and decoding else None
        if predicted is not None:
            target = max(target, AUTO_TARGET_STEPS * predicted)
        return target if decoding else IDLE_TARGET_STEPS * target

    def observe(self, budget: StepBudget, seconds: float) -> None:
        """Fit the step just run; count a step that decoded and overran the target."""
        self.prompt_budget = budget.opening_room
        predicted = self.model.predict(budget.work)
        if predicted is not None and seconds > 0:
            self.prediction_ratio.observe(predicted / seconds)
        if budget.decoding and budget.target is not None and seconds > budget.target:
            self.missed += 1
        self.model.observe(budget.work, seconds, budget.prompt_tokens > 0)

    def forget_counts(self) -> None:
        """Start the missed steps and the prediction ratios afresh (the engine's warm-up steps are not the load's)."""
        self.prediction_ratio = Histogram(RATIO_BUCKETS)
        self.missed = 0

    def set_auto_target(self, decode_seconds: float) -> float:
        """``auto``: the smallest target, from one sequence's decode step measured at start-up."""
        self.target = self.last_target = AUTO_TARGET_STEPS * decode_seconds
        return self.target
