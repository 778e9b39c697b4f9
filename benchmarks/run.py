"""Regenerate BENCHMARKS.md: kvopt next to its peers on the default model, in one run.

    make bench                      # installs the peers (kvpress, optimum-quanto), then runs this
    python benchmarks/run.py        # the same, in an environment that already has them

Steps: load time (cold conversion vs warm), speed/memory bench (median of repeats, ratios to
plain HF generation), the accuracy grid (resumable: results/benchmarks/eval.jsonl is reused),
streaming perplexity, then the report with plots into benchmarks/report/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from kvopt.eval.bench import run_bench
from kvopt.eval.contenders import split_specs
from kvopt.eval.report import write_report
from kvopt.eval.decoding import QUERY_AGNOSTIC, QUERY_AWARE
from kvopt.eval.runner import EvalGrid, run_eval
from kvopt.models import load_model

ROOT = Path(__file__).resolve().parent.parent
PRESSES = ["snapkv", "pyramidkv", "adakv-snapkv", "tova", "streamingllm"]
RATIOS = [0.5, 0.75, 0.9]
OURS = ["window", "streamingllm", "snapkv", "pyramidkv", "adakv", "tova", "kvzip"]
#: Decode speed at 4k context, each method at 75% removed, next to `full` and plain HF.
SPEED_METHODS = ["full", *(f"{m}:ratio=0.75" for m in OURS if m != "window"), "window:size=1024"]


def agnostic_methods() -> list[str]:
    ours = ["full", *(f"{method}:ratio={r}" for method in OURS for r in RATIOS)]
    peers = [f"kvpress:{press}:ratio={r}" for press in PRESSES for r in RATIOS]
    return ours + peers


def aware_methods() -> list[str]:
    """Query-aware: every method but kvzip, whose reconstruction pass targets the query-agnostic case."""
    return [spec for spec in agnostic_methods() if not spec.startswith("kvzip")]


def load_times() -> tuple[float, float]:
    """Cold (GGUF conversion into an empty cache dir) and warm load of the default model, fresh processes."""
    code = "import time,kvopt; t=time.perf_counter(); kvopt.load_model(); print(time.perf_counter()-t)"
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ, KVOPT_CACHE=empty)
        run = lambda: float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)  # noqa: E731
        return run(), run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "results" / "benchmarks")
    parser.add_argument("--bench-lengths", default="512,2048")
    parser.add_argument("--bench-methods", default="full,window:size=512")
    parser.add_argument("--speed-length", type=int, default=4096)
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--tasks", default="passkey,niah,niah_multikey")
    parser.add_argument("--depths", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--aware-samples", type=int, default=1)
    parser.add_argument("--ppl-tokens", type=int, default=8000)
    parser.add_argument("--ppl-chunk", type=int, default=32)
    parser.add_argument("--ppl-methods", default="full,window:size=1024,streamingllm:sinks=4,window=1020")
    parser.add_argument(
        "--steps", default="load,agnostic,ppl,bench,speed,aware",
        help="comma-separated subset of load,agnostic,ppl,bench,speed,aware",
    )  # fmt: skip
    args = parser.parse_args()
    steps = set(args.steps.split(","))

    loaded = load_model()
    timings = load_timings(args.results)
    if "load" in steps:
        timings["load cold s"], timings["load warm s"] = load_times()
    if "bench" in steps:  # lossless speed and bytes vs plain HF at short and medium lengths
        start = time.perf_counter()
        run_bench(
            _ints(args.bench_lengths), args.bench_methods.split(","), args.results, args.new_tokens, args.repeats,
            loaded=loaded,
        )  # fmt: skip
        timings["bench"] = time.perf_counter() - start
    if "speed" in steps:  # every method's decode speed at long context, same run as full and HF
        start = time.perf_counter()
        run_bench(
            [args.speed_length], split_specs(args.speed_methods), args.results, args.new_tokens, args.repeats,
            loaded=loaded,
        )  # fmt: skip
        timings["speed per method"] = time.perf_counter() - start
    for mode, step, methods, samples in (
        (QUERY_AGNOSTIC, "agnostic", agnostic_methods(), args.samples),
        (QUERY_AWARE, "aware", aware_methods(), args.aware_samples),
    ):
        if step in steps:
            start = time.perf_counter()
            grid = EvalGrid(
                tasks=args.tasks.split(","), lengths=_ints(args.lengths), methods=methods, depths=args.depths,
                samples=samples, modes=[mode],
            )  # fmt: skip
            run_eval(grid, args.results, loaded=loaded)
            timings[f"accuracy grid ({mode.replace('_', '-')})"] = time.perf_counter() - start
    if "ppl" in steps:
        start = time.perf_counter()
        ppl = EvalGrid(
            tasks=["ppl"], lengths=[], methods=split_specs(args.ppl_methods), ppl_tokens=args.ppl_tokens,
            ppl_chunk=args.ppl_chunk,
        )  # fmt: skip
        run_eval(ppl, args.results, loaded=loaded)
        timings["perplexity"] = time.perf_counter() - start
    save_timings(args.results, timings)
    compose(args, timings)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def load_timings(results: Path) -> dict[str, float]:
    """Step timings of earlier (partial) runs into the same results folder, so steps can run separately."""
    path = results / "timings.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_timings(results: Path, timings: dict[str, float]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "timings.json").write_text(json.dumps(timings, indent=1))


def compose(args, timings: dict[str, float]) -> None:
    """BENCHMARKS.md = set-up and load times + the report, with plot links pointing into benchmarks/report/."""
    report_dir = ROOT / "benchmarks" / "report"
    for stale in report_dir.glob("*.png"):
        stale.unlink()
    report = write_report(args.results, report_dir, title="kvopt benchmarks").read_text()
    report = report.replace(f"{ROOT}/", "")
    report = re.sub(r"\]\((?!https?:)([^)]+\.png)\)", r"](benchmarks/report/\1)", report)
    (report_dir / "REPORT.md").unlink()
    header = [
        "<!-- Generated by `make bench` (benchmarks/run.py); do not edit by hand. -->",
        "",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}. "
        "Model: SmolLM2-135M-Instruct (embedded default, fp32). Peers run in the same process, on the same prompts.",
        "",
        "| step | wall time |",
        "|---|---:|",
        *(f"| {name} | {seconds / 60:.1f} min |" for name, seconds in timings.items() if not name.startswith("load")),
        "",
        f"Load time of the default model: cold {timings.get('load cold s', float('nan')):.1f} s (GGUF conversion and "
        f"save, once), warm {timings.get('load warm s', float('nan')):.1f} s.",
        "",
        f"Grid: tasks {args.tasks} at {args.lengths} tokens, {args.depths} depth(s) x {args.samples} sample(s). "
        "Query-agnostic mode (the context is compressed before the question is seen) for every contender; "
        "query-aware mode (question inside the compressed prompt) for the baseline, window, snapkv, tova and the "
        "kvpress presses. Decode-time kvopt methods (window, streamingllm, tova) keep their budget while the question "
        "and answer are added, where presses let the cache grow past it: at equal nominal ratio they hold fewer "
        "tokens. Perplexity: "
        f"{args.ppl_tokens} tokens of real text streamed in chunks of {args.ppl_chunk} (`window` = its default "
        f"size=1024; methods: {args.ppl_methods}). Bench: {args.new_tokens} "
        f"decoded tokens, median of {args.repeats}.",
        "",
    ]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(header) + report)
    print((ROOT / "BENCHMARKS.md").read_text())


if __name__ == "__main__":
    main()
