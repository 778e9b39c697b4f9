"""``kvopt batch --ray``: the batch file's requests through Ray Data, over engine actors spread on the cluster.

Each actor holds one engine (:class:`kvopt.LLM`) and runs its share of the lines exactly as ``kvopt batch`` runs a
whole file (the caller's ``run_lines``, so a line the engine or the schema refuses fails alone, with its error in
its result line). Ray Data hands batches of lines to the actors as they free up (``map_batches`` with an actor pool
of ``replicas``); results come back as batches finish and the caller restores input order.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvopt.cluster.app import ClusterSpec, connect

#: ``run_lines(llm, lines)``: ``(custom_id, result line)`` for every line, in any order.
RunLines = Callable[[Any, list], Iterable[tuple[str, dict]]]


class EngineActor:
    """One Ray Data actor: an engine, and the batch runner's function applied to each batch of lines."""

    def __init__(self, engine_args: dict[str, Any], run_lines: RunLines, threads: int) -> None:
        import torch

        from kvopt.engine import LLM

        torch.set_num_threads(threads)
        self.llm, self.run_lines = LLM(**engine_args), run_lines

    def __call__(self, batch: dict) -> dict[str, list]:
        lines = [pickle.loads(line) for line in batch["line"]]
        done = list(self.run_lines(self.llm, lines))
        return {"custom_id": [custom_id for custom_id, _ in done], "result": [json.dumps(result) for _, result in done]}


def ray_results(lines: list, run_lines: RunLines, engine_args: dict[str, Any], replicas: int, threads: int = 1,
                batch_size: int = 16, address: str | None = None) -> Iterator[tuple[str, dict]]:  # fmt: skip
    """``(custom_id, result line)`` for every line, as batches finish on ``replicas`` engine actors of ``threads``
    CPUs each (a local Ray cluster unless one runs or ``address`` names one)."""
    import ray

    connect(address, ClusterSpec(replicas, cpus_per_replica=threads))
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    items = [{"line": pickle.dumps(line)} for line in lines]
    results = ray.data.from_items(items).map_batches(
        EngineActor, fn_constructor_kwargs={"engine_args": engine_args, "run_lines": run_lines, "threads": threads},
        batch_size=batch_size, concurrency=replicas, num_cpus=threads,
    )  # fmt: skip
    for row in results.iter_rows():
        yield row["custom_id"], json.loads(row["result"])
