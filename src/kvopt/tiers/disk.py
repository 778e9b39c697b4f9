"""Local disk: one file per block under a folder, an LRU index rebuilt from the folder at start-up.

Entries are written to a temporary file and renamed into place, so a reader (or a restart after a
crash) sees whole files or none; a file damaged anyway (truncated by a full disk, a flipped byte)
fails the codec's checksums when read and is deleted (:meth:`drop`). The size limit is enforced
after every write by deleting the least recently used files; recency survives restarts through
the files' modification times (a hit touches its file).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

from kvopt.errors import KVOptError
from kvopt.tiers.base import TierStats, Warner

SUFFIX = ".kvb"


class DiskTier:
    def __init__(self, path: str | os.PathLike, max_bytes: int, name: str = "disk") -> None:
        self.name, self.max_bytes = name, max_bytes
        self.path = Path(path)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._warner = Warner()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a parent that is a file, no permission
            raise KVOptError(f"disk tier {self.path}: cannot use it as a folder ({error.strerror}); give a folder path "
                             "this process may create and write, e.g. disk:/tmp/kvopt-tier:1GB") from None  # fmt: skip
        self._rebuild_index()

    def _file(self, key: str) -> Path:
        return self.path / key[-2:] / f"{key}{SUFFIX}"  # keys end in hash digits: even fan-out

    def _own_files(self) -> list[Path]:
        """The tier's files (entries and temporary files) under its folder: ``xy/<key ending in xy>...``. Anything
        else the folder holds (it may be shared with other data) is not the tier's, never indexed nor deleted."""
        return [
            file for file in self.path.glob("*/*")
            if len(file.parent.name) == 2 and file.name.split(".")[0].endswith(file.parent.name) and file.is_file()
        ]  # fmt: skip

    def _rebuild_index(self) -> None:
        """Index what an earlier process left, oldest first; leftovers of interrupted writes are deleted."""
        found = []
        for file in self._own_files():
            if file.name.endswith(".tmp") and SUFFIX in file.suffixes:
                file.unlink(missing_ok=True)  # a temporary file of a write that never finished
            elif file.suffix == SUFFIX:
                info = file.stat()
                found.append((info.st_mtime, file.stem, info.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes_stored += size
        self._evict()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if key not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
        try:
            file = self._file(key)
            data = file.read_bytes()
            os.utime(file)  # recency, for the LRU order after a restart
        except OSError as error:
            self._forget(key)
            self.stats.errors += 1
            self._warner.warn(f"kvopt disk tier {self.path}: reading a block failed ({error}); computing it instead")
            return None
        self.stats.hits += 1
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        # A key already indexed is written again: the engine writes a block only when it did not get it from the
        # tiers, so the file is damaged or was never read (a restore stops at a chain's first damaged entry).
        file = self._file(key)
        temporary = file.with_name(f"{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            file.parent.mkdir(exist_ok=True)
            temporary.write_bytes(data)
            os.replace(temporary, file)
        except OSError as error:  # a full disk, a read-only folder: the block stays uncached
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            self.stats.errors += 1
            self._warner.warn(f"kvopt disk tier {self.path}: writing a block failed ({error}); it is not cached")
            return
        with self._lock:
            self.stats.bytes_stored += len(data) - self._index.pop(key, 0)
            self._index[key] = len(data)
            self.stats.stores += 1
            self._evict()

    def contains(self, key: str) -> bool:
        return key in self._index

    def _evict(self) -> None:
        while self._index and self.stats.bytes_stored > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._file(key).unlink(missing_ok=True)
            self.stats.bytes_stored -= size
            self.stats.evictions += 1

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes_stored -= size

    def drop(self, key: str) -> None:
        self._forget(key)
        self._file(key).unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing to release: the files are the tier, for the next process."""

    def disk_bytes(self) -> int:
        """Bytes of the tier's files as the file system reports them (tests check the limit on this)."""
        return sum(file.stat().st_size for file in self._own_files())
