"""The one interface of a KV tier, and the counters every tier keeps."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

log = logging.getLogger("kvopt.tiers")


@dataclass
class TierStats:
    """Counters of one tier (exported per tier in the engine's metrics)."""

    hits: int = 0
    misses: int = 0
    #: Entries written, and entries the tier removed to stay within its size limit.
    stores: int = 0
    evictions: int = 0
    #: Bytes the tier holds now (Redis: the server's ``used_memory``).
    bytes_stored: int = 0
    #: Entries found damaged or from another model, dropped (never served).
    corrupt: int = 0
    #: Failed operations (disk full, Redis down or slow): the engine computed instead.
    errors: int = 0
    #: Time spent reading hits, for a mean load latency.
    load_seconds: float = 0.0

    def snapshot(self) -> dict:
        return asdict(self)


@runtime_checkable
class KVTier(Protocol):
    """A store of KV blocks as bytes. Failures never raise: a tier that cannot answer misses."""

    name: str
    stats: TierStats

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None (absent, or the tier failed)."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, evicting older entries to stay within the tier's size limit."""
        ...

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held (not counted as a hit or a miss)."""
        ...

    def drop(self, key: str) -> None:
        """Forget ``key`` (its entry was found damaged)."""
        ...

    def close(self) -> None: ...


class Warner:
    """Logs a tier's failure at most once per ``every`` seconds (a down Redis fails every request)."""

    def __init__(self, every: float = 30.0) -> None:
        self.every, self.last = every, float("-inf")

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.warning(message)
