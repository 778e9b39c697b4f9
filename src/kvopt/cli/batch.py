"""``kvopt batch``: one request per JSONL line through the engine, one result per line (vLLM's batch runner).

Each input line is either vLLM's batch format, ``{"custom_id": ..., "method": "POST", "url": "/v1/completions",
"body": {...}}`` with an OpenAI completions or chat body (``url`` and ``method`` optional; when given they must
match the body), or the body alone: ``{"prompt": "..."}`` or ``{"messages": [...]}``. Bodies are checked with the
server's schema (:mod:`kvopt.engine.requests`) and with what the server's settings decide (the served model's name,
a ``session``'s method), so a line is accepted exactly when ``kvopt serve`` with the same options would accept it as
a request; lines default to greedy decoding (``temperature`` 0) and ``--max-tokens``.

Every line and the output are checked before the model loads: the output is opened then, so a path that cannot be
written is refused before any work. A regular file gets each result appended as it finishes, so a kill or a late
failure keeps every finished one, and is rewritten in input order at the end (atomically, in its folder).
Anything else (``/dev/null``, a FIFO, a terminal) gets the results straight, in input order, and is never replaced
by a file. ``--resume`` keeps the results an earlier run left in the output file and runs only the other lines.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional, TextIO

import typer
from pydantic import BaseModel

from kvopt.cli.options import (
    DeviceOption, DtypeOption, EngineSpeculateOption, ItlTargetOption, LongPrefillTokenThresholdOption,
    MaxNumBatchedTokensOption, MaxNumPartialPrefillsOption, ModelOption, SpeculateMaxBatchOption, WeightsOption,
    itl_target,
)
from kvopt.engine.requests import DEFAULT_MODEL_NAME, STRICT
from kvopt.errors import KVOptError

#: The body each endpoint of vLLM's batch format takes (its prompt's field).
ENDPOINTS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


class BatchInputError(KVOptError):
    """A line of the batch file cannot be read as a request (names the line and the fix)."""


class BatchOutputError(KVOptError):
    """The results cannot be written where ``--output`` says (names the problem and where finished results are)."""


@dataclass(frozen=True)
class Serving:
    """What the run serves: beside the schema, the server's settings decide some requests (the model's name, the
    method a ``session`` runs), so a line gets the verdict ``kvopt serve`` with the same options gives."""

    model_name: str = DEFAULT_MODEL_NAME
    kv_method: str = "full"


class Envelope(BaseModel):
    """vLLM's batch line: the request's id, where the request would be sent, and its body."""

    model_config = STRICT
    custom_id: str
    method: Literal["POST"] = "POST"
    url: Literal["/v1/completions", "/v1/chat/completions"] | None = None
    body: dict


@dataclass
class BatchLine:
    """One request of the file: where it is, its id, and its body as the request schema read it."""

    where: str
    custom_id: str
    body: object  # a CompletionRequest or ChatCompletionRequest

    @property
    def messages(self) -> list[dict[str, str]] | None:
        return [m.as_template_input() for m in self.body.messages] if hasattr(self.body, "messages") else None


def read_requests(path: Path, default_max_tokens: int, serving: Serving = Serving()) -> list[BatchLine]:
    """The file's requests, every line checked (schema, what ``serving`` decides, unique ids) before any runs."""
    if not path.is_file():
        raise BatchInputError(f"{path} is not a file; give a JSONL file with one request per line")
    requests, seen, sessions = [], {}, {}
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BatchInputError(f"{where}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1}); "
                                  "save the file as UTF-8") from None  # fmt: skip
        if not line.strip():
            continue
        request = _read_line(line, where, number, default_max_tokens, serving)
        if request.custom_id in seen:
            raise BatchInputError(f"{where}: custom_id {request.custom_id!r} is already used on line "
                                  f"{seen[request.custom_id]}; give each request its own id")  # fmt: skip
        seen[request.custom_id] = number
        session = request.body.session
        if session in sessions:  # the engine refuses a turn while the session answers another (engine/conversations.py)
            raise BatchInputError(f"{where}: session {session!r} has a turn on line {sessions[session]} already, and "
                                  "a batch runs its lines at once while a session answers one turn at a time; send "
                                  "each later turn once the one before finished (in another batch)")  # fmt: skip
        if session is not None:
            sessions[session] = number
        requests.append(request)
    if not requests:
        raise BatchInputError(f"{path} holds no requests; write one JSON object per line")
    return requests


def _read_line(line: str, where: str, number: int, default_max_tokens: int, serving: Serving) -> BatchLine:
    from kvopt.engine.requests import ChatCompletionRequest, CompletionRequest, RequestSchemaError, validated

    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise BatchInputError(f"{where}: not valid JSON ({error.msg}); write one JSON object per line") from None
    if not isinstance(entry, dict):
        raise BatchInputError(f"{where}: expected a JSON object such as {{\"prompt\": \"Hello\"}}")
    if {"custom_id", "body"} & entry.keys() and not isinstance(entry.get("body"), dict):
        raise BatchInputError(f"{where}: \"body\" must be a JSON object such as {{\"prompt\": \"Hello\"}} (vLLM's "
                              "batch format: custom_id, method, url, body)")  # fmt: skip
    try:
        envelope = validated(Envelope, entry, f"{where}: ") if "body" in entry else None
        body = envelope.body if envelope else entry
        if ("prompt" in body) == ("messages" in body):
            raise BatchInputError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" (a chat)")
        field = "prompt" if "prompt" in body else "messages"
        if envelope and envelope.url and ENDPOINTS[envelope.url] != field:
            other = next(url for url, taken in ENDPOINTS.items() if taken == field)
            raise BatchInputError(f"{where}: url {envelope.url} takes a body with \"{ENDPOINTS[envelope.url]}\", and "
                                  f"this one has \"{field}\"; send it to {other}")  # fmt: skip
        schema = CompletionRequest if field == "prompt" else ChatCompletionRequest
        request = validated(schema, {"temperature": 0.0, **body}, f"{where}: ")
        request.sampling_params(request.requested_max_tokens or default_max_tokens)  # n, temperature together
    except RequestSchemaError as error:
        raise BatchInputError(str(error) if str(error).startswith(where) else f"{where}: {error}") from None
    problem = _unserved(request, serving)
    if problem:
        raise BatchInputError(f"{where}: {problem}")
    return BatchLine(where, envelope.custom_id if envelope else f"line-{number}", request)


def _unserved(request, serving: Serving) -> str | None:
    """Why the server with these settings would refuse ``request`` though the schema accepts it (None: it would not)."""
    from kvopt.engine.requests import unserved_model

    problem = unserved_model(request.model, serving.model_name)
    if problem:
        return f"{problem} (--served-model-name)"
    if getattr(request, "documents", None):
        return ("documents need an engine that reuses them by content (`kvopt serve --chunk-caching`), which kvopt "
                "batch does not run; put the documents in the last user message instead")  # fmt: skip
    if request.session is not None:
        from kvopt.engine.conversations import turn_problem

        return turn_problem(request.session, request.kv_method or serving.kv_method, request.n)
    return None


def batch(
    input_file: Annotated[Path, typer.Argument(help="JSONL, one request per line")],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL results, one per request, in input order (a "
                                         "file, or a device or FIFO written straight)")],  # fmt: skip
    model: ModelOption = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="the name lines may give as model (others are "
                                                             "refused, as by the server); default: --model as given")] = None,
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
    weights: WeightsOption = None,
    device: DeviceOption = "auto",
    speculate: EngineSpeculateOption = None,
    speculate_max_batch: SpeculateMaxBatchOption = None,
    max_num_batched_tokens: MaxNumBatchedTokensOption = 4096,
    long_prefill_token_threshold: LongPrefillTokenThresholdOption = None,
    max_num_partial_prefills: MaxNumPartialPrefillsOption = None,
    itl_target_ms: ItlTargetOption = "off",
    ray: Annotated[bool, typer.Option("--ray/--no-ray", help="spread the lines over engine actors on Ray Data "
                                      "(a local Ray cluster, or the one RAY_ADDRESS names; pip install kvopt[cluster])")] = False,
    replicas: Annotated[int, typer.Option(help="with --ray: engine actors, one CPU each")] = 2,
) -> None:
    """Run a JSONL file of requests through the serving engine (continuous batching, prefix caching)."""
    from rich.console import Console

    from kvopt.engine import EngineConfig
    from kvopt.models.device import resolve_device
    from kvopt.models.int8_linear import check_weights

    steps = dict(max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
                 max_num_partial_prefills=max_num_partial_prefills, itl_target_ms=itl_target(itl_target_ms))  # fmt: skip
    EngineConfig(kv_method, block_size, kv_memory, prefix_caching, **steps)  # bad settings fail before the model loads
    check_weights(weights, dtype, resolve_device(device))
    serving = Serving(served_model_name or model or DEFAULT_MODEL_NAME, kv_method)
    requests = read_requests(input_file, max_tokens, serving)
    console = Console(stderr=True)
    with ResultsOutput.open(output, input_file, resume) as sink:
        done = sink.earlier_results({request.custom_id for request in requests}, console) if resume else {}
        todo = [request for request in requests if request.custom_id not in done]
        if done:
            console.print(f"resuming: {len(done)} results already in {output}, {len(todo)} lines to run",
                          highlight=False)  # fmt: skip
        from kvopt.engine import LLM

        engine_args = dict(model=model, kv_method=kv_method, kv_memory=kv_memory, block_size=block_size,
                           enable_prefix_caching=prefix_caching, max_num_seqs=max_num_seqs, dtype=dtype, weights=weights,
                           device=device, speculate=speculate, speculate_max_batch=speculate_max_batch, **steps)  # fmt: skip
        if ray:
            from functools import partial

            from kvopt.cluster.batch import ray_results

            run_lines = partial(_results, default_max_tokens=max_tokens)
            llm, results = None, ray_results(todo, run_lines, engine_args, replicas)
        else:
            llm = LLM(**engine_args)
            results = _results(llm, todo, max_tokens)
        sink.write([request.custom_id for request in requests], done, results)
    console.print(f"wrote {len(requests)} results to {output}", highlight=False)
    console.print(_step_budget_line(steps, llm), highlight=False, soft_wrap=True)
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
        session = request.body.session  # a turn of a conversation, as the server sends it (engine/conversations.py)
        prompts.append(ids if session is None else {"session": session, "prompt": ids})
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


class ResultsOutput:
    """Where the results go. A regular file (or a new one) gets each result appended as it finishes, so a kill keeps
    every finished one, and is rewritten in input order at the end through a temporary file in its folder; anything
    else (a character device such as ``/dev/null``, a FIFO, a terminal) is written straight, in input order, and never
    replaced. Opened before the model loads, so a path that cannot be written costs no work; every write error
    is one line saying where the finished results are."""

    def __init__(self, path: Path, target: Path, handle: TextIO, regular: bool, created: bool) -> None:
        self.path, self.target, self.handle, self.regular, self.created = path, target, handle, regular, created
        #: Bytes of the file an earlier run's results take (kept by --resume), and whether its last one lacks a newline.
        self.kept_bytes, self.open_line = 0, False
        #: Results the output holds (an earlier run's kept ones included).
        self.held = 0

    @classmethod
    def open(cls, path: Path, source: Path, resume: bool) -> ResultsOutput:
        """The output at ``path``, proven writable (opened for appending, its rewrite's temporary file created and
        removed); a :class:`BatchInputError` naming the fix otherwise."""
        if path.exists() and os.path.samefile(path, source):
            raise BatchInputError(f"--output {path} is the input file; write the results to another file")
        if path.is_dir():
            raise BatchInputError(f"--output {path} is a folder; give a file name such as {path / 'results.jsonl'}")
        for parent in path.absolute().parents:
            if parent.exists() and not parent.is_dir():
                raise BatchInputError(f"--output {path}: {parent} is a file, not a folder; choose another output path")
        if not path.parent.exists():
            raise BatchInputError(f"--output {path}: folder {path.parent} does not exist; create it first")
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:  # a new file (or a link to one)
            mode = None
        except OSError as error:
            raise BatchInputError(f"--output {path} cannot be used ({error.strerror}); choose another path") from None
        regular = mode is None or stat.S_ISREG(mode)
        if resume and not regular:
            raise BatchInputError(f"--resume reads the results an earlier run left in --output, and {path} is a "
                                  f"{_kind(mode)}, not a file; give a file, or run without --resume")  # fmt: skip
        target = path.resolve() if regular else path  # a link to a file: the file is rewritten, the link stays
        try:
            handle = target.open("a", encoding="utf-8")  # a FIFO waits here for its reader
        except OSError as error:
            raise BatchInputError(f"--output {path} is not writable ({error.strerror}); choose a path you can write "
                                  "to") from None  # fmt: skip
        output = cls(path, target, handle, regular, created=mode is None)
        if regular:
            try:
                output._temporary().touch()
                output._temporary().unlink()
            except OSError as error:
                output._close(failed=True)
                raise BatchInputError(f"--output {path}: the results are put in input order through a temporary file "
                                      f"in {target.parent}, which cannot be created there ({error.strerror}); choose "
                                      "a folder you can write to") from None  # fmt: skip
        return output

    def __enter__(self) -> ResultsOutput:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self._close(failed=kind is not None)

    def earlier_results(self, ids: set[str], console) -> dict[str, dict]:
        """The results an earlier run left for requests of ``ids``, by custom_id. A last line cut short by a kill is
        dropped (its request runs again); any other line that is no such result is refused, never deleted."""
        try:
            content = self.target.read_bytes()
        except OSError as error:
            raise BatchInputError(f"--resume: {self.path} cannot be read ({error.strerror}); give a file you can read, "
                                  "or run without --resume") from None  # fmt: skip
        lines = content.split(b"\n")
        found, foreign = {}, []
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                result = json.loads(raw)
            except ValueError:
                if number == len(lines):  # no newline after it: the write a kill cut short
                    console.print(f"resuming: dropping the last line of {self.path}, cut short", highlight=False)
                    content = content[: -len(raw)]
                    continue
                result = None
            if isinstance(result, dict) and isinstance(result.get("custom_id"), str) and result["custom_id"] in ids \
                    and {"error", "response"} <= result.keys():  # fmt: skip
                found[result["custom_id"]] = result
            else:
                foreign.append(number)
        if foreign:
            shown = ", ".join(map(str, foreign[:5])) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            lines_hold = "line {} holds" if len(foreign) == 1 else "lines {} hold"
            raise BatchInputError(f"--resume: {self.path} {lines_hold.format(shown)} no result of this input (another "
                                  "custom_id, or not a result line), and resuming would delete them; give another "
                                  "--output, or remove those lines")  # fmt: skip
        self.kept_bytes, self.open_line = len(content), not content.endswith(b"\n") and bool(content)
        return found

    def write(self, order: list[str], kept: dict[str, dict], results: Iterable[tuple[str, dict]]) -> None:
        """Write ``kept`` and every result, and leave them in ``order`` (custom_ids). The file's earlier contents go
        only now (once the engine runs), but for the ``kept`` results."""
        finished, self.held = dict(kept), len(kept)
        if self.regular:
            self._guard(self.handle.truncate, self.kept_bytes)
            if self.open_line:
                self._put("\n")
        for custom_id, line in results if self.regular else _in_order(order, results):
            self._put(json.dumps(line) + "\n")
            self.held += 1
            finished[custom_id] = line
        self._guard(self.handle.close)
        if self.regular:
            self._rewrite([finished[custom_id] for custom_id in order])

    def _put(self, text: str) -> None:
        self._guard(self.handle.write, text)
        self._guard(self.handle.flush)  # a kill keeps every finished result

    def _guard(self, call, *args) -> None:
        """``call(*args)``; a write error is one line saying what was written (a file keeps it for ``--resume``)."""
        try:
            call(*args)
        except OSError as error:
            if self.regular:
                where = f"the {self.held} results written before are kept there: fix that, then rerun with --resume"
            else:
                where = f"{self.held} results were written before: give another --output"
            raise BatchOutputError(f"could not write to {self.path} ({error.strerror or error}); {where}") from None

    def _rewrite(self, results: list[dict]) -> None:
        """Replace the file with ``results`` atomically: a kill or a failure leaves the old file (every result, in
        the order they finished) or the new."""
        temporary = self._temporary()
        try:
            with temporary.open("w", encoding="utf-8") as sink:
                sink.writelines(json.dumps(result) + "\n" for result in results)
            os.replace(temporary, self.target)
        except OSError as error:
            with suppress(OSError):
                temporary.unlink()
            raise BatchOutputError(f"could not put {self.path} in input order ({error.strerror or error}); all "
                                   f"{len(results)} results are there, in the order they finished") from None

    def _temporary(self) -> Path:
        return self.target.with_name(f".{self.target.name}.{os.getpid()}.tmp")

    def _close(self, failed: bool) -> None:
        """Close the output after a failure: a file this run created and wrote nothing to goes (its error was
        reported already, so closing does not report another)."""
        with suppress(OSError):
            self.handle.close()
        if failed and self.created and not self.held:
            with suppress(OSError):
                self.target.unlink()


def _in_order(order: list[str], results: Iterable[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    """``results`` in ``order`` (their custom_ids), each as soon as those before it arrived."""
    waiting, position = {}, 0
    for custom_id, line in results:
        waiting[custom_id] = line
        while position < len(order) and order[position] in waiting:
            yield order[position], waiting.pop(order[position])
            position += 1


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):  # fmt: skip
        if test(mode):
            return name
    return "special file"


def _step_budget_line(steps: dict, llm) -> str:
    """The step budget the run used: its token bounds and latency target (``auto``: as measured at start-up)."""
    bounds = [f"at most {steps['max_num_batched_tokens']} tokens a step"]
    if steps["long_prefill_token_threshold"] is not None:
        bounds.append(f"prompt chunks of at most {steps['long_prefill_token_threshold']}")
    if steps["max_num_partial_prefills"] is not None:
        bounds.append(f"at most {steps['max_num_partial_prefills']} prompts part-way through")
    target = steps["itl_target_ms"]
    if target is None:
        bounds.append("no latency target")
    else:
        clock = llm.engine.scheduler.clock if llm is not None else None  # with --ray: each actor measured its own
        measured = f"{clock.target * 1000:.0f} ms" if clock is not None and clock.target else "set per actor"
        auto = " (auto: at least this, 3x the decoding batch's step)" if target == "auto" else ""
        bounds.append(f"latency target {measured}{auto}")
    return "step budget: " + ", ".join(bounds)


def _print_metrics(console, snapshot: dict) -> None:
    from rich.table import Table

    table = Table("metric", "value", title="engine metrics")
    for name, value in snapshot.items():
        if isinstance(value, dict) and "p50" in value:
            unit = " s" if name.endswith("_seconds") else ""
            shown = ("–" if value["p50"] is None
                     else f"p50 {value['p50']:.3f}{unit}, p99 {value['p99']:.3f}{unit} (n={value['count']})")  # fmt: skip
        elif isinstance(value, float):
            shown = f"{value:.4g}"
        else:
            shown = str(value)
        table.add_row(name, shown)
    console.print(table)
