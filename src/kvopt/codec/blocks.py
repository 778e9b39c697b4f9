"""What a storage tier (CPU, disk, Redis) keeps per entry: one engine block, or one sequence's compressed state.

A block is per-layer keys and values ``[..., tokens, head_dim]`` plus JSON metadata (the block's
token ids, its chained hash, the method spec); a state is any object the codec's state walker
saves (:mod:`kvopt.codec.state`: kvopt.cache dataclasses, tensors, containers, the model's
modules by name), stored losslessly. The bytes are a :mod:`~kvopt.codec.container` (version,
checksums) whose header also carries the model fingerprint, so an entry from another model or a
damaged entry is refused exactly as a session file is.
"""

from __future__ import annotations

import torch

from kvopt.codec import container
from kvopt.codec.errors import CacheCorruptError, CacheModelMismatchError
from kvopt.codec.session import decode_tensors, encode_tensors
from kvopt.codec.state import Dumper, Loader

KIND = "kvopt-block"
STATE_KIND = "kvopt-state"


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
    header, tensors = _unpack(data, KIND, fingerprint, device, source)
    return list(zip(tensors[0::2], tensors[1::2])), header["meta"]


#: A state taken apart: its JSON tree and copies of its tensors (see :func:`snapshot_state`).
Snapshot = tuple[dict, list[torch.Tensor]]


def snapshot_state(state, modules: dict[int, str]) -> Snapshot:
    """``state`` as a JSON tree and *copies* of its tensors, taken now: the live object may change while the
    bytes are encoded elsewhere. ``modules`` names the model's modules (``id(module) -> name``)."""
    dumper = Dumper(modules, 1)
    tree = dumper.value(state)
    return tree, [tensor.detach().clone() for tensor, _, _ in dumper.tensors.items]


def encode_state(snapshot: Snapshot, fingerprint: dict, meta: dict | None = None) -> bytes:
    """Bytes of a :func:`snapshot_state` (tensors stored exactly: a state's method already chose what to lose)."""
    tree, tensors = snapshot
    descriptors, chunks = encode_tensors([(tensor, None, 0.0) for tensor in tensors], "raw")
    header = {"kind": STATE_KIND, "model": fingerprint, "encoding": "raw", "tensors": descriptors, "state": tree,
              "meta": meta or {}}  # fmt: skip
    return container.pack(header, chunks)


def decode_state(data: bytes, fingerprint: dict, model, source: str = "the state") -> tuple[object, dict]:
    """``(state, meta)`` of :func:`encode_state`'s bytes on ``model``, refused unless saved under ``fingerprint``."""
    header, tensors = _unpack(data, STATE_KIND, fingerprint, next(model.parameters()).device, source)
    return Loader(tensors, model, source).value(header["state"]), header["meta"]


def _unpack(data: bytes, kind: str, fingerprint: dict, device, source: str) -> tuple[dict, list[torch.Tensor]]:
    header, chunks = container.unpack(data, source)
    if header.get("kind") != kind:
        raise CacheCorruptError(f"{source} holds {header.get('kind')!r}, not a {kind}")
    if header["model"] != fingerprint:
        raise CacheModelMismatchError(f"{source} was computed by another model (its fingerprint differs)")
    return header, decode_tensors(header["tensors"], chunks, device)
