"""Prefix blocks beyond the RAM pool: written to the KV tiers when a request finishes, restored on a later hit.

A finished request's full blocks (prompt and output) are copied out of the pool and, on the tiers'
background thread, encoded by :mod:`kvopt.codec` (checksummed, with the model's fingerprint) and
written to every tier (:class:`~kvopt.tiers.TierChain`). A later prompt whose leading blocks miss
the pool's prefix cache looks them up in the tiers, first to last: a hit is decoded into a free
block, which then counts as a prefix-cache hit. Tier keys are the block manager's chained hashes,
whose root is salted with the model fingerprint (configuration + sampled weights), the dtype and
the KV method, plus the codec: stable across processes and machines (no per-process hash seed),
so an engine restarted on the same disk, or a replica on the same Redis, finds them.

A damaged entry, or one from another model, fails to decode: it is dropped from every tier and
its tokens are computed. A request arriving with a prompt starts a prefetch of its blocks from
the slower tiers into the first one, overlapping their transfer with the steps before admission.
"""

from __future__ import annotations

from collections import OrderedDict
from urllib.parse import parse_qs, urlsplit

import torch

from kvopt.cache.paged import PagedKVPool
from kvopt.codec.blocks import decode_block, encode_block
from kvopt.codec.encodings import ENCODINGS
from kvopt.codec.errors import CacheFileError
from kvopt.engine.block_manager import BlockManager
from kvopt.engine.config import EngineConfigError, parse_memory
from kvopt.engine.sequence import Sequence
from kvopt.tiers import DiskTier, KVTier, MemoryTier, RedisTier, TierChain

#: Keys of blocks this process wrote or restored, remembered so they are not written again (bounded).
REMEMBERED = 1 << 17
DEFAULT_DISK = "10GB"


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
    def __init__(self, chain: TierChain, pool: PagedKVPool, manager: BlockManager, fingerprint: dict,
                 encoding: str = "raw") -> None:  # fmt: skip
        if encoding not in ENCODINGS:
            raise EngineConfigError(f"kv_tier_encoding={encoding!r}; use one of {ENCODINGS}")
        self.chain, self.pool, self.manager = chain, pool, manager
        self.fingerprint, self.encoding = fingerprint, encoding
        self._known: OrderedDict[str, None] = OrderedDict()

    @classmethod
    def from_specs(cls, specs, pool, manager, fingerprint, encoding) -> KVOffload:
        return cls(TierChain([open_tier(spec) for spec in specs]), pool, manager, fingerprint, encoding)

    def key(self, digest: bytes) -> str:
        return f"{self.encoding}-{digest.hex()}"

    # -- lookups ------------------------------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Start bringing ``seq``'s prompt blocks into the first tier (when slower tiers stand behind it)."""
        if len(self.chain.tiers) > 1:
            self.chain.prefetch([self.key(digest) for digest in self.manager.prompt_hashes(seq)])

    def restore(self, seq: Sequence, hashes: list[bytes], start: int) -> list[int]:
        """Blocks for ``hashes[start:]`` found in the tiers, in order until the first miss, decoded into free
        blocks of the pool (registered in the prefix cache, not yet held by ``seq``)."""
        size, restored = self.manager.block_size, []
        for index in range(start, len(hashes)):
            if len(restored) >= self.manager.num_free_blocks:
                break  # one more would reuse a block restored just now
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            layers = self._load(hashes[index], tokens)
            if layers is None:
                break
            block_id = self.manager.restore_block(hashes[index], tokens)
            self.pool.write_blocks([*(k for k, _ in layers), *(v for _, v in layers)], [block_id])
            restored.append(block_id)
        return restored

    def _load(self, digest: bytes, tokens: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        key = self.key(digest)
        found = self.chain.get(key)
        if found is None:
            return None
        data, tier = found
        try:
            layers, meta = decode_block(data, self.fingerprint, source=f"{tier.name} tier entry {key}")
        except (CacheFileError, KeyError, ValueError, RuntimeError):
            layers, meta = None, None
        if layers is None or tuple(meta.get("tokens", ())) != tokens:
            tier.stats.corrupt += 1
            self.chain.drop(key)  # never served again
            return None
        self._remember(key)
        return layers

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
