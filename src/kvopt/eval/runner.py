"""The evaluation grid: tasks x lengths x depths x samples x modes x contenders -> JSONL rows.

Every finished row is appended to ``<out>/eval.jsonl`` at once, so an interrupted run loses
at most one prompt and a re-run skips what is already there (resumable). Peers that are not
installed are skipped with the command that installs them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvopt.errors import ContextTooLongError, KVOptError
from kvopt.eval.contenders import Contender, parse_contender
from kvopt.eval.decoding import MODES, QUERY_AGNOSTIC, prefill_prompt, run_prompt, shared_prefill, stop_token_ids
from kvopt.eval.rows import EVAL_ROW_KEYS, load_rows
from kvopt.paths import writable_file

PPL_TASK = "ppl"
RESULTS_FILE = "eval.jsonl"


@dataclass
class EvalGrid:
    tasks: list[str]
    lengths: list[int]
    methods: list[str]
    depths: int = 3
    samples: int = 1
    modes: list[str] = field(default_factory=lambda: [QUERY_AGNOSTIC])
    seed: int = 0
    chat: bool = True
    ppl_tokens: int = 4096
    ppl_chunk: int = 1
    ppl_first: int = 2000
    #: kvopt contenders replay one lossless prefill per prompt instead of each running its own
    #: (identical results: methods act after attention; see KVCache.replay_prefill).
    share_prefill: bool = True

    def validate(self, max_positions: int | None) -> None:
        from kvopt.eval.tasks import TASKS

        unknown = [t for t in self.tasks if t != PPL_TASK and t not in TASKS]
        if unknown:
            raise KVOptError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join([*TASKS, PPL_TASK])}")
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes:
            raise KVOptError(f"unknown mode(s) {', '.join(bad_modes)}; choose from {', '.join(MODES)}")
        if self.depths < 1 or self.samples < 1:
            raise KVOptError("--depths and --samples must be at least 1")
        for option, values, example in (("--task", self.tasks, "passkey"), ("--methods", self.methods, "full"),
                                        ("--mode", self.modes, QUERY_AGNOSTIC)):  # fmt: skip
            if not values:
                raise KVOptError(f"{option} is empty: nothing would run; give at least one, e.g. {option} {example}")
        if any(t != PPL_TASK for t in self.tasks) and not self.lengths:
            raise KVOptError("--lengths is empty; give prompt lengths in tokens, e.g. --lengths 1024,2048")
        if any(length < 1 for length in self.lengths):
            lengths = ",".join(map(str, self.lengths))
            raise KVOptError(
                f"--lengths {lengths}: prompt lengths must be positive token counts; use e.g. --lengths 1024,2048"
            )
        if self.ppl_tokens < 2 or self.ppl_chunk < 1:
            raise KVOptError(
                f"--ppl-tokens={self.ppl_tokens} and --ppl-chunk={self.ppl_chunk} must be at least 2 and 1 "
                "(perplexity scores each token from the ones before it)"
            )
        longest = max([*self.lengths, self.ppl_tokens if PPL_TASK in self.tasks else 0])
        if max_positions is not None and longest > max_positions:
            raise ContextTooLongError(
                f"length {longest} exceeds the model's maximum of {max_positions} positions; choose shorter --lengths"
            )


def depth_values(count: int) -> list[float]:
    """``count`` needle depths at the centres of equal slices of the context (1 -> 0.5; 5 -> 0.1 ... 0.9).

    Centres avoid the degenerate extremes (a needle in the very last tokens survives any
    recency-based policy; one in the first tokens survives any sink-keeping policy).
    """
    return [round((i + 0.5) / count, 4) for i in range(count)]


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("task", "length", "depth", "sample", "mode", "method", "seed", "model"))


def load_done(path: Path) -> set[tuple]:
    """Keys of the rows already in ``path`` (a row without its identifying fields is an error, not a skip)."""
    return {row_key(row) for row in load_rows(path, EVAL_ROW_KEYS)}


def run_eval(
    grid: EvalGrid,
    out_dir: Path,
    model_name: str | None = None,
    loaded: tuple | None = None,
    progress: bool = True,
    device: str | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run the grid and append rows to ``out_dir/eval.jsonl``; returns that path."""
    from kvopt.api import load_model
    from kvopt.eval.tasks import TASKS, build_sample, format_prompt, score
    from kvopt.models.info import ModelInfo

    contenders = [parse_contender(spec) for spec in grid.methods]
    grid.validate(None)  # user mistakes fail before the model loads
    path = writable_file(Path(out_dir) / RESULTS_FILE, "--out")
    done = load_done(path)
    model, tokenizer = loaded or load_model(model_name, device=device)
    label = model_name or "SmolLM2-135M-Instruct"
    grid.validate(ModelInfo.from_config(model.config).max_positions)
    runnable = []
    for contender in contenders:
        reason = contender.missing()
        if reason:
            log(f"skipping {reason}")
        else:
            runnable.append(contender)

    jobs = [job for job in _jobs(grid, runnable, label, TASKS) if row_key(job["row"]) not in done]
    stop_ids = stop_token_ids(tokenizer, model)
    samples: dict[tuple, tuple] = {}
    shared, shared_for = None, None

    with path.open("a") as sink, _progress(progress, len(jobs)) as advance:
        for job in jobs:
            row, contender = job["row"], job["contender"]
            started = time.perf_counter()
            if row["task"] == PPL_TASK:
                row.update(_perplexity_row(model, tokenizer, contender, grid))
            else:
                key = (row["task"], row["length"], row["depth"], row["sample"])
                if key not in samples:
                    sample = build_sample(
                        row["task"], tokenizer, row["length"], row["depth"], row["sample"], grid.seed, grid.chat
                    )
                    samples[key] = (sample, format_prompt(tokenizer, sample, grid.chat))
                sample, (context_ids, question_ids) = samples[key]
                replay = grid.share_prefill and contender.replays
                if replay and shared_for != (key, row["mode"]):
                    shared = None  # free the previous prompt's recording first
                    shared = shared_prefill(model, prefill_prompt(context_ids, question_ids, row["mode"]))
                    shared_for = (key, row["mode"])
                outcome = run_prompt(
                    model, contender, context_ids, question_ids, sample.max_new_tokens, row["mode"], stop_ids,
                    tokenizer, shared if replay else None,
                )  # fmt: skip
                prediction = tokenizer.decode(outcome.token_ids, skip_special_tokens=True)
                row.update(
                    score=score(sample, prediction),
                    prediction=prediction,
                    answers=list(sample.answers),
                    prompt_tokens=len(context_ids) + len(question_ids),
                    kv_bytes_peak=outcome.kv_bytes_peak,
                    kv_bytes_full=outcome.kv_bytes_full,
                    compression=round(outcome.compression, 4),
                    prefill_s=round(outcome.prefill_s, 4),
                    decode_tok_s=round(outcome.decode_tok_s, 3),
                    text_source=sample.metadata.get("text_source"),
                    prefill_shared=replay,
                )
            row["wall_s"] = round(time.perf_counter() - started, 3)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            advance(f"{row['task']} {row['length']} {row['method']}")
    return path


def _jobs(grid: EvalGrid, contenders: list[Contender], label: str, tasks: dict):
    """Perplexity first, then prompts sample by sample: every (task, length, depth) gets its sample 0 before
    any gets its sample 1, so a grid stopped part-way (hours on a CPU) leaves every cell with nearly the
    same number of samples, each prompt's contenders side by side (one shared prefill)."""
    for contender in contenders if PPL_TASK in grid.tasks else []:
        if contender.family != "kvpress":  # presses act at prefill only
            yield {"row": _row(PPL_TASK, grid.ppl_tokens, None, 0, "streaming", contender, grid, label), "contender": contender}
    cells = [
        (task, length, depth)
        for task in grid.tasks
        if task != PPL_TASK
        for length in grid.lengths
        for depth in (depth_values(grid.depths) if tasks[task].uses_depth else [None])
    ]
    for index in range(grid.samples):
        for task, length, depth in cells:
            for mode in grid.modes:
                for contender in contenders:
                    yield {"row": _row(task, length, depth, index, mode, contender, grid, label), "contender": contender}


def _row(task, length, depth, index, mode, contender: Contender, grid: EvalGrid, label: str) -> dict:
    return {
        "task": task,
        "length": length,
        "depth": depth,
        "sample": index,
        "seed": grid.seed,
        "mode": mode,
        "method": contender.spec,
        "method_name": contender.method_name,
        "family": contender.family,
        "ratio": contender.ratio,
        "model": label,
    }


def _perplexity_row(model, tokenizer, contender: Contender, grid: EvalGrid) -> dict:
    from kvopt.eval.perplexity import streaming_perplexity
    from kvopt.local_text import real_text
    from kvopt.memory import estimate
    from kvopt.models.info import ModelInfo

    text, source = real_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: grid.ppl_tokens]
    outcome = streaming_perplexity(model, contender, ids, chunk=grid.ppl_chunk, first=grid.ppl_first)
    full = estimate(ModelInfo.from_config(model.config), len(ids), dtype=model.dtype).total_bytes
    return {
        "score": None,
        "ppl": round(outcome.ppl, 4),
        "tokens": outcome.tokens,
        "ppl_first": round(outcome.ppl_first, 4),
        "first_tokens": outcome.first_tokens,
        "kv_bytes_peak": outcome.kv_bytes_peak,
        "kv_bytes_end": outcome.kv_bytes_end,
        "kv_bytes_full": full,
        "compression": round(1 - outcome.kv_bytes_end / full, 4),
        "chunk": grid.ppl_chunk,
        "text_source": source,
        "prefill_s": None,
        "decode_tok_s": round(outcome.tokens / outcome.seconds, 3),
    }


class _progress:
    """A rich progress bar with ETA (or nothing when disabled)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda description: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(),
        )  # fmt: skip
        self.bar.__enter__()
        task = self.bar.add_task("eval", total=self.total)
        return lambda description: self.bar.update(task, advance=1, description=description)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)
