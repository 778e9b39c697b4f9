"""CPU memory: a byte-limited LRU of blocks evicted from the engine's pool."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvopt.tiers.base import TierStats


class MemoryTier:
    """Entries in an ``OrderedDict`` (least recently used first), at most ``max_bytes`` in total."""

    def __init__(self, max_bytes: int, name: str = "cpu") -> None:
        self.name, self.max_bytes = name, max_bytes
        self.stats = TierStats()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return  # larger than the whole tier: keeping it would evict everything else
        with self._lock:
            old = self._entries.pop(key, None)
            self.stats.bytes_stored -= len(old) if old is not None else 0
            while self._entries and self.stats.bytes_stored + len(data) > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.stats.bytes_stored -= len(evicted)
                self.stats.evictions += 1
            self._entries[key] = data
            self.stats.bytes_stored += len(data)
            self.stats.stores += 1

    def contains(self, key: str) -> bool:
        return key in self._entries

    def drop(self, key: str) -> None:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is not None:
                self.stats.bytes_stored -= len(data)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.bytes_stored = 0
