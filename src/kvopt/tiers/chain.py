"""Tiers in order, fastest first: lookups walk them and promote hits; writes go to all, in the background."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from kvopt.tiers.base import KVTier, Warner

#: Writes waiting for the background thread at most; beyond, new ones are dropped (counted), so a slow
#: tier never holds more host memory than this many blocks.
MAX_PENDING = 256


class TierChain:
    def __init__(self, tiers: list[KVTier]) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = tiers
        self.dropped_writes = 0
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(MAX_PENDING)
        self._warner = Warner()
        self._worker = threading.Thread(target=self._work, name="kvopt-tiers", daemon=True)
        self._worker.start()

    def get(self, key: str) -> tuple[bytes, KVTier] | None:
        """The entry under ``key`` from the first tier holding it (copied into the faster tiers above it)."""
        for index, tier in enumerate(self.tiers):
            start = time.perf_counter()
            data = tier.get(key)
            if data is None:
                continue
            tier.stats.load_seconds += time.perf_counter() - start
            for faster in self.tiers[:index]:
                faster.put(key, data)
            return data, tier
        return None

    def drop(self, key: str) -> None:
        """Forget a damaged entry everywhere (never served again)."""
        for tier in self.tiers:
            tier.drop(key)

    def put_later(self, key: str, encode: Callable[[], bytes]) -> None:
        """Encode and write an entry to every tier on the background thread (the caller holds a copy of the data)."""

        def job() -> None:
            data = encode()
            for tier in self.tiers:
                tier.put(key, data)

        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.dropped_writes += 1
            self._warner.warn(f"kvopt tiers: {MAX_PENDING} writes pending; dropping new ones until they drain")

    def prefetch(self, keys: list[str]) -> None:
        """Bring ``keys`` from the slower tiers into the first one ahead of use (stops at the first absent key)."""

        def job() -> None:
            for key in keys:
                if not self.tiers[0].contains(key) and self.get(key) is None:
                    return

        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            pass  # a prefetch is only a head start

    def flush(self) -> None:
        """Wait until every queued write and prefetch is done."""
        self._jobs.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception as error:  # a tier bug must not kill the thread that every later write needs
                self._warner.warn(f"kvopt tiers: a background write failed ({error!r})")
            finally:
                self._jobs.task_done()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._worker.join()
        for tier in self.tiers:
            tier.close()
