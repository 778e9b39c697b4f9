"""The Ray Serve application: N engine replicas behind the KV-aware router and one OpenAI-compatible ingress.

``kvopt serve --replicas N`` runs :func:`serve_cluster`: it starts a local Ray cluster (or joins one with
``--ray-address auto|HOST:PORT``), checks the cluster has the CPUs the replicas ask for, deploys :func:`build`, and
serves on ``--host``/``--port`` through Ray Serve's HTTP proxy until SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from kvopt.errors import KVOptError

#: The Serve application's name, and its deployments'.
APP_NAME, ENGINE, INGRESS = "kvopt", "engine", "ingress"
#: Router name -> its class in :mod:`kvopt.cluster.router` (None: Ray Serve's default, power of two choices).
ROUTERS = {"kv": "KVAwareRouter", "power_of_two": None, "round_robin": "RoundRobinRouter"}


class ClusterConfigError(KVOptError):
    """The cluster cannot run as asked (names the setting and the fix)."""


@dataclass
class ClusterSpec:
    """How many replicas, and what each one gets."""

    #: Replicas at start (with autoscaling: between ``min_replicas`` and ``max_replicas``).
    replicas: int = 2
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    #: Seconds between a replica's routing reports (the block hashes it holds, its load and metrics).
    stats_period_s: float = 1.0
    #: ``KVAwareRouter.initialize_state`` keyword arguments (``imbalanced_threshold``, ``kv_usage_threshold``, ...).
    router_kwargs: dict[str, Any] | None = None
    #: ``kv`` (:class:`~kvopt.cluster.router.KVAwareRouter`); ``power_of_two`` (Ray Serve's default) and
    #: ``round_robin``, the baselines of ``benchmarks/cluster.py`` (``/metrics`` then shows no per-replica series).
    router: str = "kv"

    def check(self) -> None:
        if self.replicas < 1:
            raise ClusterConfigError(f"--replicas {self.replicas}: give at least 1 (each replica runs one engine)")
        autoscaling = self.min_replicas is not None or self.max_replicas is not None
        if autoscaling and not 1 <= (self.min_replicas or 1) <= (self.max_replicas or self.replicas):
            raise ClusterConfigError(f"--min-replicas {self.min_replicas} --max-replicas {self.max_replicas}: "
                                     "give 1 <= min <= max")  # fmt: skip
        if self.router not in ROUTERS:
            raise ClusterConfigError(f"router {self.router!r}; use one of {', '.join(ROUTERS)}")

    @property
    def most_replicas(self) -> int:
        return max(self.replicas, self.max_replicas or 0)

    def autoscaling_config(self, target_ongoing: int) -> dict | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        low = self.min_replicas or 1
        return {"min_replicas": low, "initial_replicas": max(low, min(self.replicas, self.max_replicas or self.replicas)),
                "max_replicas": self.max_replicas or self.replicas, "target_ongoing_requests": target_ongoing}  # fmt: skip


def connect(address: str | None, spec: ClusterSpec) -> None:
    """Start a local Ray cluster (``address`` None) or join one (``auto``, ``HOST:PORT``), with room for the replicas."""
    import ray

    spec.check()
    if address not in (None, "auto"):
        _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    except ConnectionError as error:
        raise ClusterConfigError(f"--ray-address {address}: no Ray cluster answers ({str(error).splitlines()[0]}); "
                                 "start one with `ray start --head` or leave --ray-address out for a local one") from None  # fmt: skip
    cpus, needed = ray.cluster_resources().get("CPU", 0.0), spec.most_replicas * spec.cpus_per_replica
    if needed > cpus:
        raise ClusterConfigError(f"--replicas {spec.most_replicas} need {needed:g} CPUs ({spec.cpus_per_replica:g} each) "
                                 f"but the cluster has {cpus:g}; lower --replicas or add machines "
                                 "(`ray start --address HEAD:6379` on each)")  # fmt: skip


def _check_reachable(address: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterConfigError(f"--ray-address {address}: give auto or HOST:PORT (the head's `ray start --head` port)")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as error:
        raise ClusterConfigError(f"--ray-address {address} does not answer ({error.strerror or error}); start the head "
                                 "with `ray start --head` there, or leave --ray-address out for a local cluster") from None  # fmt: skip


def build(engine_args: dict[str, Any], settings, spec: ClusterSpec, max_num_seqs: int):
    """The Serve application: ``engine_args`` (:class:`kvopt.LLM`'s keyword arguments) for every replica,
    ``settings`` (:class:`~kvopt.serving.ServerSettings`) for the ingress, each replica taking ``max_num_seqs``
    running and ``settings.max_waiting`` waiting requests."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvopt.cluster import router as routers
    from kvopt.cluster.ingress import Ingress
    from kvopt.cluster.replica import EngineReplica

    spec.check()
    chosen = ROUTERS[spec.router]
    kind = {} if chosen is None else {"request_router_class": getattr(routers, chosen),
                                      "request_router_kwargs": spec.router_kwargs or {} if spec.router == "kv" else {}}  # fmt: skip
    router = RequestRouterConfig(request_routing_stats_period_s=spec.stats_period_s, **kind)
    autoscaling = spec.autoscaling_config(max_num_seqs)
    room = max_num_seqs + settings.max_waiting
    # The ingress admits at most every replica's room; Serve's queue in front of the router holds a burst of that
    # many while the router assigns them (a queue of --max-waiting refused requests the replicas had room for).
    engine = serve.deployment(
        EngineReplica, name=ENGINE, ray_actor_options={"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_replica},
        max_ongoing_requests=room, max_queued_requests=spec.most_replicas * room,
        request_router_config=router, health_check_period_s=2, graceful_shutdown_timeout_s=settings.shutdown_timeout,
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": spec.replicas}),
    )  # fmt: skip
    threads = max(1, int(spec.cpus_per_replica))
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1_000_000)  # fmt: skip
    return ingress.bind(engine.bind(engine_args, threads), settings, engine_args.get("model"))


def serve_cluster(engine_args: dict[str, Any], settings, spec: ClusterSpec, max_num_seqs: int, host: str, port: int,
                  address: str | None = None) -> None:  # fmt: skip
    """``kvopt serve --replicas N``: deploy and serve until SIGINT/SIGTERM, then shut the application down."""
    import ray
    from ray import serve

    connect(address, spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(engine_args, settings, spec, max_num_seqs), name=APP_NAME, route_prefix="/")
        print(f"kvopt: {spec.replicas} engine replicas serving at http://{host}:{port}/v1", flush=True)
        stop.wait()
    finally:
        serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
            ray.shutdown()
