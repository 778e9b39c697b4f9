"""``kvopt batch``: one request per JSONL line through the engine, one result per line (vLLM's batch runner).

Each input line is either vLLM's batch format, ``{"custom_id": ..., "body": {...}}`` with an
OpenAI completions or chat body, or the body alone: ``{"prompt": "..."}`` or
``{"messages": [...]}``. Bodies are checked with the server's schema (:mod:`kvopt.engine.requests`), so a line
is accepted exactly when the server would accept it as a request; lines default to greedy decoding
(``temperature`` 0) and ``--max-tokens``.

Every line and the output path are checked before the model loads. Results are appended to the output as
requests finish, so a kill or a late failure keeps every finished one; at the end the file is rewritten in input
order (atomically). ``--resume`` keeps the results an earlier run left in the output and runs only the other lines.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvopt.cli.options import DeviceOption, DtypeOption, EngineSpeculateOption, ModelOption, SpeculateMaxBatchOption
from kvopt.errors import KVOptError


class BatchInputError(KVOptError):
    """A line of the batch file cannot be read as a request (names the line and the fix)."""


@dataclass
class BatchLine:
    """One request of the file: where it is, its id, and its body as the request schema read it."""

    where: str
    custom_id: str
    body: object  # a CompletionRequest or ChatCompletionRequest

    @property
    def messages(self) -> list[dict[str, str]] | None:
        return [m.as_template_input() for m in self.body.messages] if hasattr(self.body, "messages") else None


def read_requests(path: Path, default_max_tokens: int) -> list[BatchLine]:
    """The file's requests, every line checked (schema, sampling settings, unique ids) before any runs."""
    if not path.is_file():
        raise BatchInputError(f"{path} is not a file; give a JSONL file with one request per line")
    requests, seen = [], {}
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BatchInputError(f"{where}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
                                  "save the file as UTF-8") from None  # fmt: skip
        if not line.strip():
            continue
        request = _read_line(line, where, number, default_max_tokens)
        if request.custom_id in seen:
            raise BatchInputError(f"{where}: custom_id {request.custom_id!r} is already used on line "
                                  f"{seen[request.custom_id]}; give each request its own id")  # fmt: skip
        seen[request.custom_id] = number
        requests.append(request)
    if not requests:
        raise BatchInputError(f"{path} holds no requests; write one JSON object per line")
    return requests


def _read_line(line: str, where: str, number: int, default_max_tokens: int) -> BatchLine:
    from kvopt.engine.requests import ChatCompletionRequest, CompletionRequest, RequestSchemaError, validated

    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise BatchInputError(f"{where}: not valid JSON ({error.msg}); write one JSON object per line") from None
    if not isinstance(entry, dict):
        raise BatchInputError(f"{where}: expected a JSON object such as {{\"prompt\": \"Hello\"}}")
    body = entry.get("body", entry) if "custom_id" in entry else entry
    custom_id = entry.get("custom_id", f"line-{number}") if "body" in entry else f"line-{number}"
    if not isinstance(body, dict):
        raise BatchInputError(f"{where}: \"body\" must be a JSON object such as {{\"prompt\": \"Hello\"}}")
    if not isinstance(custom_id, str):
        raise BatchInputError(f"{where}: custom_id must be a string")
    if ("prompt" in body) == ("messages" in body):
        raise BatchInputError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" (a chat)")
    schema = CompletionRequest if "prompt" in body else ChatCompletionRequest
    try:
        request = validated(schema, {"temperature": 0.0, **body}, f"{where}: ")
        request.sampling_params(request.requested_max_tokens or default_max_tokens)  # n, temperature together
    except RequestSchemaError as error:
        raise BatchInputError(str(error) if str(error).startswith(where) else f"{where}: {error}") from None
    return BatchLine(where, custom_id, request)


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
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="keep the results already in --output (an "
                                         "interrupted run's) and run only the other lines")] = False,  # fmt: skip
    dtype: DtypeOption = None,
    device: DeviceOption = "auto",
    speculate: EngineSpeculateOption = None,
    speculate_max_batch: SpeculateMaxBatchOption = None,
    ray: Annotated[bool, typer.Option("--ray/--no-ray", help="spread the lines over engine actors on Ray Data "
                                      "(a local Ray cluster, or the one RAY_ADDRESS names; pip install kvopt[cluster])")] = False,
    replicas: Annotated[int, typer.Option(help="with --ray: engine actors, one CPU each")] = 2,
) -> None:
    """Run a JSONL file of requests through the serving engine (continuous batching, prefix caching)."""
    from rich.console import Console

    requests = read_requests(input_file, max_tokens)
    _check_writable(output, input_file)
    done = _finished_results(output, {request.custom_id for request in requests}) if resume else {}
    console = Console(stderr=True)
    todo = [request for request in requests if request.custom_id not in done]
    if done:
        console.print(f"resuming: {len(done)} results already in {output}, {len(todo)} lines to run", highlight=False)
    from kvopt.engine import LLM

    engine_args = dict(model=model, kv_method=kv_method, kv_memory=kv_memory, block_size=block_size,
                       enable_prefix_caching=prefix_caching, max_num_seqs=max_num_seqs, dtype=dtype, device=device,
                       speculate=speculate, speculate_max_batch=speculate_max_batch)  # fmt: skip
    if ray:
        from functools import partial

        from kvopt.cluster.batch import ray_results

        llm, results = None, ray_results(todo, partial(_results, default_max_tokens=max_tokens), engine_args, replicas)
    else:
        llm = LLM(**engine_args)
        results = _results(llm, todo, max_tokens)
    _keep_only(output, done.values())
    with output.open("a", encoding="utf-8") as sink:
        for custom_id, line in results:
            sink.write(json.dumps(line) + "\n")
            sink.flush()  # a kill keeps every finished result
            done[custom_id] = line
    _keep_only(output, [done[request.custom_id] for request in requests])  # input order
    console.print(f"wrote {len(requests)} results to {output}", highlight=False)
    if metrics and llm is not None:  # with --ray each actor had its own engine
        _print_metrics(console, llm.metrics())


def _results(llm, requests: list[BatchLine], default_max_tokens: int):
    """``(custom_id, result line)`` of every request as it finishes; lines the model refuses first."""
    from kvopt.engine.requests import RequestSchemaError, max_tokens_within

    runnable, prompts, params = [], [], []
    context = llm.engine.max_model_len
    for request in requests:
        try:
            ids = _prompt_ids(llm, request)
            requested = request.body.requested_max_tokens
            if len(ids) < context:  # a longer prompt is the engine's to refuse (naming the prompt)
                budget = max_tokens_within(requested, len(ids), context, default_max_tokens,
                                           request.body.max_tokens_field)  # fmt: skip
            else:
                budget = requested or default_max_tokens
        except RequestSchemaError as error:
            yield request.custom_id, _error_line(request.custom_id, f"{request.where}: {error}")
            continue
        runnable.append(request)
        prompts.append(ids)
        params.append(request.body.sampling_params(budget))
    for index, output in llm.as_completed(prompts, params):
        yield runnable[index].custom_id, _result_line(runnable[index].custom_id, output)


def _prompt_ids(llm, request: BatchLine) -> list[int]:
    from kvopt.engine.requests import RequestSchemaError

    prompt = getattr(request.body, "prompt", None)
    if isinstance(prompt, list):
        return prompt
    if prompt is not None:
        return list(llm.tokenizer(prompt).input_ids)
    try:
        return llm.chat_prompt(request.messages)
    except KVOptError:
        raise
    except Exception as error:  # noqa: BLE001 - templates raise what they like (e.g. "roles must alternate")
        raise RequestSchemaError(f"the model's chat template refused these messages: {error}", "messages") from None


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


def _error_line(custom_id: str, message: str) -> dict:
    return {"custom_id": custom_id, "error": message, "response": None}


def _check_writable(path: Path, source: Path) -> None:
    """Refuse an output the run could not write at the end (found before the model loads, not after)."""
    if path.resolve() == source.resolve():
        raise BatchInputError(f"--output {path} is the input file; write the results to another file")
    if path.is_dir():
        raise BatchInputError(f"--output {path} is a folder; give a file name such as {path / 'results.jsonl'}")
    for parent in path.absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise BatchInputError(f"--output {path}: {parent} is a file, not a folder; choose another output path")
    if not path.parent.exists():
        raise BatchInputError(f"--output {path}: folder {path.parent} does not exist; create it first")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise BatchInputError(f"--output {path} is not writable; choose a path you can write to")


def _finished_results(path: Path, ids: set[str]) -> dict[str, dict]:
    """Results an earlier run left in ``path`` for requests of this file, by custom_id (a line cut short by a kill,
    or one for another request, is dropped: its request runs again)."""
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and result.get("custom_id") in ids:
            found[result["custom_id"]] = result
    return found


def _keep_only(path: Path, results) -> None:
    """Replace ``path`` with ``results`` (one JSON line each) atomically: a kill leaves the old file or the new."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text("".join(json.dumps(result) + "\n" for result in results), encoding="utf-8")
    os.replace(temporary, path)


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
