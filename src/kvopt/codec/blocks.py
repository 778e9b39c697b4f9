"""One block's worth of KV as bytes: what a storage tier (CPU, disk, Redis) keeps per engine block.

A block is per-layer keys and values ``[..., tokens, head_dim]`` plus JSON metadata (the block's
token ids, its chained hash, the method spec); the bytes are a :mod:`~kvopt.codec.container`
(version, checksums) whose header also carries the model fingerprint, so a block from another
model or a damaged entry is refused exactly as a session file is.
"""

from __future__ import annotations

import torch

from kvopt.codec import container
from kvopt.codec.errors import CacheCorruptError, CacheModelMismatchError
from kvopt.codec.session import decode_tensors, encode_tensors

KIND = "kvopt-block"


def encode_block(
    layers: list[tuple[torch.Tensor, torch.Tensor]], fingerprint: dict, encoding: str = "raw", meta: dict | None = None
) -> bytes:
    """Bytes of one block: ``layers[i] = (keys, values)`` of layer ``i``; ``fingerprint`` from
    :func:`~kvopt.codec.fingerprint.model_fingerprint` (computed once per engine, not per block)."""
    items = [(tensor, role, index / len(layers)) for index, pair in enumerate(layers) for tensor, role in zip(pair, ("key", "value"))]
    descriptors, chunks = encode_tensors(items, encoding)
    header = {"kind": KIND, "model": fingerprint, "encoding": encoding, "tensors": descriptors, "meta": meta or {}}
    return container.pack(header, chunks)


def decode_block(
    data: bytes, fingerprint: dict, device: torch.device | str = "cpu", source: str = "the block"
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """``(layers, meta)`` of :func:`encode_block`'s bytes, refused unless saved under ``fingerprint``."""
    header, chunks = container.unpack(data, source)
    if header.get("kind") != KIND:
        raise CacheCorruptError(f"{source} holds {header.get('kind')!r}, not a KV block")
    if header["model"] != fingerprint:
        raise CacheModelMismatchError(f"{source} was computed by another model (its fingerprint differs)")
    tensors = decode_tensors(header["tensors"], chunks, device)
    return list(zip(tensors[0::2], tensors[1::2])), header["meta"]
