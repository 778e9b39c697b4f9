"""A GGUF file's expected size from its header, so a bad file fails with one clear line.

Converting a GGUF takes half a minute and, on a random, empty or truncated file, ends in a
reshape error deep inside the GGUF reader. The header alone (metadata, then one entry per
tensor: shape, type, offset) says how long the file must be: the tensor data starts at the
first aligned offset after the header and ends with the last tensor. Reading it takes a
fraction of a second (the tokenizer's strings are skipped, not decoded).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from kvopt.errors import ModelFileError

MAGIC = b"GGUF"
#: Bytes of each fixed-size metadata value type (GGUF spec: uint8 ... float64; 8 = string, 9 = array).
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    """The header itself ends early."""


def check_gguf(path: Path) -> None:
    """Raise :class:`ModelFileError` unless ``path`` is a GGUF file as long as its header says."""
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(f"{path} is empty, not a GGUF file; pass a complete .gguf model file")
    with path.open("rb") as handle:
        if handle.read(4) != MAGIC:
            raise ModelFileError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model file")
        try:
            expected = _expected_size(handle)
        except _Truncated:
            raise ModelFileError(
                f"{path} is truncated: {size} bytes end inside its header; download or copy it again"
            ) from None
    if size < expected:
        raise ModelFileError(f"{path} is truncated: {size} of {expected} bytes; download or copy it again")


def _expected_size(handle: BinaryIO) -> int:
    """Bytes the file must have: the aligned end of the header plus the extent of the tensor data."""
    version, tensor_count, kv_count = struct.unpack("<IQQ", _read(handle, 20))
    if version < 2:
        raise ModelFileError(f"GGUF version {version} is too old (version 2 or later is supported); convert it again")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = _string(handle)
        (kind,) = struct.unpack("<I", _read(handle, 4))
        if key == b"general.alignment" and kind == UINT32:
            (alignment,) = struct.unpack("<I", _read(handle, 4))
        else:
            _skip_value(handle, kind)
    end = 0
    for _ in range(tensor_count):
        _skip_string(handle)
        (dims,) = struct.unpack("<I", _read(handle, 4))
        shape = struct.unpack(f"<{dims}Q", _read(handle, 8 * dims))
        kind, offset = struct.unpack("<IQ", _read(handle, 12))
        end = max(end, offset + _tensor_bytes(shape, kind))
    header = handle.tell()
    return -(-header // alignment) * alignment + end


def _tensor_bytes(shape: tuple[int, ...], kind: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ModelFileError(f"unknown GGUF tensor type {kind}; this file needs a newer gguf package") from None
    elements = 1
    for length in shape:
        elements *= length
    return elements // block * block_bytes


def _read(handle: BinaryIO, count: int) -> bytes:
    data = handle.read(count)
    if len(data) < count:
        raise _Truncated
    return data


def _string(handle: BinaryIO) -> bytes:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    return _read(handle, length)


def _skip_string(handle: BinaryIO) -> None:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    _skip(handle, length)


def _skip(handle: BinaryIO, count: int) -> None:
    """Seek past ``count`` bytes (a seek past the end is only noticed by the next read)."""
    handle.seek(count, 1)


def _skip_value(handle: BinaryIO, kind: int) -> None:
    if kind == STRING:
        _skip_string(handle)
    elif kind == ARRAY:
        item_kind, count = struct.unpack("<IQ", _read(handle, 12))
        if item_kind in SCALAR_BYTES:
            _skip(handle, count * SCALAR_BYTES[item_kind])
        else:
            for _ in range(count):
                _skip_value(handle, item_kind)
    elif kind in SCALAR_BYTES:
        _skip(handle, SCALAR_BYTES[kind])
    else:
        raise ModelFileError(f"unknown GGUF metadata type {kind}; the file is corrupt or needs a newer kvopt")
