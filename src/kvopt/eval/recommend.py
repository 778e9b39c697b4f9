"""``kvopt recommend``: the specs that fit a KV memory budget, ranked by measured quality, as data.

* **Memory**: the exact calculator (:func:`kvopt.memory.estimate`, what ``kvopt memory --method`` prints) for
  every spec at ``context`` tokens x ``batch`` sequences; a spec fits when its bytes are at most ``memory``.
* **Quality**: the committed accuracy rows (``benchmarks/results/**/eval.jsonl``), query-agnostic (the cache
  is compressed before the question, as a reused prefix or a session is), each spec paired with ``full`` on the
  same prompts: the share of full's answers it keeps, with its 95% Wilson interval
  (:func:`kvopt.eval.report.retention`), over the measured lengths up to ``context`` (the shortest measured
  when all are longer). The user's model's rows when it has some, else those of the nearest measured model
  (the same model type, the closest size), said so.
* **Speed**: the median decode tok/s of the same rows, beside full's (measured on the rows' machine).
* **Own prompts** (``prompts=``): ``full`` and the ``top`` best fitting candidates answer each prompt greedily
  (the evaluation's decoding loop); the answers are stored as they come (``<prompts>.recommend.jsonl``), so a
  stopped run resumes, and the candidates are ranked by agreement with full's answers (the share of prompts
  answered token for token as full does, with its interval; the mean shared prefix breaks ties).

The ranking is by quality, then fewer bytes; the spec to use is the first whose measured share (the point
estimate: the interval stands beside it, and with the ~20 answers a cell holds no lower bound reaches 95%) is at
least ``quality``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvopt.errors import KVOptError
from kvopt.eval.report import Retention, retention, wilson_interval
from kvopt.eval.rows import EVAL_ROW_KEYS, Row, load_rows
from kvopt.memory import estimate, human_bytes
from kvopt.methods import canonical_spec, parse
from kvopt.paths import writable_file

#: The committed benchmark rows of a source checkout (``src/kvopt/eval`` -> the repository root).
RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
#: The label eval rows carry for the embedded default model (``kvopt eval`` without ``--model``).
DEFAULT_LABEL = "SmolLM2-135M-Instruct"
MODE = "query_agnostic"
#: How ``prompts=`` answers are stored: beside the prompts file.
ANSWERS_SUFFIX = ".recommend.jsonl"

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Agreement:
    """A spec's answers to the user's prompts next to full's: same tokens, and the share of full's tokens shared
    as a prefix."""

    prompts: int
    same: int
    prefix: float

    @property
    def share(self) -> float:
        return self.same / self.prompts

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.same, self.prompts)

    def cell(self) -> str:
        low, high = self.interval
        return f"{self.share:.0%} [{low * 100:.0f}–{high * 100:.0f}] of {self.prompts} prompts"


@dataclass(frozen=True)
class Candidate:
    """One spec that fits: its bytes, the evidence of its quality and its measured decode speed."""

    spec: str
    kv_bytes: int
    #: Share of full's answers kept on the cited rows (None for ``full``, the reference itself).
    kept: Retention | None
    decode_tok_s: float | None
    full_decode_tok_s: float | None
    agreement: Agreement | None = None

    @property
    def quality(self) -> float:
        """What the ranking uses: agreement on the user's prompts when run there, else the share kept."""
        if self.agreement is not None:
            return self.agreement.share
        return 1.0 if self.kept is None else self.kept.kept

    def evidence(self) -> str:
        if self.agreement is not None:
            return f"{self.agreement.cell()} answered as full"
        return "the reference" if self.kept is None else f"{self.kept.cell()} full answers kept"

    def speed(self) -> str:
        if self.decode_tok_s is None:
            return "not measured"
        relative = f" ({self.decode_tok_s / self.full_decode_tok_s:.2f}x full)" if self.full_decode_tok_s else ""
        return f"{self.decode_tok_s:.1f} tok/s{relative}"


@dataclass(frozen=True)
class Recommendation:
    """The answer of :func:`recommend`: fitting candidates best first, the evidence's source, and the choice."""

    model: str
    memory: int
    context: int
    batch: int
    quality: float | None
    dtype: str
    #: The model whose committed rows rank the candidates (``model`` itself, or the nearest measured one).
    measured_on: str
    #: Why the rows are another model's (None when they are the model's own).
    nearest: str | None
    #: Which rows: files, tasks and lengths.
    rows: str
    candidates: tuple[Candidate, ...]
    prompts: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def choice(self) -> Candidate | None:
        """The best-ranked candidate keeping at least ``quality`` (the best one when no floor is given). With the
        user's prompts run, only the candidates checked on them: one the prompts never saw is not chosen over
        those they found short of the floor on its grid share alone."""
        floor = self.quality or 0.0
        checked = [c for c in self.candidates if c.agreement is not None]
        return next((c for c in checked or self.candidates if c.quality >= floor - 1e-12), None)

    def serve_command(self) -> str | None:
        """The exact ``kvopt serve`` line for :attr:`choice`, or None when nothing meets the floor."""
        if self.choice is None:
            return None
        model = "" if self.model == DEFAULT_LABEL else f" --model {shlex.quote(self.model)}"
        return (f"kvopt serve{model} --kv-method {shlex.quote(self.choice.spec)} --kv-memory {self.memory} "
                f"--max-model-len {self.context} --max-num-seqs {self.batch}")  # fmt: skip


# --------------------------------------------------------------------------- the committed rows


@functools.lru_cache(maxsize=1024)
def canonical(spec: str) -> str | None:
    """The spec as kvopt writes it (``kivi`` and ``kivi:bits=4`` are one), or None for a peer's (kvpress, quanto)
    or a stored-cache contender."""
    try:
        return canonical_spec(spec)
    except KVOptError:
        return None


def measured_rows(results: Path) -> dict[str, list[Row]]:
    """Scored query-agnostic rows of kvopt specs per model label (lower case), method canonicalised."""
    by_model: dict[str, list[Row]] = {}
    for path in sorted(results.rglob("eval.jsonl")):
        for row in load_rows(path, EVAL_ROW_KEYS):
            spec = canonical(str(row["method"])) if row.get("family", "kvopt") == "kvopt" else None
            if spec is None or row.get("score") is None or row.get("mode") != MODE:
                continue
            label = str(row.get("model") or DEFAULT_LABEL)
            by_model.setdefault(label.lower(), []).append({**row, "method": spec, "source": path.relative_to(results)})
    return by_model


def _label(model: str | None) -> str:
    from kvopt.models.loading import DEFAULT_NAMES

    if model is None or model.lower() in DEFAULT_NAMES:
        return DEFAULT_LABEL
    return model


def _config(model: str | None):
    from kvopt.models.loading import load_config, resolve_model_dir

    return load_config(resolve_model_dir(model))


def _size(config) -> float:
    """A proxy of the parameter count: layers x hidden size squared."""
    return config.num_hidden_layers * config.hidden_size**2


def nearest_measured(config, labels: list[str]) -> tuple[str, bool] | None:
    """The measured label closest to ``config`` in size, and whether it shares the model type (None: none resolves)."""
    found = []
    for label in labels:
        try:
            other = _config(label)
        except KVOptError:
            continue  # a measured model not installed here: its shape is unknown
        same_type = other.model_type == config.model_type
        found.append((not same_type, abs(math.log(_size(other) / _size(config))), label, same_type))
    if not found:
        return None
    _, _, label, same_type = min(found)
    return label, same_type


def _within_context(rows: list[Row], context: int) -> list[Row]:
    """Rows at the measured lengths up to ``context`` (the shortest measured length when all are longer)."""
    lengths = {int(row["length"]) for row in rows}
    usable = {n for n in lengths if n <= context} or {min(lengths)}
    return [row for row in rows if int(row["length"]) in usable]


def _describe(rows: list[Row], label: str) -> str:
    tasks = sorted({str(row["task"]) for row in rows})
    lengths = sorted({int(row["length"]) for row in rows})
    files = sorted({str(row["source"]) for row in rows})
    return (f"{label}: query-agnostic rows of {', '.join(tasks)} at {', '.join(map(str, lengths))} tokens "
            f"({', '.join(files)})")  # fmt: skip


def _median_speed(rows: list[Row]) -> float | None:
    speeds = [float(r["decode_tok_s"]) for r in rows if r.get("decode_tok_s") is not None and not math.isnan(r["decode_tok_s"])]
    return statistics.median(speeds) if speeds else None


# --------------------------------------------------------------------------- recommend


def recommend(
    memory: str | int,
    context: int,
    model: str | None = None,
    quality: float | None = None,
    batch: int = 1,
    prompts: str | Path | None = None,
    *,
    dtype: str = "float16",
    results: str | Path | None = None,
    top: int = 3,
    max_tokens: int = 32,
    device: str = "auto",
    progress: Progress | None = None,
) -> Recommendation:
    """The specs whose KV for ``batch`` sequences of ``context`` tokens fits ``memory``, best first.

    ``memory``: bytes or a size (``"1GB"``, ``"512MiB"``); ``model``: as ``kvopt.load_model`` takes it (None for
    the default); ``quality``: the share of full's answers the chosen spec must keep, in (0, 1]; ``dtype``: the
    KV's element type (``kvopt memory``'s default, float16); ``results``: the folder of committed rows (default:
    this checkout's ``benchmarks/results``); ``prompts``: a JSONL file of ``{"prompt": ...}`` or
    ``{"messages": [...]}`` lines to rank ``full`` and the ``top`` best candidates on (``max_tokens`` greedy tokens
    each, on ``device``); ``progress(done, total, spec)`` is called after each answer.
    Bad input raises :class:`~kvopt.errors.KVOptError` with one line naming the problem and the fix.
    """
    import torch

    from kvopt.engine.config import parse_memory
    from kvopt.models.info import ModelInfo, parse_dtype

    if quality is not None and not 0.0 < quality <= 1.0:
        raise KVOptError(f"--quality {quality} is outside (0, 1]; give the share of full's answers to keep, e.g. 0.95")
    if batch < 1 or context < 1:
        raise KVOptError(f"--context {context} and --batch {batch} must be at least 1")
    budget = parse_memory(memory, torch.device("cpu"), "--memory")
    config = _config(model)
    info = ModelInfo.from_config(config, dtype=parse_dtype(dtype))
    label = _label(model)
    if info.max_positions is not None and context > info.max_positions:
        raise KVOptError(f"--context {context} is beyond {label}'s {info.max_positions} positions; "
                         f"give at most {info.max_positions}")  # fmt: skip
    folder = Path(results) if results is not None else RESULTS
    if not folder.is_dir():
        raise KVOptError(f"no committed benchmark rows at {folder}; pass --results FOLDER (a results folder with eval.jsonl)")
    questions = read_prompts(Path(prompts)) if prompts is not None else None
    by_model = measured_rows(folder)
    measured_on, nearest = _source(label, config, by_model, questions is not None)
    rows = _within_context(by_model[measured_on.lower()], context)
    candidates, notes = _fitting(rows, info, context, batch)
    if not any(c.kv_bytes <= budget for c in candidates):
        smallest = min(candidates, key=lambda c: c.kv_bytes)
        raise KVOptError(
            f"--memory {human_bytes(budget)} fits no spec at {context} tokens x batch {batch}: the smallest, "
            f"{smallest.spec}, needs {human_bytes(smallest.kv_bytes)} ({smallest.kv_bytes:,} bytes); give at least "
            "that, or a smaller --context or --batch"
        )
    fitting = sorted((c for c in candidates if c.kv_bytes <= budget), key=lambda c: (-c.quality, c.kv_bytes, c.spec))
    if questions is not None:
        fitting = run_prompts(questions, fitting, model, label, Path(prompts), top, max_tokens, device, progress)
        fitting = sorted(fitting, key=_agreement_rank)
    return Recommendation(
        label, budget, context, batch, quality, dtype, measured_on, nearest, _describe(rows, measured_on),
        tuple(fitting), str(prompts) if prompts is not None else None, tuple(notes),
    )  # fmt: skip


def _source(label: str, config, by_model: dict[str, list[Row]], has_prompts: bool) -> tuple[str, str | None]:
    """The label whose rows rank the candidates, and why it is not ``label`` (None when it is)."""
    if label.lower() in by_model:
        return label, None
    labels = sorted({str(rows[0].get("model") or DEFAULT_LABEL) for rows in by_model.values()})
    found = nearest_measured(config, labels)
    if found is not None and (found[1] or has_prompts):
        other, same_type = found
        kind = f"the nearest measured {config.model_type} model" if same_type else "the closest measured model in size"
        return other, f"{label} has no measured rows; ranked on {kind}, {other}"
    raise KVOptError(
        f"{label} has no measured rows, nor does a measured model of its type ({config.model_type}; measured: "
        f"{', '.join(labels) or 'none'}); rank the specs on your own prompts with --prompts my.jsonl"
    )


def _fitting(rows: list[Row], info, context: int, batch: int) -> tuple[list[Candidate], list[str]]:
    """Every spec with rows (and ``full``), its bytes from the calculator, its share kept and its speed."""
    by_spec: dict[str, list[Row]] = {}
    for row in rows:
        by_spec.setdefault(row["method"], []).append(row)
    reference = by_spec.get("full", [])
    full_speed = _median_speed(reference)
    candidates, notes = [], []
    for spec in sorted(set(by_spec) | {"full"}):
        try:
            kv_bytes = estimate(info, context, batch, parse(spec)).total_bytes
        except KVOptError as error:
            notes.append(f"{spec} does not run on this model: {error}")
            continue
        kept = None if spec == "full" else retention(by_spec[spec], reference)
        if spec != "full" and kept is None:
            continue  # no prompt paired with one of full's answers: no evidence either way
        candidates.append(Candidate(spec, kv_bytes, kept, _median_speed(by_spec.get(spec, [])), full_speed))
    return candidates, notes


def _agreement_rank(candidate: Candidate) -> tuple:
    """Run candidates by agreement (then shared prefix, then bytes); the ones not run after them, by their rows."""
    agreement = candidate.agreement
    if agreement is None:
        return (1, -candidate.quality, candidate.kv_bytes, candidate.spec)
    return (0, -agreement.share, -agreement.prefix, candidate.kv_bytes, candidate.spec)


# --------------------------------------------------------------------------- the user's prompts


def read_prompts(path: Path) -> list[dict]:
    """The file's prompts (``{"prompt": text}`` or ``{"messages": [...]}``), every line checked before any runs:
    one error naming every bad line."""
    from kvopt.engine.requests import check_messages, check_prompt

    if not path.is_file():
        raise KVOptError(f"--prompts {path} is not a file; give a JSONL file with one {{\"prompt\": ...}} per line")
    entries, bad = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
                raise KVOptError("not one of prompt or messages")
            if "prompt" in entry:
                check_prompt(entry["prompt"])
            else:
                check_messages(entry["messages"])
        except (ValueError, KVOptError):
            bad.append(number)
            continue
        entries.append({"line": number, **{k: entry[k] for k in ("prompt", "messages") if k in entry}})
    if bad:
        shown = ", ".join(map(str, bad[:20])) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise KVOptError(f"--prompts {path}: line{'s' if len(bad) > 1 else ''} {shown} not a JSON object with one of "
                         "\"prompt\" (text) or \"messages\" (a chat); fix them (nothing was run)")  # fmt: skip
    if not entries:
        raise KVOptError(f"--prompts {path} holds no prompts; write one {{\"prompt\": ...}} per line")
    return entries


def _prompt_ids(entry: dict, tokenizer) -> list[int]:
    if "prompt" in entry:
        prompt = entry["prompt"]
        return list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    return list(tokenizer.apply_chat_template(entry["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def _key(entry: dict) -> str:
    """A prompt's identity in the answers file: its content, wherever its line moves."""
    content = {k: v for k, v in entry.items() if k != "line"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def run_prompts(
    prompts: list[dict], ranked: list[Candidate], model: str | None, label: str, path: Path, top: int,
    max_tokens: int, device: str, progress: Progress | None,
) -> list[Candidate]:  # fmt: skip
    """``ranked`` with the agreement of ``full`` and the ``top`` best others on ``prompts`` filled in (answers stored
    in ``<path>.recommend.jsonl`` and read back on a rerun). ``full`` answers as the reference whether or not it
    fits the memory (it is then not among ``ranked``)."""
    from kvopt.api import load_model
    from kvopt.eval.contenders import parse_contender
    from kvopt.eval.decoding import QUERY_AWARE, run_prompt, stop_token_ids

    specs = ["full", *[c.spec for c in ranked if c.spec != "full"][:top]]
    store = writable_file(path.with_name(path.name.removesuffix(".jsonl") + ANSWERS_SUFFIX), "--prompts")
    settings = {"model": label, "max_tokens": max_tokens}
    answers = {
        (row["spec"], row["prompt"]): row["tokens"]
        for row in load_rows(store) if all(row.get(k) == v for k, v in settings.items())
    }  # fmt: skip
    missing = [(spec, entry) for spec in specs for entry in prompts if (spec, _key(entry)) not in answers]
    total, done = len(specs) * len(prompts), len(specs) * len(prompts) - len(missing)
    if missing:
        loaded, tokenizer = load_model(model, device=device)
        ids = {_key(entry): _prompt_ids(entry, tokenizer) for entry in prompts}
        limit = (loaded.config.max_position_embeddings or math.inf) - max_tokens
        long = [entry["line"] for entry in prompts if len(ids[_key(entry)]) > limit]
        if long:
            raise KVOptError(f"--prompts {path}: line{'s' if len(long) > 1 else ''} {', '.join(map(str, long))} too long "
                             f"for {label}'s context with {max_tokens} answer tokens; shorten them (nothing was run)")  # fmt: skip
        stops = stop_token_ids(tokenizer, loaded)
    with store.open("a", encoding="utf-8") as sink:
        for spec, entry in missing:
            outcome = run_prompt(loaded, parse_contender(spec), ids[_key(entry)], [], max_tokens, QUERY_AWARE, stops, tokenizer)
            answers[(spec, _key(entry))] = outcome.token_ids
            sink.write(json.dumps({**settings, "spec": spec, "prompt": _key(entry), "line": entry["line"],
                                   "tokens": outcome.token_ids}) + "\n")  # fmt: skip
            sink.flush()
            done += 1
            if progress is not None:
                progress(done, total, spec)
    reference = [answers[("full", _key(p))] for p in prompts]
    agreed = {spec: _agreement([answers[(spec, _key(p))] for p in prompts], reference) for spec in specs}
    return [replace(c, agreement=agreed.get(c.spec)) for c in ranked]


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> Agreement:
    same = sum(mine == theirs for mine, theirs in zip(tokens, reference))
    shared = []
    for mine, theirs in zip(tokens, reference):
        prefix = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        shared.append(prefix / len(theirs) if theirs else float(not mine))
    return Agreement(len(reference), same, sum(shared) / len(shared))
