"""One engine replica of the Serve application: one engine on its own thread, as ``kvopt serve`` runs it.

The engine thread and its command queue are :class:`~kvopt.serving.engine_client.EngineClient`'s; the replica only
turns a request's outputs into a stream for the ingress (each item ``(admitted, output or Refusal)``) and reports
what the router needs (:meth:`EngineReplica.record_routing_stats`): the hash root and block size its block manager
names blocks with, the hashes of every block its pool holds, its load, and its metrics snapshot (which the
ingress's ``/metrics`` shows with a ``replica`` label).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvopt.engine.requests import RequestSchemaError
from kvopt.errors import KVOptError
from kvopt.serving.engine_client import EngineClient, EngineUnavailableError


@dataclass
class Refusal:
    """An error of the replica's engine client as data (an exception with extra fields does not survive pickling).

    ``kind``: ``unavailable`` (the engine is not running: a 503), ``refused`` (the engine refused the request as
    given: a 400 naming ``param``), or ``internal`` (anything else: a 500).
    """

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: Exception) -> Refusal:
        if isinstance(error, EngineUnavailableError):
            return cls("unavailable", str(error))
        if isinstance(error, KVOptError):
            return cls("refused", str(error), getattr(error, "param", None))
        return cls("internal", f"{type(error).__name__}: {error}")

    def error(self) -> Exception:
        if self.kind == "unavailable":
            return EngineUnavailableError(self.message)
        if self.kind == "refused":
            return RequestSchemaError(self.message, self.param)
        return RuntimeError(self.message)


class EngineReplica:
    """A Serve deployment class (options set by :func:`kvopt.cluster.app.build`): ``engine_args`` are
    :class:`kvopt.LLM`'s keyword arguments; ``threads`` torch CPU threads (the replica's CPUs)."""

    async def __init__(self, engine_args: dict[str, Any], threads: int) -> None:
        def load():
            import torch

            from kvopt.engine import LLM

            torch.set_num_threads(threads)
            return LLM(**engine_args).engine

        self.client = EngineClient(load)
        self.client.start(asyncio.get_running_loop())
        while self.client.state == "loading":  # Serve sends requests only once the constructor returns
            await asyncio.sleep(0.05)
        self.check_health()
        self.reports = 0

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed is replaced."""
        if not self.client.ready:
            raise EngineUnavailableError(self.client.describe_state())

    async def info(self) -> dict[str, Any]:
        """What the ingress needs to check requests as a single server would: the context and the engine config."""
        engine = self.client.engine
        return {"max_model_len": engine.max_model_len, "config": engine.config}

    async def generate(self, request_id: str, prompt: list[int], params) -> AsyncIterator[tuple[bool, Any]]:
        """The request's outputs, one per engine step; an error ends the stream as a :class:`Refusal`. A cancelled
        call (the client went away) aborts the request, and its blocks return to the pool."""
        stream = None
        try:
            stream = self.client.add(request_id, prompt, params)
            async for output in stream:
                yield stream.admitted, output
        except Exception as error:  # noqa: BLE001 - sent to the ingress, which answers as a single server would
            yield stream is not None and stream.admitted, Refusal.of(error)
        finally:
            if stream is not None:
                stream.close()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every ``request_routing_stats_period_s``; the router reads it (:mod:`kvopt.cluster.router`)."""

        def report(engine) -> dict[str, Any]:
            manager = engine.block_manager
            hashes = b"".join(manager.hash_to_block_id) if manager.enable_prefix_caching else b""
            return {"root_hash": manager.root_hash, "block_size": manager.block_size, "block_hashes": hashes,
                    "kv_method": engine.config.kv_method, "metrics": engine.metrics()}  # fmt: skip

        stats = await self.client.call(report)
        self.reports += 1
        metrics = stats["metrics"]
        return stats | {"version": self.reports, "num_requests": self.client.num_requests,
                        "kv_cache_usage_perc": metrics["kv_cache_usage_perc"]}  # fmt: skip
