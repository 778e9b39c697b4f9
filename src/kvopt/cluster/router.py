"""The KV-aware Ray Serve request router: send a prompt where its leading KV blocks already are.

Ray Serve's custom router API (``ray.serve.request_router.RequestRouter``, alpha in Ray 2.60): ``choose_replicas``
returns ranks of replicas, best first, and Serve sends the request to the least busy replica of the first rank that
has room. The prompt's keys (:mod:`keys`) are computed from the request's token ids (tokenized once, by the ingress)
with the block size and hash root the replicas report; each replica's holdings come from its routing reports
(``EngineReplica.record_routing_stats``, every ``request_routing_stats_period_s``) and from what was routed to it
since (:class:`~kvopt.cluster.index.PrefixIndex`). The rule is :func:`~kvopt.cluster.index.rank`.

The router lives in the process holding the deployment handle (the ingress); it registers itself in
:data:`kvopt.cluster.index.ROUTERS` so the ingress's ``/metrics`` can show its decisions and the replicas' latest
reports.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvopt.cluster import index as shared  # by module: this module is pickled by value, kvopt.cluster.index is not
from kvopt.cluster.index import FALLBACK, PREFIX_HIT, PrefixIndex, rank
from kvopt.cluster.keys import route_keys

#: Decisions kept for requests not yet routed (older ones were cancelled while waiting).
MAX_PENDING = 10_000


@dataclass
class RouterStats:
    #: Requests sent to a replica that held a run of their leading blocks (or their whole compressed prompt).
    prefix_hits: int = 0
    #: Requests sent to the least loaded replica because the loads were imbalanced.
    fallbacks: int = 0
    routed: int = 0
    #: Seconds each of the latest routing decisions took (the router's added latency), wall clock.
    decision_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    #: The same decisions' CPU seconds in the router's thread: its own cost, without the time the OS gave the core
    #: to other processes meanwhile (on a machine whose cores the replicas keep busy, wall time mostly measures that).
    decision_cpu_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))


class KVAwareRouter(RequestRouter):
    """Prefix affinity by the engine's chained block hashes, balanced by load (see :mod:`kvopt.cluster.index`)."""

    def initialize_state(self, imbalanced_threshold: float = 10, kv_usage_threshold: float = 0.5,
                         routed_ttl_s: float = 30.0, max_routed_keys: int = 100_000) -> None:  # fmt: skip
        self.imbalanced_threshold, self.kv_usage_threshold = imbalanced_threshold, kv_usage_threshold
        self.index = PrefixIndex(routed_ttl_s, max_routed_keys)
        self.stats = RouterStats()
        #: Request -> (keys, whole-prompt key?, decision) between ``choose_replicas`` and ``on_request_routed``.
        self.pending: OrderedDict[str, tuple[list[bytes], bool, str]] = OrderedDict()
        shared.ROUTERS.add(self)

    def reports(self) -> dict[str, dict]:
        """The latest routing report of every live replica, by replica id."""
        return {replica_id.unique_id: replica.routing_stats for replica_id, replica in self.curr_replicas.items()
                if replica.routing_stats}  # fmt: skip

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        start, cpu_start = time.perf_counter(), time.thread_time()
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        self.index.keep_only(set(self.curr_replicas))
        loads, usage, keys, whole = {}, {}, [], False
        for replica_id, replica in by_id.items():
            report = replica.routing_stats or {}
            if report:
                self.index.report(replica_id, report["version"], report["block_hashes"])
                usage[replica_id] = report["kv_cache_usage_perc"]
            queued = self.replica_queue_len_cache.get(replica_id)
            loads[replica_id] = report.get("num_requests", 0) if queued is None else queued
        request = _engine_request(pending_request)
        facts = next((replica.routing_stats for replica in candidate_replicas if replica.routing_stats), None)
        if request is not None and facts is not None:
            prompt, kv_method = request
            kv_method = kv_method or facts["kv_method"]
            keys, whole = route_keys(prompt, kv_method, facts["root_hash"], facts["block_size"])
        ranks, decision, _ = rank(keys, loads, usage, self.index, self.imbalanced_threshold, self.kv_usage_threshold)
        if pending_request is not None:
            self.pending[pending_request.metadata.internal_request_id] = (keys, whole, decision)
            while len(self.pending) > MAX_PENDING:  # requests cancelled before they were routed
                self.pending.popitem(last=False)
        self.stats.decision_seconds.append(time.perf_counter() - start)
        self.stats.decision_cpu_seconds.append(time.thread_time() - cpu_start)
        return [[by_id[replica_id] for replica_id in replicas] for replicas in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys, whole, decision = self.pending.pop(pending_request.metadata.internal_request_id, ([], False, ""))
        self.index.routed(replica_id, keys, whole)
        self.stats.routed += 1
        self.stats.prefix_hits += decision == PREFIX_HIT
        self.stats.fallbacks += decision == FALLBACK


def _engine_request(pending_request: PendingRequest | None) -> tuple[list[int], str | None] | None:
    """``(prompt token ids, the request's kv_method)`` of an ``EngineReplica.generate`` call; None for other calls."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    _, prompt, params = pending_request.args
    return (prompt, params.kv_method) if isinstance(prompt, list) else None  # token ids (not a prompt of chunks)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, blind to KV and load (a baseline for ``benchmarks/cluster.py``)."""

    def initialize_state(self) -> None:
        self.turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        replicas = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        self.turn += 1
        return [[replicas[self.turn % len(replicas)]]] if replicas else []
