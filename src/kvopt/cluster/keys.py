"""What the router matches a prompt by: the engine's own chained block hashes, or one whole-prompt key.

A lossless prompt is named block by block exactly as the replicas' block managers name it (blake2b of the parent
hash and the block's token ids, from a root salted with the model fingerprint and the engine's KV method), so a
replica's report of the hashes it holds answers "how many leading blocks of this prompt are here". A compressed
prompt (its methods chose what to keep with the whole prompt in view) is stored whole, so its only key covers the
canonical method spec and every prompt token: a prefix of it is worth nothing elsewhere.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from kvopt.engine.block_manager import BlockManager
from kvopt.methods import parse, spec_text
from kvopt.methods.full import Full


@lru_cache(maxsize=256)
def compressed_spec(kv_method: str) -> str | None:
    """The canonical spec of a compressing ``kv_method``; None for a lossless one (``full``, ``full+full``)."""
    methods = parse(kv_method)
    if all(type(method) is Full for method in methods):
        return None
    return spec_text(methods)


@lru_cache(maxsize=16)
def _hasher(root_hash: bytes, block_size: int) -> BlockManager:
    """A block manager with no blocks, used only for its hashing (the same code the replicas run)."""
    manager = BlockManager(0, block_size)
    manager.root_hash = root_hash
    return manager


def route_keys(token_ids: list[int], kv_method: str, root_hash: bytes, block_size: int) -> tuple[list[bytes], bool]:
    """The keys of a prompt as replicas store it, and whether they are one whole-prompt key: the chained hashes of
    the full blocks a prefix hit may cover (the last token is always computed), or a compressed prompt's one key."""
    spec = compressed_spec(kv_method)
    if spec is None:
        return _hasher(root_hash, block_size).hashes_of(token_ids, (len(token_ids) - 1) // block_size), False
    digest = hashlib.blake2b(root_hash + b"|" + spec.encode(), digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return [digest.digest()], True
