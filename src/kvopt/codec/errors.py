"""Why a saved cache cannot be loaded or written: each a :class:`~kvopt.errors.KVOptError` naming the mismatch.

A loader that guessed would hand the model a wrong cache, whose answers look plausible and
are silently wrong; every check that fails raises one of these instead.
"""

from __future__ import annotations

from kvopt.errors import KVOptError


class CacheFileError(KVOptError):
    """A saved cache file cannot be used."""


class CacheCorruptError(CacheFileError):
    """The file is not a kvopt cache, or it is truncated or altered (a checksum does not match)."""


class CacheVersionError(CacheFileError):
    """The file was written in a format version this kvopt does not read."""


class CacheModelMismatchError(CacheFileError):
    """The file was saved from another model (configuration or weights differ)."""


class CacheWriteError(CacheFileError):
    """Writing a cache file failed (disk full, no permission); the previous file at that path is untouched."""
