"""The cluster's OpenAI-compatible ingress: ``kvopt serve``'s own API (:mod:`kvopt.serving.app`) on remote engines.

The handlers, validation, limits, errors, streaming and response formats are :class:`~kvopt.serving.app.OpenAIServer`'s;
only the engine client differs. :class:`RemoteEngineClient` tokenizes here (the router hashes these token ids) and
sends each request through the engine deployment's handle, where :mod:`kvopt.cluster.router` picks the replica; each
:class:`RemoteStream` reads that replica's outputs as :class:`~kvopt.serving.engine_client.RequestStream` reads the
engine thread's. A replica that dies before a request got its first output gets the request again elsewhere (once);
after that the request ends with a 503 (a stream: an ``error`` event, then ``[DONE]``). :class:`ClusterServer` counts
capacity over all replicas and renders every replica's metrics with a ``replica`` label, plus the router's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException

from kvopt.cluster.replica import Refusal
from kvopt.cluster.index import ROUTERS
from kvopt.serving.app import RETRY_AFTER_FULL_S, OpenAIServer, ServerSettings, build_app
from kvopt.serving.engine_client import EngineUnavailableError, RequestStream
from kvopt.serving.errors import APIError


@dataclass
class EngineFacts:
    """The part of an engine the API checks requests against (every replica runs the same settings)."""

    max_model_len: int
    config: Any  # the replicas' EngineConfig


class RemoteStream(RequestStream):
    """One request's outputs from its replica, read as :class:`~kvopt.serving.engine_client.RequestStream` reads the
    engine thread's (its queue stays unused: the outputs come from the streamed call)."""

    def __init__(self, client: RemoteEngineClient, request_id: str, prompt: list[int], params) -> None:
        super().__init__(client, request_id)
        self.prompt, self.params, self.retried = prompt, params, False
        #: Why the request was ended from this side (:meth:`fail`), if it was.
        self.ended: str | None = None
        self.responses = client.send(request_id, prompt, params)

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        while True:
            try:
                admitted, item = await anext(self.responses)
                break
            except BackPressureError:
                raise self.client.full() from None
            except (RayError, RayServeException, StopAsyncIteration) as error:
                if self.ended is not None:
                    raise EngineUnavailableError(self.ended) from None
                if self.delivered or self.retried:
                    sent = "after sending part of it" if self.delivered else "twice, before its first token"
                    raise EngineUnavailableError(f"the replica serving this request stopped ({type(error).__name__}) "
                                                 f"{sent}; retry the request") from None  # fmt: skip
                self.retried = True  # nothing was sent yet: once more, on whichever replica the router picks now
                self.responses = self.client.send(f"{self.request_id}-retry", self.prompt, self.params)
        if isinstance(item, Refusal):
            raise item.error()
        self.admitted, self.finished = admitted, item.finished
        self.delivered.append(time.perf_counter())
        return item

    def fail(self, reason: str) -> None:
        self.ended = reason
        self.abort()

    def abort(self) -> None:
        """Cancel the streamed call, which aborts the request on its replica. Serve's ``cancel`` raises the call's
        error when it never reached one (refused by Serve's queue, its replica died): already answered, so ignored."""
        with contextlib.suppress(RayError, RayServeException):
            self.responses.cancel()


class RemoteEngineClient:
    """:class:`~kvopt.serving.engine_client.EngineClient`'s interface for :class:`OpenAIServer`, on a deployment
    handle of :class:`~kvopt.cluster.replica.EngineReplica` (``model`` names the tokenizer to load here); ready
    once :meth:`connect` returned."""

    def __init__(self, handle, model: str | None) -> None:
        self.handle, self.model = handle, model
        self.engine: EngineFacts | None = None
        self.tokenizer = None
        self.streams: dict[str, RemoteStream] = {}
        self.ended: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def state(self) -> str:
        return "ready" if self.ready else "loading"

    def check_ready(self) -> None:
        if not self.ready:
            raise EngineUnavailableError(self.describe_state())

    def describe_state(self) -> str:
        return "the engine replicas are still loading; retry in a few seconds"

    @property
    def num_requests(self) -> int:
        return len(self.streams)

    @property
    def num_replicas(self) -> int:
        """Live engine replicas as this process's router sees them (at least one)."""
        return max([len(router.curr_replicas) for router in list(ROUTERS)] + [1])

    async def connect(self) -> None:
        """Wait for an engine replica to answer (Serve starts the ingress once they run), and load the tokenizer."""
        from kvopt.models import load_tokenizer

        info = await self.handle.info.remote()
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model)
        self.engine = EngineFacts(info["max_model_len"], info["config"])

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def stop(self) -> None:
        """Nothing to stop here: Serve stops the replicas."""

    def send(self, request_id: str, prompt: list[int], params):
        """The request's streamed call on the engine deployment (the router picks its replica); a 429 when Serve's
        queue for the replicas is full (raised here or when the first output is awaited)."""
        try:
            return self.handle.options(stream=True).generate.remote(request_id, prompt, params)
        except BackPressureError:
            raise self.full() from None

    def full(self) -> APIError:
        return _full(f"all {self.num_replicas} replicas are full")

    def add(self, request_id: str, prompt: list[int], params) -> RemoteStream:
        self.check_ready()
        if self.ended is not None:
            raise EngineUnavailableError(self.ended)
        stream = self.streams[request_id] = RemoteStream(self, request_id, prompt, params)
        return stream

    def end_requests(self, reason: str) -> None:
        self.ended = reason
        for stream in list(self.streams.values()):
            stream.fail(reason)


def _full(what: str) -> APIError:
    return APIError(429, f"the cluster is full: {what} (--max-num-seqs, --max-waiting per replica); retry in "
                         f"{RETRY_AFTER_FULL_S} s", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_FULL_S)})  # fmt: skip


class ClusterServer(OpenAIServer):
    """The single server's handlers; capacity and ``/metrics`` span every replica."""

    client: RemoteEngineClient

    def __init__(self, client: RemoteEngineClient, settings: ServerSettings) -> None:
        super().__init__(client, settings)
        self.metrics.registry.register(RouterCollector(settings.model_name))

    def _check_capacity(self) -> None:
        replicas, per_replica = self.client.num_replicas, self.client.engine.config.max_num_seqs + self.settings.max_waiting
        if self.client.num_requests >= replicas * per_replica:
            raise _full(f"{self.client.num_requests} requests in flight on {replicas} replicas of {per_replica} each")

    async def prometheus(self) -> Response:
        reports = {replica: report["metrics"] for router in list(ROUTERS) for replica, report in router.reports().items()}
        return Response(self.metrics.render_replicas(reports), media_type=CONTENT_TYPE_LATEST)


class RouterCollector:
    """The routers' decisions in this process (``kvopt:router_*``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self):
        routers, labels = list(ROUTERS), [self.model_name]
        families = {
            "prefix_hits": ("Requests sent to a replica holding a run of their leading KV blocks.", CounterMetricFamily),
            "fallbacks": ("Requests sent to the least loaded replica because loads were imbalanced.", CounterMetricFamily),
            "routed": ("Requests routed by the KV-aware router.", CounterMetricFamily),
        }  # fmt: skip
        for name, (doc, kind) in families.items():
            family = kind(f"kvopt:router_{name}", doc, labels=["model_name"])
            family.add_metric(labels, sum(getattr(router.stats, name) for router in routers))
            yield family
        for name, clock in (("decision", "wall-clock time"), ("decision_cpu", "CPU time in its thread")):
            decisions = sorted(seconds for router in routers for seconds in getattr(router.stats, f"{name}_seconds"))
            summary = SummaryMetricFamily(f"kvopt:router_{name}_seconds", f"The router's {clock} per decision (latest "
                                          "10,000 per router).", labels=["model_name"])  # fmt: skip
            summary.add_metric(labels, len(decisions), sum(decisions))
            yield summary
            for quantile in (50, 99):
                gauge = GaugeMetricFamily(f"kvopt:router_{name}_p{quantile}_seconds", f"{quantile}th percentile of the "
                                          f"router's {clock} per decision (latest 10,000 per router).",
                                          labels=["model_name"])  # fmt: skip
                gauge.add_metric(labels, decisions[int(quantile / 100 * (len(decisions) - 1))] if decisions else 0.0)
                yield gauge
        replicas = GaugeMetricFamily("kvopt:router_replicas", "Engine replicas the router can send to.",
                                     labels=["model_name"])  # fmt: skip
        replicas.add_metric(labels, max([len(router.curr_replicas) for router in routers] + [0]))
        yield replicas


class Ingress:
    """The ingress deployment class (wrapped by ``serve.ingress()`` in :func:`kvopt.cluster.app.build`)."""

    async def __init__(self, engine, settings: ServerSettings, model: str | None) -> None:
        self.client, self.settings = RemoteEngineClient(engine, model), settings
        await self.client.connect()  # the application is ready once its replicas and tokenizer are

    def __serve_build_asgi_app__(self):
        return build_app(self.client, self.settings, ClusterServer)
