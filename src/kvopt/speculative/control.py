"""How many tokens to draft: follow acceptance, and stop speculating while it does not pay.

Draft length follows HF's assisted-generation heuristic (one more after a fully accepted draft,
one fewer otherwise). Speculation pays while rounds (draft + verification) emit tokens faster
than plain one-token steps; both rates are measured (moving averages), so the rule holds on any
hardware and for any proposer's cost. When rounds are slower, drafting pauses, then probes again
with one round: the pause is long enough that the time a failed probe loses stays within
``PROBE_OVERHEAD`` of the plain steps around it, so text with little to copy (open-ended chat)
decodes at nearly the plain speed, and a costly proposer (a deep self-speculative draft) probes
rarely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Weight of the newest measurement in the moving averages.
SMOOTHING = 0.3
#: Most time failed probes may cost, as a fraction of plain decoding's.
PROBE_OVERHEAD = 0.05
MAX_PAUSE = 256


@dataclass
class DraftControl:
    k: int
    adaptive: bool = True
    length: int = field(init=False)
    step_seconds: float | None = field(default=None, init=False)
    round_rate: float | None = field(default=None, init=False)
    pause: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.length = self.k

    def next_length(self, room: int) -> int:
        """Drafts for the next round (0: a plain step), at most ``room``."""
        if not self.adaptive:
            return min(self.k, room)
        if self.step_seconds is None or self.pause:  # time a plain step first; or paused
            self.pause = max(0, self.pause - 1)
            return 0
        return min(self.length, room)

    def after_step(self, seconds: float) -> None:
        self.step_seconds = _average(self.step_seconds, seconds)

    def after_round(self, proposed: int, accepted: int, seconds: float) -> None:
        if not self.adaptive:
            return
        self.length = followed_length(self.length, self.k, proposed, accepted)
        self.round_rate = _average(self.round_rate, (accepted + 1) / seconds)
        if self.round_rate * self.step_seconds < 1:  # fewer tokens per second than plain steps
            lost_steps = seconds / self.step_seconds - (accepted + 1)
            self.pause = min(MAX_PAUSE, max(1, math.ceil(lost_steps / PROBE_OVERHEAD)))
            self.round_rate = None  # the next probe is judged on its own


def followed_length(length: int, k: int, proposed: int, accepted: int) -> int:
    """HF's rule: one draft more after a draft accepted whole, one fewer otherwise (between 1 and ``k``)."""
    return min(k, length + 1) if accepted == proposed else max(1, length - 1)


@dataclass(slots=True)
class DraftPace:
    """How much one sequence of a batch drafts next (the serving engine's rule, where a step's time is shared by
    the batch and cannot be put on one sequence's drafts): the length follows acceptance (:func:`followed_length`),
    and a draft the model rejects whole pauses drafting for 1, 2, 4, ... steps (up to ``MAX_PAUSE``; any accepted
    token resets it), so text with nothing to copy soon decodes almost as plainly as without drafts."""

    length: int
    #: Steps to decode without drafts before the next try, and the pause the next wholly rejected draft gets.
    pause: int = 0
    backoff: int = 1

    def next_length(self) -> int:
        """Tokens to draft this step (0: a plain step)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def after_verification(self, k: int, proposed: int, accepted: int) -> None:
        self.length = followed_length(self.length, k, proposed, accepted)
        if accepted:
            self.backoff = 1
        else:
            self.pause, self.backoff = self.backoff, min(MAX_PAUSE, 2 * self.backoff)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
