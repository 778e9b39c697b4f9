"""Redis: one store shared by several engine replicas, so a prefix one computed serves them all.

Keys are stable across processes and machines (model fingerprint + method + codec + chained
block hash, see :mod:`kvopt.engine.offload`), so replicas pointed at one Redis reuse each other's
blocks. Redis down or slow never fails a request: an operation that errors or times out counts an
error, logs a warning (at most every 30 s), and the tier stays quiet for ``retry_after`` seconds,
during which it misses at once instead of waiting on a dead socket; the engine computes instead.
The size limit is the server's: with ``max_bytes`` the tier sets ``maxmemory`` and the
``allkeys-lru`` policy on the server when it connects (a managed Redis that forbids ``CONFIG``
keeps its own limit; a warning says so).
"""

from __future__ import annotations

import threading
import time

from kvopt.tiers.base import TierStats, Warner

PREFIX = "kvopt:block:"


class RedisTier:
    def __init__(self, url: str, max_bytes: int | None = None, timeout: float = 0.5, retry_after: float = 5.0,
                 name: str = "redis") -> None:  # fmt: skip
        import redis

        self.name, self.url, self.max_bytes = name, url, max_bytes
        self.stats = TierStats()
        self.retry_after = retry_after
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._warner = Warner()
        self._down_until = 0.0
        self._configured = False
        self._lock = threading.Lock()
        self._memory_read = 0.0

    def _call(self, what: str, operation):
        """Run ``operation`` on the client unless the server failed recently; None when it fails."""
        if time.monotonic() < self._down_until:
            return None
        try:
            if not self._configured:
                self._configure()
            return operation(self._client)
        except self._errors as error:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.retry_after
            self._warner.warn(f"kvopt redis tier {self.url}: {what} failed ({error}); computing instead, "
                              f"retrying in {self.retry_after:g} s")  # fmt: skip
            return None

    def _configure(self) -> None:
        self._configured = True
        if self.max_bytes is None:
            return
        try:
            self._client.config_set("maxmemory", self.max_bytes)
            self._client.config_set("maxmemory-policy", "allkeys-lru")
        except self._errors as error:
            if "CONFIG" not in str(error).upper():
                self._configured = False
                raise
            self._warner.warn(f"kvopt redis tier {self.url}: cannot set maxmemory ({error}); the server's limit applies")

    def get(self, key: str) -> bytes | None:
        data = self._call("reading a block", lambda client: client.get(PREFIX + key))
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return data

    def put(self, key: str, data: bytes) -> None:
        if self._call("writing a block", lambda client: client.set(PREFIX + key, data)):
            self.stats.stores += 1

    def contains(self, key: str) -> bool:
        return bool(self._call("looking a block up", lambda client: client.exists(PREFIX + key)))

    def drop(self, key: str) -> None:
        self._call("dropping a damaged block", lambda client: client.delete(PREFIX + key))

    def refresh(self) -> None:
        """Read the server's memory and eviction counters into :attr:`stats` (at most once a second)."""
        with self._lock:
            if time.monotonic() - self._memory_read < 1.0:
                return
            self._memory_read = time.monotonic()
        memory = self._call("reading INFO", lambda client: client.info("memory"))
        counters = self._call("reading INFO", lambda client: client.info("stats"))
        if memory is not None:
            self.stats.bytes_stored = int(memory.get("used_memory", 0))
        if counters is not None:
            self.stats.evictions = int(counters.get("evicted_keys", 0))

    def close(self) -> None:
        self._client.close()
