"""Which replica holds how much of a prompt, and the routing rule that uses it (no Ray here: tested alone).

Each replica's entry has two parts. ``reported``: the chained block hashes its block manager holds (in use or
freed but still findable), replaced by every routing report the replica sends (so evictions show). ``routed``:
the keys of prompts sent to it since, kept until a report newer than the request could have listed them
(``routed_ttl_s``), so a burst of requests sharing a prefix follows the first one before any report arrives (Ray
Serve LLM's ``PrefixCacheAffinityRouter`` inserts on routing the same way). Whole-prompt keys of compressed prompts
never appear in reports (the pool does not share them); they stay in ``routed`` as an LRU of ``max_routed_keys``.

The rule (Ray Serve LLM's, on block hashes instead of characters, as llm-d's precise prefix scorer): if the
replicas' loads (requests in flight) differ by more than ``imbalanced_threshold``, or their KV usage by more
than ``kv_usage_threshold``, the least loaded wins; otherwise the replicas holding the longest run of the
prompt's leading keys come first (least loaded among them), then the rest by load.
"""

from __future__ import annotations

import math
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

#: Decisions: a replica held part of the prompt; none did (least loaded); the loads were imbalanced (least loaded).
PREFIX_HIT, NO_MATCH, FALLBACK = "prefix_hit", "no_match", "fallback"
#: The KV-aware routers of this process (one per deployment handle), for the ingress's ``/metrics``. It lives here,
#: not in :mod:`kvopt.cluster.router`: Ray Serve pickles a router's module by value, which would copy it.
ROUTERS: weakref.WeakSet = weakref.WeakSet()


@dataclass
class ReplicaEntry:
    reported: frozenset[bytes] = frozenset()
    #: The report's version (a replica counts its reports), so an unchanged report is not parsed again.
    version: object = None
    #: Key -> when it stops counting (``inf`` for whole-prompt keys), oldest first.
    routed: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    def holds(self, key: bytes, now: float) -> bool:
        return key in self.reported or self.routed.get(key, 0.0) > now


class PrefixIndex:
    def __init__(self, routed_ttl_s: float = 30.0, max_routed_keys: int = 100_000) -> None:
        self.routed_ttl_s, self.max_routed_keys = routed_ttl_s, max_routed_keys
        self.replicas: dict[Hashable, ReplicaEntry] = {}

    def report(self, replica: Hashable, version: object, hashes: bytes, digest_size: int = 16) -> None:
        """A replica's report: the concatenated block hashes its pool holds now."""
        entry = self.replicas.setdefault(replica, ReplicaEntry())
        if entry.version != version:
            entry.version = version
            entry.reported = frozenset(hashes[i : i + digest_size] for i in range(0, len(hashes), digest_size))

    def routed(self, replica: Hashable, keys: list[bytes], whole_prompt: bool, now: float | None = None) -> None:
        """``keys`` were sent to ``replica``: count them there until a report can show them."""
        until = math.inf if whole_prompt else (time.monotonic() if now is None else now) + self.routed_ttl_s
        routed = self.replicas.setdefault(replica, ReplicaEntry()).routed
        for key in keys:
            routed[key] = max(until, routed.pop(key, 0.0))
        while len(routed) > self.max_routed_keys:
            routed.popitem(last=False)

    def keep_only(self, replicas: set[Hashable]) -> None:
        """Forget replicas that left (dead or scaled down): their pools went with them."""
        for replica in set(self.replicas) - replicas:
            del self.replicas[replica]

    def matched(self, replica: Hashable, keys: list[bytes], now: float | None = None) -> int:
        """How many of ``keys``, from the first, ``replica`` holds (a run: block ``i`` is no use without ``i - 1``)."""
        entry = self.replicas.get(replica)
        if entry is None:
            return 0
        now = time.monotonic() if now is None else now
        run = 0
        for key in keys:
            if not entry.holds(key, now):
                break
            run += 1
        return run


def rank(
    keys: list[bytes], loads: dict[Hashable, float], usage: dict[Hashable, float], index: PrefixIndex,
    imbalanced_threshold: float, kv_usage_threshold: float, now: float | None = None,
) -> tuple[list[list[Hashable]], str, int]:  # fmt: skip
    """Ranks of replicas (best first), the decision, and the matched run of keys of the first choice."""
    replicas = list(loads)
    random.shuffle(replicas)  # equal loads: spread, do not pile onto the first replica listed
    by_load = sorted(replicas, key=loads.__getitem__)
    if not by_load:
        return [], NO_MATCH, 0
    spread = max(loads.values()) - min(loads.values())
    usage_spread = max(usage.values(), default=0.0) - min(usage.values(), default=0.0)
    if spread > imbalanced_threshold or usage_spread > kv_usage_threshold:
        return _ranks(by_load[:1], by_load[1:]), FALLBACK, 0
    runs = {replica: index.matched(replica, keys, now) for replica in by_load}
    best = max(runs.values())
    if best == 0:
        return _ranks(by_load[:1], by_load[1:]), NO_MATCH, 0
    holders = [replica for replica in by_load if runs[replica] == best]
    return _ranks(holders, [replica for replica in by_load if runs[replica] != best]), PREFIX_HIT, best


def _ranks(*ranks: list[Hashable]) -> list[list[Hashable]]:
    """The non-empty ranks: Ray's router tries each in turn when the replicas of the one before are full."""
    return [rank for rank in ranks if rank]
