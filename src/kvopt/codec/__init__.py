"""Serialising kvopt caches: a versioned, checksummed file format, lossless and lossy encodings, sessions.

:func:`save_cache` / :func:`load_cache` save and resume a whole cache (every
storage kind: dense, per-head evicted, ragged, KIVI-packed, MiniCache-merged, method state);
:func:`encode_block` / :func:`decode_block` do the same for one block of per-layer K/V, for
storage tiers. Encodings: ``raw`` (lossless), ``int8``, ``int4``, ``cachegen`` (see
:mod:`kvopt.codec.encodings`). The codec sits above :mod:`kvopt.api`: it reads cache storage and
rebuilds a loaded cache from its spec through the api, and nothing below it imports it.
"""

from kvopt.codec.blocks import decode_block, encode_block
from kvopt.codec.container import FORMAT_VERSION
from kvopt.codec.encodings import ENCODINGS
from kvopt.codec.errors import CacheCorruptError, CacheFileError, CacheModelMismatchError, CacheVersionError, CacheWriteError
from kvopt.codec.fingerprint import model_fingerprint
from kvopt.codec.session import cache_bytes, cache_from_bytes, load_cache, read_cache, save_cache

__all__ = [
    "ENCODINGS", "FORMAT_VERSION", "CacheCorruptError", "CacheFileError", "CacheModelMismatchError", "CacheVersionError",
    "CacheWriteError", "cache_bytes", "cache_from_bytes", "decode_block", "encode_block", "load_cache", "model_fingerprint",
    "read_cache", "save_cache",
]  # fmt: skip
