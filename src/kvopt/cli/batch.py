"""``kvopt batch``: one request per JSONL line through the engine, one result per line (vLLM's batch runner).

Each input line is either vLLM's batch format, ``{"custom_id": ..., "body": {...}}`` with an
OpenAI completions or chat body, or the body alone: ``{"prompt": "..."}`` or
``{"messages": [...]}``, with OpenAI's sampling fields (``max_tokens``, ``temperature``,
``top_p``, ``stop``, ``n``, ``seed``, ``logprobs``) and kvopt's ``top_k``, ``ignore_eos``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvopt.cli.options import DeviceOption, EngineSpeculateOption, ModelOption, SpeculateMaxBatchOption
from kvopt.errors import KVOptError

SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "n", "seed", "logprobs", "ignore_eos",
                   "stop_token_ids", "kv_method"}  # fmt: skip
IGNORED_FIELDS = {"model", "stream", "user"}


class BatchInputError(KVOptError):
    """A line of the batch file cannot be read as a request (names the line and the fix)."""


def read_requests(path: Path, default_max_tokens: int) -> list[dict]:
    """``[{"id", "prompt" | "messages", "params"}]`` from the JSONL file, every line checked before any runs."""
    from kvopt.engine import SamplingParams

    if not path.is_file():
        raise BatchInputError(f"{path} is not a file; give a JSONL file with one request per line")
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise BatchInputError(f"{where}: not valid JSON ({error.msg}); write one JSON object per line") from None
        if not isinstance(entry, dict):
            raise BatchInputError(f"{where}: expected a JSON object such as {{\"prompt\": \"Hello\"}}")
        body = entry.get("body", entry)
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise BatchInputError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" (a chat)")
        if prompt is not None and not isinstance(prompt, str):
            raise BatchInputError(f"{where}: \"prompt\" must be a string")
        unknown = set(body) - SAMPLING_FIELDS - IGNORED_FIELDS - {"prompt", "messages"}
        if unknown:
            raise BatchInputError(f"{where}: unknown field(s) {sorted(unknown)}; sampling fields are {sorted(SAMPLING_FIELDS)}")
        options = {key: body[key] for key in SAMPLING_FIELDS if key in body}
        if options.get("logprobs") is True:  # OpenAI chat style: a flag, alternatives via top_logprobs
            options["logprobs"] = int(body.get("top_logprobs", 0))
        options.setdefault("max_tokens", default_max_tokens)
        try:
            params = SamplingParams(**options)
        except (KVOptError, TypeError) as error:
            raise BatchInputError(f"{where}: {error}") from None
        custom_id = entry.get("custom_id", f"line-{number}")
        requests.append({"id": custom_id, "prompt": prompt, "messages": messages, "params": params})
    if not requests:
        raise BatchInputError(f"{path} holds no requests; write one JSON object per line")
    return requests


def batch(
    input_file: Annotated[Path, typer.Argument(help="JSONL, one request per line")],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL results, one per request, in input order")],
    model: ModelOption = None,
    kv_method: Annotated[str, typer.Option(help="KV method spec for the engine")] = "full",
    kv_memory: Annotated[str, typer.Option(help="KV pool size: 1GB, 512MiB, or a fraction of free memory (0.5)")] = "1GB",
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of lines that do not set it")] = 128,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="sequences decoded together at most")] = 64,
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching")] = True,
    metrics: Annotated[bool, typer.Option("--metrics/--no-metrics", help="print the engine's metrics at the end")] = True,
    device: DeviceOption = "auto",
    speculate: EngineSpeculateOption = None,
    speculate_max_batch: SpeculateMaxBatchOption = None,
) -> None:
    """Run a JSONL file of requests through the serving engine (continuous batching, prefix caching)."""
    from rich.console import Console

    requests = read_requests(input_file, max_tokens)
    _check_writable(output)
    from kvopt.engine import LLM

    llm = LLM(model, kv_method=kv_method, kv_memory=kv_memory, block_size=block_size, enable_prefix_caching=prefix_caching,
              max_num_seqs=max_num_seqs, device=device, speculate=speculate,
              speculate_max_batch=speculate_max_batch)  # fmt: skip
    prompts = [r["prompt"] if r["prompt"] is not None else llm.chat_prompt(r["messages"]) for r in requests]
    outputs = llm.generate(prompts, [r["params"] for r in requests])
    with output.open("w") as sink:
        for request, result in zip(requests, outputs):
            sink.write(json.dumps(_result_line(request["id"], result)) + "\n")
    console = Console(stderr=True)
    console.print(f"wrote {len(outputs)} results to {output}", highlight=False)
    if metrics:
        _print_metrics(console, llm.metrics())


def _result_line(custom_id: str, result) -> dict:
    completions = [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    **({"logprobs": [{str(k): v for k, v in step.items()} for step in c.logprobs]} if c.logprobs else {})}
                   for c in result.outputs]  # fmt: skip
    generated = sum(len(c.token_ids) for c in result.outputs)
    usage = {"prompt_tokens": len(result.prompt_token_ids), "completion_tokens": generated,
             "prompt_tokens_details": {"cached_tokens": result.metrics.cached_tokens}}  # fmt: skip
    timing = {"time_to_first_token_s": result.metrics.time_to_first_token, "e2e_latency_s": result.metrics.e2e_latency}
    return {"custom_id": custom_id, "error": result.error,
            "response": None if result.error else {"choices": completions, "usage": usage, "metrics": timing}}  # fmt: skip


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise BatchInputError(f"--output {path} is a folder; give a file name such as {path / 'results.jsonl'}")
    if not path.parent.exists():
        raise BatchInputError(f"--output {path}: folder {path.parent} does not exist; create it first")


def _print_metrics(console, snapshot: dict) -> None:
    from rich.table import Table

    table = Table("metric", "value", title="engine metrics")
    for name, value in snapshot.items():
        if isinstance(value, dict) and "p50" in value:
            shown = "–" if value["p50"] is None else f"p50 {value['p50']:.3f} s, p99 {value['p99']:.3f} s (n={value['count']})"
        elif isinstance(value, float):
            shown = f"{value:.4g}"
        else:
            shown = str(value)
        table.add_row(name, shown)
    console.print(table)
