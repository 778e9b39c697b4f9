"""Saving a whole cache to a file and loading it back onto the same model: sessions that outlive the process.

    kvopt.save_cache(cache, "chat.kvc")                  # or encoding="int8" / "int4" / "cachegen"
    cache = kvopt.load_cache("chat.kvc", model)          # continue decoding where it stopped

The header names the format version, the model's fingerprint (:mod:`kvopt.codec.fingerprint`),
the cache's method spec, the dtype and the layout; loading rebuilds the cache from its spec
(methods re-derive what they know of the model) and installs the saved layers. Any
mismatch or damage raises a :class:`~kvopt.codec.errors.CacheFileError` naming it: a wrong
cache is never returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvopt._version import __version__
from kvopt.api import build_cache
from kvopt.codec import container, encodings
from kvopt.codec.errors import CacheCorruptError, CacheFileError, CacheModelMismatchError
from kvopt.codec.fingerprint import check_fingerprint, model_fingerprint
from kvopt.codec.state import Dumper, Loader
from kvopt.errors import CacheUsageError, KVOptError
from kvopt.paths import writable_file

KIND = "kvopt-cache"


def encode_tensors(tensors: list[tuple[torch.Tensor, str | None, float]], encoding: str) -> tuple[list[dict], list[bytes]]:
    """Descriptors (each naming its chunks) and the chunks of ``(tensor, role, depth)`` items."""
    if encoding not in encodings.ENCODINGS:
        raise KVOptError(f"unknown cache encoding {encoding!r}; use one of {', '.join(encodings.ENCODINGS)}")
    descriptors, chunks = [], []
    for tensor, role, depth in tensors:
        descriptor, pieces = encodings.encode(tensor, encoding, role, depth)
        descriptor["chunks"] = list(range(len(chunks), len(chunks) + len(pieces)))
        descriptors.append(descriptor)
        chunks.extend(pieces)
    return descriptors, chunks


def decode_tensors(descriptors: list[dict], chunks: list, device) -> list[torch.Tensor]:
    return [encodings.decode(d, [chunks[i] for i in d["chunks"]], device) for d in descriptors]


def cache_bytes(cache, model, encoding: str = "raw", meta: dict | None = None) -> bytes:
    """The file :func:`save_cache` writes, as bytes (``meta``: JSON-able data stored alongside)."""
    modules = {id(module): name for name, module in model.named_modules()}
    dumper = Dumper(modules, len(cache.layers))
    layers = [dumper.layer(layer, index) for index, layer in enumerate(cache.layers)]
    descriptors, chunks = encode_tensors(dumper.tensors.items, encoding)
    info = cache.info
    header = {
        "kind": KIND, "kvopt": __version__, "model": model_fingerprint(model), "spec": cache.spec,
        "encoding": encoding, "dtype": str(model.dtype).removeprefix("torch."),
        "layout": {"layers": info.num_layers, "kv_heads": info.num_kv_heads, "head_dim": info.head_dim},
        "tensors": descriptors, "layers": layers, "meta": meta or {},
    }  # fmt: skip
    return container.pack(header, chunks)


def save_cache(cache, path: str | os.PathLike, encoding: str = "raw", model=None, meta: dict | None = None) -> Path:
    """Write ``cache`` to ``path`` atomically (the previous file survives any failure); returns the path.

    ``model`` defaults to the one the cache was built for (:meth:`KVCache.for_model`).
    """
    model = model if model is not None else cache.model
    if model is None:
        raise CacheUsageError("this cache does not know its model (it was not built by kvopt.cache); pass model=")
    path = writable_file(Path(path).expanduser(), "cache file")
    container.write_atomic(path, cache_bytes(cache, model, encoding, meta))
    return path


def read_cache(path: str | os.PathLike, model):
    """``(cache, meta)`` from a file :func:`save_cache` wrote, on ``model`` (see :func:`load_cache`)."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CacheFileError(f"cannot read the cache file {path}: {error.strerror}") from None
    return cache_from_bytes(data, model, str(path))


def cache_from_bytes(data: bytes, model, source: str = "the cache"):
    """``(cache, meta)`` from :func:`cache_bytes`'s output."""
    return cache_from_container(*container.unpack(data, source), model, source)


def cache_from_container(header: dict, chunks: list, model, source: str):
    """``(cache, meta)`` from an unpacked container (:func:`kvopt.codec.container.unpack`) of a saved cache."""
    if header.get("kind") != KIND:
        raise CacheCorruptError(f"{source} holds {header.get('kind')!r}, not a saved cache")
    check_fingerprint(header["model"], model, source)
    cache = build_cache(header["spec"], model)
    if len(cache.layers) != len(header["layers"]):
        raise CacheModelMismatchError(f"{source} holds {len(header['layers'])} layers, the model has {len(cache.layers)}")
    try:
        tensors = decode_tensors(header["tensors"], chunks, next(model.parameters()).device)
        loader = Loader(tensors, model, source)
        for layer, node in zip(cache.layers, header["layers"]):
            loader.layer(layer, node)
    except (KeyError, IndexError, TypeError, RuntimeError, AttributeError) as error:
        raise CacheCorruptError(f"{source}: its saved layers cannot be rebuilt ({error}); the file is damaged") from None
    return cache, header["meta"]


def load_cache(path: str | os.PathLike, model):
    """The cache saved at ``path``, ready to continue decoding on ``model`` (the model that computed it)."""
    return read_cache(path, model)[0]
