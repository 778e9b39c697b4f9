"""Engine metrics with Prometheus-style names (vLLM's where the meaning is the same).

Counters and gauges are plain numbers; latency histograms keep vLLM's bucket bounds plus a
bounded window of recent observations for exact percentiles. ``snapshot`` is what
``LLM.metrics()`` returns and what a server exports.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: Observations kept for percentiles (older ones still count in buckets, sum and count).
RECENT = 10_000


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1
        self.recent.append(value)

    def quantiles(self, *qs: float) -> list[float | None]:
        """The ``qs`` quantiles of the recent observations (nearest rank), None before any."""
        ordered = sorted(self.recent)
        return [ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else None for q in qs]

    def snapshot(self) -> dict:
        cumulative, running = {}, 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            cumulative[bound] = running
        p50, p99 = self.quantiles(0.5, 0.99)
        return {"count": self.count, "sum": self.total, "buckets": cumulative, "p50": p50, "p99": p99}


@dataclass
class SpeculationStats:
    """Speculative decoding's drafts (vLLM's ``spec_decode_*`` counters): acceptance rate is
    ``accepted_tokens / draft_tokens``; tokens per verified step ``1 + accepted_tokens / drafts``."""

    #: Steps of a sequence that verified drafts, the tokens drafted, and those the model accepted.
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted


@dataclass
class EngineStats:
    """What the engine counts as it runs (the scheduler and block manager report the rest)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    busy_seconds: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
