"""Prefix blocks beyond the RAM pool: written to the KV tiers when a request finishes, restored on a later hit.

A finished request's full blocks (prompt and output) are copied out of the pool and, on the tiers'
background thread, encoded by :mod:`kvopt.codec` (checksummed, with the model's fingerprint) and
written to every tier (:class:`~kvopt.tiers.TierChain`). A later prompt whose leading blocks miss
the pool's prefix cache looks them up in the tiers, first to last: a hit is decoded into a free
block, which then counts as a prefix-cache hit. Tier keys are the block manager's chained hashes,
whose root is salted with the model fingerprint (configuration + sampled weights), the dtype and
the KV method, plus the codec: stable across processes and machines (no per-process hash seed),
so an engine restarted on the same disk, or a replica on the same Redis, finds them.

A compressed sequence (``kv_method=...``) has no prefix blocks to share: its methods chose what to
keep with the whole prompt in view. Right after its prompt's one-pass prefill its whole state
(kept tokens, quantized groups, the methods' per-layer state; a sequence with its own cache, the
cache as a session file holds it) and the last position's logits go
to the tiers as one entry, keyed by the fingerprint, the method spec and every prompt token; the
same prompt again (a retried request, another replica, a restarted engine) installs it into free
blocks and samples its first token from the stored logits, skipping the prefill: the same tokens
as computing it, since the state is the one the prefill made, stored exactly.

A damaged entry, or one from another model, fails to decode: it is dropped from every tier and
its tokens are computed. A request arriving with a prompt starts a prefetch of its blocks (or its
state) from the slower tiers into the first one, overlapping their transfer with the steps before
admission.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qs, urlsplit

import numpy as np
import torch

from kvopt.engine.kv.base import StoredPrompt
from kvopt.engine.kv.paged import PagedKVPool
from kvopt.codec.blocks import decode_block, decode_state, encode_block, encode_state, snapshot_state
from kvopt.codec.encodings import ENCODINGS
from kvopt.codec.errors import CacheFileError
from kvopt.engine.block_manager import BlockManager
from kvopt.engine.config import EngineConfigError, parse_memory
from kvopt.engine.sequence import Sequence
from kvopt.errors import CacheUsageError
from kvopt.methods.spec import spec_text
from kvopt.tiers import DiskTier, KVTier, MemoryTier, RedisTier, TierChain

logger = logging.getLogger("kvopt.engine")
#: Keys of blocks this process wrote or restored, remembered so they are not written again (bounded).
REMEMBERED = 1 << 17
DEFAULT_DISK = "10GB"
#: What decoding a damaged, foreign or mismatched entry raises (it is then dropped, never served).
DAMAGED = (CacheFileError, KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError)
T = TypeVar("T")


def tier_spec(spec: str) -> tuple[str, str, int | None]:
    """``(kind, location, size limit in bytes)`` of a tier spec, validated without opening anything:
    ``cpu:SIZE``, ``disk:PATH[:SIZE]`` (default 10GB), ``redis://HOST:PORT[/DB][?max=SIZE]``."""
    cpu, name = torch.device("cpu"), f"kv_tiers {spec!r}"
    if spec.startswith(("redis://", "rediss://", "unix://")):
        parts = urlsplit(spec)
        limit = parse_qs(parts.query).get("max")
        return "redis", parts._replace(query="").geturl(), parse_memory(limit[0], cpu, f"{name} max") if limit else None
    kind, _, rest = spec.partition(":")
    if kind == "cpu" and rest:
        return "cpu", "", parse_memory(rest, cpu, name)
    if kind == "disk" and rest:
        path, colon, size = rest.rpartition(":")
        if not colon or "/" in size:  # no size: the whole rest is the path
            path, size = rest, DEFAULT_DISK
        return "disk", path, parse_memory(size, cpu, name)
    raise EngineConfigError(
        f"kv_tiers entry {spec!r} is not a tier; write 'cpu:4GB', 'disk:/var/cache/kvopt:20GB' or "
        "'redis://127.0.0.1:6379/0?max=1GB'"
    )


def open_tier(spec: str) -> KVTier:
    kind, location, limit = tier_spec(spec)
    if kind == "redis":
        return RedisTier(location, limit)
    return MemoryTier(limit) if kind == "cpu" else DiskTier(location, limit)


class KVOffload:
    def __init__(self, chain: TierChain, model, pool: PagedKVPool, manager: BlockManager, fingerprint: dict,
                 encoding: str = "raw") -> None:  # fmt: skip
        if encoding not in ENCODINGS:
            raise EngineConfigError(f"kv_tier_encoding={encoding!r}; use one of {ENCODINGS}")
        self.chain, self.model, self.pool, self.manager = chain, model, pool, manager
        self.fingerprint, self.encoding = fingerprint, encoding
        self._salt = json.dumps(fingerprint, sort_keys=True)
        self._modules = {id(module): name for name, module in model.named_modules()}
        self._known: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def from_specs(cls, specs, model, pool, manager, fingerprint, encoding) -> KVOffload:
        return cls(TierChain([open_tier(spec) for spec in specs]), model, pool, manager, fingerprint, encoding)

    def key(self, digest: bytes) -> str:
        return f"{self.encoding}-{digest.hex()}"

    def state_key(self, seq: Sequence) -> str:
        """Key of a compressed sequence's state after its prompt: fingerprint, method spec, every prompt token."""
        digest = hashlib.blake2b(f"{self._salt}|{_spec(seq)}".encode(), digest_size=16)
        digest.update(np.asarray(seq.token_ids[: seq.num_prompt_tokens], dtype=np.int64).tobytes())
        return f"state-{digest.hexdigest()}"

    # -- lookups ------------------------------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Start bringing ``seq``'s prompt blocks (or state) into the first tier (when slower tiers stand behind it)."""
        if len(self.chain.tiers) == 1:
            return
        if seq.kv.shares_blocks:
            self.chain.prefetch([self.key(digest) for digest in self.manager.prompt_hashes(seq)])
        elif seq.kv.keeps_prompt_state:
            self.chain.prefetch([self.state_key(seq)])

    def restore(self, seq: Sequence, hashes: list[bytes], start: int) -> list[int]:
        """Blocks for ``hashes[start:]`` found in the tiers, in order until the first miss, decoded into free
        blocks of the pool (registered in the prefix cache, not yet held by ``seq``)."""
        size, restored = self.manager.block_size, []
        for index in range(start, len(hashes)):
            if len(restored) >= self.manager.num_free_blocks:
                break  # one more would reuse a block restored just now
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            layers = self._fetch(self.key(hashes[index]), lambda data, source: _block(data, self.fingerprint, tokens, source))
            if layers is None:
                break
            block_id = self.manager.restore_block(hashes[index], tokens)
            self.pool.write_blocks([*(k for k, _ in layers), *(v for _, v in layers)], [block_id])
            restored.append(block_id)
        return restored

    def restore_state(self, seq: Sequence) -> StoredPrompt | None:
        """A compressed sequence's state after its prompt, from the tiers (checked against its spec, prompt and
        layout; not yet in the pool), or None."""
        if not seq.kv.keeps_prompt_state:
            return None

        def decode(data: bytes, source: str) -> StoredPrompt:
            state, meta = decode_state(data, self.fingerprint, self.model, source)
            if meta.get("spec") != _spec(seq) or meta.get("tokens") != seq.token_ids[: seq.num_prompt_tokens]:
                raise ValueError(f"{source} holds another prompt or method")
            seq.kv.check_state(state, self.pool)
            return state

        return self._fetch(self.state_key(seq), decode)

    def _fetch(self, key: str, decode: Callable[[bytes, str], T]) -> T | None:
        """The entry under ``key`` decoded by ``decode``, which raises on anything wrong: a damaged entry, one
        from another model or for other tokens is dropped from every tier (counted), never served."""
        found = self.chain.get(key)
        if found is None:
            return None
        data, tier = found
        try:
            value = decode(data, f"{tier.name} tier entry {key}")
        except DAMAGED:
            tier.stats.corrupt += 1
            self.chain.drop(key)  # never served again
            return None
        self._remember(key)
        return value

    # -- writes -------------------------------------------------------------------------------
    def save(self, seq: Sequence) -> None:
        """Queue ``seq``'s full, hashed blocks for the tiers (before its blocks return to the pool)."""
        blocks = [self.manager.blocks[block_id] for block_id in seq.block_table[: seq.num_computed_tokens // self.manager.block_size]]
        for block in blocks:
            if block.hash is None:
                continue
            key = self.key(block.hash)
            if key in self._known:
                continue
            self._remember(key)
            copied = self.pool.read_blocks([block.block_id])  # host copies: the block may be reused meanwhile
            half = len(copied) // 2
            layers = list(zip(copied[:half], copied[half:]))
            meta = {"tokens": list(block.token_ids)}
            self.chain.put_later(key, lambda layers=layers, meta=meta: encode_block(layers, self.fingerprint,
                                                                                   self.encoding, meta))  # fmt: skip

    def save_state(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Queue a compressed sequence's state right after its prompt's prefill, with the ``logits [vocab]`` its
        first token is sampled from."""
        if not seq.kv.keeps_prompt_state:
            return
        key = self.state_key(seq)
        if key in self._known:
            return
        self._remember(key)
        try:
            state = seq.kv.snapshot(self.pool, seq.block_table, seq.code_table, logits)
            snapshot = snapshot_state(state, self._modules)  # copies now: the sequence goes on changing its state
        except CacheUsageError as error:  # a method state the codec cannot store: the request goes on, unstored
            self.chain.tiers[0].stats.errors += 1
            logger.warning("the KV tiers cannot keep %s's prompt state (%s); it is computed each time", _spec(seq), error)
            return
        meta = {"spec": _spec(seq), "tokens": seq.token_ids[: seq.num_prompt_tokens]}
        self.chain.put_later(key, lambda: encode_state(snapshot, self.fingerprint, meta))

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > REMEMBERED:
            self._known.popitem(last=False)

    # -- metrics, shutdown --------------------------------------------------------------------
    def metrics(self) -> dict[str, dict]:
        """Per tier (by name): hits, misses, stores, evictions, bytes stored, corrupt, errors, mean load seconds."""
        found = {}
        for tier in self.chain.tiers:
            refresh = getattr(tier, "refresh", None)
            if refresh is not None:
                refresh()
            stats = tier.stats.snapshot()
            loads = stats.pop("load_seconds")
            stats["mean_load_seconds"] = loads / stats["hits"] if stats["hits"] else 0.0
            found[tier.name] = stats
        return found

    def close(self) -> None:
        """Finish the queued writes (so a restarted engine finds them) and release the tiers."""
        self.chain.close()


def _spec(seq: Sequence) -> str:
    """The canonical spec of a compressed sequence's methods (what its state depends on)."""
    return spec_text(seq.kv.methods)


def _block(data: bytes, fingerprint: dict, tokens: tuple[int, ...], source: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, meta = decode_block(data, fingerprint, source=source)
    if tuple(meta.get("tokens", ())) != tokens:
        raise ValueError(f"{source} holds other tokens")
    return layers
