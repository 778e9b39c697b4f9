"""The file layout: a versioned, checksummed header followed by checksummed chunks.

::

    MAGIC (8 bytes) | format version (u32 LE) | header length (u64 LE) | blake2b-128 of the header
    | header (JSON, UTF-8) | chunk 0 | chunk 1 | ...

The header lists every chunk's size and blake2b-128 digest, so a truncated file (its length
differs from the sum), a flipped byte in the header (its digest) or in a chunk (the chunk's
digest) is detected before anything is decoded. blake2b is in the standard library and hashes
~1 GB/s, a small cost next to encoding. Writes are atomic (:func:`write_atomic`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

from kvopt.codec.errors import CacheCorruptError, CacheVersionError, CacheWriteError

MAGIC = b"KVOPTKV\x00"
#: Bumped whenever the layout or the meaning of a header field changes; a reader accepts only its own.
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ16s")


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def pack(header: dict, chunks: list[bytes]) -> bytes:
    """The bytes of a container holding ``header`` (JSON-able; ``chunks`` is added) and ``chunks``."""
    header = {**header, "chunks": [{"size": len(chunk), "digest": digest(chunk)} for chunk in chunks]}
    text = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text), hashlib.blake2b(text, digest_size=16).digest())
    return b"".join([prefix, text, *chunks])


def unpack(data: bytes, source: str) -> tuple[dict, list[memoryview]]:
    """``(header, chunks)`` of a container, every checksum verified; ``source`` names it in errors."""
    if len(data) < _PREFIX.size or data[:8] != MAGIC:
        raise CacheCorruptError(f"{source} is not a kvopt cache file (no kvopt header); pass a file written by kvopt.save_cache")
    _, version, length, header_digest = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise CacheVersionError(
            f"{source} is in kvopt cache format version {version}, this kvopt reads version {FORMAT_VERSION}; "
            "load it with the kvopt that wrote it, or recompute the cache"
        )
    start = _PREFIX.size + length
    if start > len(data):
        raise CacheCorruptError(f"{source} is truncated inside its header ({len(data)} bytes); the file is damaged")
    text = data[_PREFIX.size : start]
    if hashlib.blake2b(text, digest_size=16).digest() != header_digest:
        raise CacheCorruptError(f"{source}: the header checksum does not match; the file is damaged or was altered")
    header = json.loads(text)
    sizes = [chunk["size"] for chunk in header["chunks"]]
    if start + sum(sizes) != len(data):
        raise CacheCorruptError(
            f"{source} holds {len(data)} bytes but its header describes {start + sum(sizes)}; "
            "the file is truncated or damaged"
        )
    view, chunks = memoryview(data), []
    for index, (size, chunk) in enumerate(zip(sizes, header["chunks"])):
        piece = view[start : start + size]
        if digest(piece) != chunk["digest"]:
            raise CacheCorruptError(f"{source}: chunk {index} fails its checksum; the file is damaged or was altered")
        chunks.append(piece)
        start += size
    return header, chunks


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part.

    A temporary file in the same folder is written and fsynced, renamed over ``path`` (atomic on
    POSIX), then the folder is fsynced so the rename itself survives a crash. A process killed
    midway leaves the old file (and at worst a stray ``.NAME.*.tmp``); a failed write removes its
    temporary file and raises :class:`CacheWriteError`.
    """
    folder = path.parent
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as error:
        raise CacheWriteError(f"cannot write {path}: {error.strerror}; pass a folder you can write to") from None
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise CacheWriteError(
            f"writing {path} failed ({error.strerror or error}); the previous file there is untouched. "
            "Free some disk space or choose another folder"
        ) from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
