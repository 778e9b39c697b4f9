"""A conversation's KV saved from the engine's pool and put back after a restart (``llm.save_session``).

Saving takes the pool's cached blocks of a finished request's tokens (prompt + output; the full
blocks the prefix cache holds) and writes them, one :mod:`kvopt.codec` block per chunk, into a
container whose header names the model fingerprint, the KV method, the block size and the tokens;
the write is atomic. Loading checks all of them (a file from another model, method, block size,
format version, or a damaged file fails with an error naming it) and restores the blocks into the
pool's prefix cache, where the conversation's next prompt (the returned tokens + a new message)
finds them: only the new turn is computed.

Compressed sequences take no part in prefix caching, so their conversations are not saved here
(the single-cache path, ``kvopt.save_cache`` / ``kvopt.load_cache``, saves any method's state).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvopt.codec import container
from kvopt.codec.blocks import decode_block, encode_block
from kvopt.codec.errors import CacheCorruptError, CacheFileError
from kvopt.codec.fingerprint import check_fingerprint
from kvopt.errors import KVOptError

KIND = "kvopt-engine-session"


class SessionError(KVOptError):
    """A session cannot be saved as asked (its blocks are gone, or its method keeps no prefix blocks)."""


def save_session(engine, token_ids: list[int], path: str | os.PathLike, encoding: str = "raw") -> Path:
    """Write the pool's blocks of ``token_ids`` (a finished request's prompt + output) to ``path``; returns it."""
    manager, pool = engine.block_manager, engine.runner.pool
    if not manager.enable_prefix_caching:
        raise SessionError("sessions are saved from the prefix cache; create the engine with enable_prefix_caching=True")
    size, chunks = manager.block_size, []
    for index, digest in enumerate(manager.hashes_of(token_ids, (len(token_ids) - 1) // size)):
        tokens = tuple(token_ids[index * size : (index + 1) * size])
        block_id = manager.hash_to_block_id.get(digest)
        if block_id is None or manager.blocks[block_id].token_ids != tokens:
            break
        saved = pool.read_blocks([block_id])
        half = len(saved) // 2
        chunks.append(encode_block(list(zip(saved[:half], saved[half:])), engine.fingerprint, encoding,
                                   {"tokens": list(tokens)}))  # fmt: skip
    if not chunks:
        raise SessionError(
            "none of these tokens' blocks are in the pool's prefix cache: other requests reused them (save the "
            "session right after its request finishes), or the request ran a compressed kv_method, which keeps "
            "no prefix blocks (save such a conversation with kvopt.cache(...) and kvopt.save_cache)"
        )
    header = {"kind": KIND, "model": engine.fingerprint, "kv_method": engine.config.kv_method, "block_size": size,
              "tokens": token_ids[: len(chunks) * size], "all_tokens": token_ids}  # fmt: skip
    path = Path(path)
    container.write_atomic(path, container.pack(header, chunks))
    return path


def load_session(engine, path: str | os.PathLike) -> list[int]:
    """Put a saved session's blocks into the pool's prefix cache; returns its tokens (continue from them)."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CacheFileError(f"cannot read session {source}: {error.strerror}") from None
    header, chunks = container.unpack(data, source)
    if header.get("kind") != KIND:
        raise CacheCorruptError(f"{source} holds {header.get('kind')!r}, not an engine session (llm.save_session)")
    check_fingerprint(header["model"], engine.model, source)
    manager, pool = engine.block_manager, engine.runner.pool
    for name, mine in (("kv_method", engine.config.kv_method), ("block_size", manager.block_size)):
        if header[name] != mine:
            raise CacheFileError(f"{source} was saved with {name}={header[name]!r}, this engine has {name}={mine!r}; "
                                 f"load it into an engine with {name}={header[name]!r}")  # fmt: skip
    tokens, size = header["tokens"], manager.block_size
    if len(chunks) > manager.num_free_blocks:
        raise SessionError(f"the session holds {len(chunks)} blocks but only {manager.num_free_blocks} are free; "
                           "load it when fewer requests run, or give the engine more kv_memory")  # fmt: skip
    for index, (digest, chunk) in enumerate(zip(manager.hashes_of(tokens, len(chunks)), chunks)):
        layers, meta = decode_block(bytes(chunk), engine.fingerprint, source=f"{source}, block {index}")
        block_tokens = tuple(tokens[index * size : (index + 1) * size])
        if tuple(meta.get("tokens", ())) != block_tokens:
            raise CacheCorruptError(f"{source}: block {index} holds other tokens than its header says; the file was altered")
        block_id = manager.restore_block(digest, block_tokens)
        pool.write_blocks([*(k for k, _ in layers), *(v for _, v in layers)], [block_id])
    return list(header["all_tokens"])
