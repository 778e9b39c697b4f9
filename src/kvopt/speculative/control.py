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
        self.length = min(self.k, self.length + 1) if accepted == proposed else max(1, self.length - 1)
        self.round_rate = _average(self.round_rate, (accepted + 1) / seconds)
        if self.round_rate * self.step_seconds < 1:  # fewer tokens per second than plain steps
            lost_steps = seconds / self.step_seconds - (accepted + 1)
            self.pause = min(MAX_PAUSE, max(1, math.ceil(lost_steps / PROBE_OVERHEAD)))
            self.round_rate = None  # the next probe is judged on its own


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
