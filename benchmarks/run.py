"""Regenerate BENCHMARKS.md: kvopt next to its peers on the default model, in one run.

    make bench                      # installs the peers (kvpress, optimum-quanto), then runs this
    python benchmarks/run.py        # the same, in an environment that already has them
    python benchmarks/run.py --model qwen2.5-coder-0.5b   # the second model's grid, its own part of the report

Steps: load time (cold conversion vs warm), speed/memory bench (median of repeats, ratios to
plain HF generation), the accuracy grid (resumable: benchmarks/results/eval.jsonl is reused),
streaming perplexity, the serving engine next to HF (benchmarks/serving.py), `kvopt serve` under
load (benchmarks/load.py), chat users beside long documents under step budgets and latency targets
(benchmarks/stallfree.py), the cache codec (benchmarks/codec.py), the KV tiers (benchmarks/tiers.py),
speculative decoding (benchmarks/speculative.py), the 2025 methods (benchmarks/frontier.py), 2-bit KV
(benchmarks/twobit.py; where it loses a prose needle: benchmarks/twobit_layers.py), llama.cpp as a peer (benchmarks/llamacpp.py, where it is installed), a decode step
against this CPU's limits (benchmarks/decode_profile.py), routers across engine replicas on a local Ray cluster
(benchmarks/cluster.py, where Ray is installed), retrieved documents reused at any position (benchmarks/blend.py),
long conversations and measured layer budgets (benchmarks/conversations.py), bf16 against fp32 on the same prompts
(benchmarks/precision.py), then the report with plots into benchmarks/report/. The timed targets on a GPU
(benchmarks/accelerator.py) run by hand where one is lent; their committed rows get their own section.
Every step's rows are committed in benchmarks/results/; a second model's (``--model``) in
benchmarks/results/<model>/, which become their own part of BENCHMARKS.md and feed the
"What holds on both models" summary (benchmarks/both_models.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import accelerator
import blend
import both_models
import cluster
import codec
import conversations
import decode_profile
import precision
import frontier
import llamacpp
import load
import serving
import speculative
import stallfree
import tiers
import torch
import twobit
import twobit_layers
import transformers
from sections import opening, row_dates

from kvopt.api import load_model
from kvopt.eval.bench import run_bench
from kvopt.eval.contenders import parse_contender, split_specs
from kvopt.eval.report import KEPT_NOTE, PLACEHOLDERS, keep_sections, write_report
from kvopt.eval.decoding import QUERY_AGNOSTIC, QUERY_AWARE
from kvopt.eval.runner import EvalGrid, run_eval
from kvopt.models.loading import load_config, resolve_model_dir

ROOT = Path(__file__).resolve().parent.parent
TITLE = "# kvopt benchmarks"
PRESSES = ["snapkv", "pyramidkv", "adakv-snapkv", "tova", "streamingllm"]
RATIOS = [0.5, 0.75, 0.9]
OURS = ["window", "streamingllm", "snapkv", "pyramidkv", "adakv", "tova", "kvzip", "surprisal"]
#: Decode speed at 4k context, each method at 75% removed, next to `full` and plain HF.
SPEED_METHODS = ["full", *(f"{m}:ratio=0.75" for m in OURS if m != "window"), "window:size=1024"]
#: Quantized caches next to HF's QuantizedCache (quanto backend) at equal bits.
QUANT = ["kivi:bits=8", "kivi:bits=4", "kivi:bits=2", "tokenquant:bits=8", "tokenquant:bits=4", "mixedkv"]
QUANT_PEERS = ["hf-quanto:bits=4", "hf-quanto:bits=2"]
#: Accuracy of quantization and of eviction + quantization, in the query-agnostic grid.
QUANT_ACCURACY = [
    "kivi:bits=4", "kivi:bits=2", "mixedkv", "snapkv:ratio=0.75+kivi:bits=4", "hf-quanto:bits=4", "hf-quanto:bits=2",
]
#: The 75%-removed claim (share of full's answers kept) with more prompts: the strongest methods of
#: each kind, the best press, and 4-bit quantization alone and after eviction.
RETENTION = [
    "full", "kvzip:ratio=0.75", "tova:ratio=0.75", "streamingllm:ratio=0.75", "kvpress:tova:ratio=0.75",
    "kivi:bits=4", "snapkv:ratio=0.75+kivi:bits=4",
]
#: Measured bytes vs the theoretical size of the budget, right after a 4k prefill.
MEMORY_CHECK = [
    "full", *(f"{m}:ratio=0.75" for m in ("snapkv", "pyramidkv", "adakv", "tova", "streamingllm", "kvzip")),
    "kivi:bits=8", "kivi:bits=4", "kivi:bits=2", "tokenquant:bits=4", "mixedkv", "minikv", "minicache",
    "minicache+kivi:bits=4", "snapkv:ratio=0.75+kivi:bits=4", "snapkv:ratio=0.75+kivi:bits=4,residual=32",
    "kvpress:snapkv:ratio=0.75", "kvpress:adakv-snapkv:ratio=0.75",
]
#: Decode speed and peak process memory, one fresh process per run (benchmarks/decode_memory.py).
DECODE_MEMORY = ["hf", "full", "kivi:bits=4", "hf-quanto:bits=4", "kivi:bits=2", "hf-quanto:bits=2"]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: Every step the default model runs; a second model runs the model-dependent ones (no engine, server, tiers...).
ALL_STEPS = (
    "load,lossless,agnostic,retention,ppl,check,quant-ppl,memory,bench,speed,aware,engine,serve,codec,tiers,speculative,"
    "frontier,twobit,llamacpp,profile,cluster,blend,conversations,precision,stallfree"
)
SECOND_MODEL_STEPS = (
    "lossless,agnostic,long,retention,aware,ppl,quant-ppl,check,memory,speed,twobit,blend,conversations,precision"
)
#: Context lengths of the grid: the default model's 8k positions allow 2k and 4k prompts; a 32k model gets 4k and 8k.
DEFAULT_LENGTHS, SECOND_MODEL_LENGTHS = "2048,4096", "4096,8192"
#: The longest prompts (second model only): the lossless cache, the best query-agnostic method, SnapKV and KIVI.
LONG_METHODS = ["full", "kvzip:ratio=0.75", "snapkv:ratio=0.75", "kivi:bits=4"]


def eviction_methods() -> list[str]:
    ours = ["full", *(f"{method}:ratio={r}" for method in OURS for r in RATIOS)]
    peers = [f"kvpress:{press}:ratio={r}" for press in PRESSES for r in RATIOS]
    return ours + peers


def agnostic_methods() -> list[str]:
    return eviction_methods() + QUANT_ACCURACY


def aware_methods() -> list[str]:
    """Query-aware: every eviction method but kvzip, whose reconstruction pass targets the query-agnostic case."""
    return [spec for spec in eviction_methods() if not spec.startswith("kvzip")]


def load_times() -> tuple[float, float]:
    """Cold (GGUF conversion into an empty cache dir) and warm load of the default model, fresh processes."""
    code = "import time,kvopt; t=time.perf_counter(); kvopt.load_model(); print(time.perf_counter()-t)"
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ, KVOPT_CACHE=empty)
        run = lambda: float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)  # noqa: E731
        return run(), run()


def arguments() -> argparse.ArgumentParser:
    """The command line; its defaults are the settings the default model's part of the report describes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Committed beside BENCHMARKS.md, so another machine can re-compose the report or resume a step.
    parser.add_argument("--model", default=None,
                        help="a second model (e.g. qwen2.5-coder-0.5b): its own rows and part of the report")
    parser.add_argument("--results", type=Path, default=None,
                        help="rows folder; default benchmarks/results (the default model) or benchmarks/results/<model>")
    parser.add_argument("--bench-lengths", default="512,2048")
    parser.add_argument("--bench-methods", default="full,window:size=512")
    parser.add_argument("--speed-length", type=int, default=4096)
    parser.add_argument("--speed-methods", default=",".join(SPEED_METHODS))
    parser.add_argument("--speed-repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default=None, help=f"default {DEFAULT_LENGTHS} ({SECOND_MODEL_LENGTHS} with --model)")
    parser.add_argument("--long-lengths", default="16384", help="the long step's lengths (--model only)")
    parser.add_argument("--tasks", default="passkey,niah,niah_multivalue")
    parser.add_argument("--depths", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--aware-samples", type=int, default=1)
    parser.add_argument("--retention-tasks", default="passkey,niah,niah_multivalue")
    parser.add_argument(
        "--only", default=None,
        help="comma-separated contenders: the accuracy steps run only these of their methods now (rows already "
        "there count), so a grid too long for one sitting is filled in parts",
    )  # fmt: skip
    parser.add_argument("--retention-samples", type=int, default=4)
    parser.add_argument("--ppl-tokens", type=int, default=8000)
    parser.add_argument("--ppl-chunk", type=int, default=32)
    parser.add_argument("--ppl-methods", default="full,window:size=1024,streamingllm:sinks=4,window=1020")
    parser.add_argument("--quant-ppl-tokens", type=int, default=4096)
    parser.add_argument("--quant-ppl-methods", default=",".join(["full", *QUANT, *QUANT_PEERS]))
    parser.add_argument("--memory-lengths", default="4096,8000")
    parser.add_argument("--memory-methods", default=",".join(DECODE_MEMORY))
    parser.add_argument("--memory-repeats", type=int, default=1)
    parser.add_argument(
        "--steps", default=None,
        help=f"comma-separated subset of the default ({ALL_STEPS}; with --model {SECOND_MODEL_STEPS}), "
        "or none: compose BENCHMARKS.md from the committed rows",
    )  # fmt: skip
    return parser


def main() -> None:
    parser = arguments()
    args = with_model_defaults(parser.parse_args())
    args.results.mkdir(parents=True, exist_ok=True)  # a second model's first run has no rows folder yet
    second = args.model is not None
    steps = set(args.steps.split(","))
    if second and steps - set(SECOND_MODEL_STEPS.split(",")) - {"none"}:
        parser.error(f"--model runs the model-dependent steps only: {SECOND_MODEL_STEPS}")

    loaded = load_model(args.model)
    model_label = args.model or DEFAULT_MODEL

    def finished(label: str, start: float) -> None:  # saved at once, merged with other runs' steps
        seconds = time.perf_counter() - start
        if args.only:  # one part of a step filled in parts: the step's time is the sum of its parts
            seconds += load_timings(args.results).get(label, 0.0)
        save_timings(args.results, {label: seconds})

    if "load" in steps:
        cold, warm = load_times()
        save_timings(args.results, {"load cold s": cold, "load warm s": warm})
    if "lossless" in steps:
        start = time.perf_counter()
        lossless_check(loaded, _ints(args.lengths), args.new_tokens, args.results)
        finished("lossless check", start)
    if "bench" in steps:  # lossless speed and bytes vs plain HF at short and medium lengths
        start = time.perf_counter()
        run_bench(
            _ints(args.bench_lengths), args.bench_methods.split(","), args.results, args.new_tokens, args.repeats,
            loaded=loaded,
        )  # fmt: skip
        finished("bench", start)
    if "speed" in steps:  # every method's decode speed at long context, same run as full and HF
        start = time.perf_counter()
        run_bench(
            [args.speed_length], split_specs(args.speed_methods), args.results, args.new_tokens, args.speed_repeats,
            model_name=args.model, loaded=loaded,
        )  # fmt: skip
        finished("speed per method", start)
    for mode, step, tasks, lengths, methods, samples in (
        (QUERY_AGNOSTIC, "agnostic", args.tasks, args.lengths, agnostic_methods(), args.samples),
        (QUERY_AGNOSTIC, "long", args.tasks, args.long_lengths, LONG_METHODS, args.samples),
        (QUERY_AGNOSTIC, "retention", args.retention_tasks, args.lengths, RETENTION, args.retention_samples),
        (QUERY_AWARE, "aware", args.tasks, args.lengths, aware_methods(), args.aware_samples),
    ):
        if step in steps and (methods := only(methods, args.only)):
            start = time.perf_counter()
            grid = EvalGrid(
                tasks=tasks.split(","), lengths=_ints(lengths), methods=methods, depths=args.depths,
                samples=samples, modes=[mode],
            )  # fmt: skip
            run_eval(grid, args.results, model_name=model_label, loaded=loaded)
            finished(f"accuracy grid ({step})", start)
    for step, label, methods, tokens in (
        ("ppl", "perplexity", args.ppl_methods, args.ppl_tokens),
        ("quant-ppl", "perplexity (quantization)", args.quant_ppl_methods, args.quant_ppl_tokens),
    ):
        if step in steps:
            start = time.perf_counter()
            ppl = EvalGrid(
                tasks=["ppl"], lengths=[], methods=split_specs(methods), ppl_tokens=tokens, ppl_chunk=args.ppl_chunk
            )
            run_eval(ppl, args.results, model_name=model_label, loaded=loaded)
            finished(label, start)
    if "check" in steps:
        start = time.perf_counter()
        memory_check(loaded, MEMORY_CHECK, args.speed_length, args.results)
        finished("measured vs theoretical bytes", start)
    if "memory" in steps:
        start = time.perf_counter()
        decode_memory(
            _ints(args.memory_lengths), split_specs(args.memory_methods), args.memory_repeats, args.new_tokens,
            args.results, args.model,
        )  # fmt: skip
        finished("decode speed and memory", start)
    if "engine" in steps:  # its own rows and timings (benchmarks/results/serving.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py")], check=True)
    if "serve" in steps:  # `kvopt serve` under load, its own rows (benchmarks/results/load.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load.py")], check=True)
    if "stallfree" in steps:  # chat beside documents, step budgets and targets (benchmarks/results/stallfree.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stallfree.py")], check=True)
    if "codec" in steps:  # bytes per token and perplexity gap per cache encoding (benchmarks/results/codec.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec.py")], check=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--accuracy"], check=True)
    if "tiers" in steps:  # a seen prefix from RAM / CPU / disk / Redis (benchmarks/results/tiers.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tiers.py")], check=True)
    if "speculative" in steps:  # decode speed with and without speculation (benchmarks/results/speculative.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--repeats", "3"], check=True)
    if "frontier" in steps:  # fastkv prefill, rocketkv decode, streaming, shallowzip (benchmarks/results/frontier.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "frontier.py")], check=True)
    if "twobit" in steps:  # 2-bit KV: retrieval, perplexity, bytes and decode speed (benchmarks/results/twobit.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "twobit.py"), *(["--model", args.model] if second else [])],
                       check=True)  # fmt: skip
        if not second:  # where 2-bit loses a prose needle (benchmarks/results/twobit_layers.jsonl)
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "twobit_layers.py")], check=True)
    if "llamacpp" in steps:  # llama.cpp alone and batched, kvopt.LLM beside it (benchmarks/results/llamacpp/rows.jsonl)
        if importlib.util.find_spec("llama_cpp") is None:
            print("llamacpp step skipped: llama-cpp-python is not installed (see the llamacpp extra in pyproject.toml)")
        else:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llamacpp.py"), "--kvopt", "fp32,auto"], check=True)
    if "profile" in steps:  # a decode step against this CPU's limits (benchmarks/results/decode_profile.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_profile.py")], check=True)
    if "cluster" in steps:  # routers across engine replicas on a local Ray cluster (benchmarks/results/cluster.jsonl)
        if importlib.util.find_spec("ray") is None:
            print("cluster step skipped: Ray is not installed (pip install kvopt[cluster])")
        else:
            for options in ([], ["--kv-memory", "256MB"], ["--replicas", "1"]):  # roomy pools, pressed pools, one replica
                subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster.py"), *options], check=True)
    if "blend" in steps:  # chunk caching on retrieval prompts, both models' rows in one file (results/blend.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "blend.py"), *(["--model", args.model] if second else [])],
                       check=True)  # fmt: skip
    if "conversations" in steps:  # epicache and xkv budgets, both models' rows in one file (results/conversations.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conversations.py"),
                        *(["--model", args.model] if second else [])], check=True)  # fmt: skip
    if "precision" in steps:  # bf16 against fp32 on the same prompts, both models' rows in one file (results/precision.jsonl)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "precision.py"), *(["--model", args.model] if second else [])],
                       check=True)  # fmt: skip
    if second:  # its config too: the report is recomposed on machines without the second model's wheels
        config = load_config(resolve_model_dir(args.model)).to_dict()
        (args.results / MODEL_FILE).write_text(json.dumps({"model": args.model, "config": config}, default=str))
    compose(with_model_defaults(parser.parse_args([])) if second else args)


def only(methods: list[str], chosen: str | None) -> list[str]:
    """``methods`` limited to the ``chosen`` contenders (compared by canonical spec; None: all of them)."""
    if chosen is None:
        return methods
    wanted = {parse_contender(spec).spec for spec in split_specs(chosen)}
    return [spec for spec in methods if parse_contender(spec).spec in wanted]


def with_model_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options whose defaults depend on ``--model`` (rows folder, lengths, steps)."""
    second = args.model is not None
    args.results = args.results or (RESULTS / model_folder(args.model) if second else RESULTS)
    args.lengths = args.lengths or (SECOND_MODEL_LENGTHS if second else DEFAULT_LENGTHS)
    args.steps = args.steps or (SECOND_MODEL_STEPS if second else ALL_STEPS)
    return args


def model_folder(name: str) -> str:
    """The rows folder name of a second model: its name, or a local folder's or file's name."""
    return Path(name).name.removesuffix(".gguf")


@torch.inference_mode()
def lossless_check(loaded, lengths: list[int], new_tokens: int, results: Path) -> None:
    """kvopt's `full` next to HF's DynamicCache on real text: greedy tokens and the largest logit difference.

    Each prompt is prefilled and decoded greedily by both (HF's tokens fed to both, so the logits
    compare position by position even if a choice flips); rows in ``lossless.jsonl``.
    """
    from kvopt.eval.decoding import forward
    from kvopt.local_text import real_text

    model, tokenizer = loaded
    ids = tokenizer(real_text()[0], add_special_tokens=False)["input_ids"]
    rows = []
    for length in lengths:
        prompt = (ids * (length // len(ids) + 1))[:length]
        logits = {}
        for spec in ("hf", "full"):
            contender = parse_contender(spec)
            cache = contender.new_cache(model)
            steps = [forward(model, prompt, cache, 0)]
            for index in range(new_tokens - 1):
                token = int(logits["hf"][index].argmax()) if "hf" in logits else int(steps[-1].argmax())
                steps.append(forward(model, [token], cache, length + index))
            logits[spec] = torch.stack(steps).float()
        rows.append({"length": length, "new_tokens": new_tokens,
                     "same_tokens": bool(torch.equal(logits["hf"].argmax(-1), logits["full"].argmax(-1))),
                     "max_abs_logit_diff": float((logits["hf"] - logits["full"]).abs().max())})  # fmt: skip
        print(rows[-1])
    (results / both_models.LOSSLESS).write_text("".join(json.dumps(r) + "\n" for r in rows))


CHECK_FILE = "memory_check.jsonl"


def memory_check(loaded, specs: list[str], length: int, results: Path) -> None:
    """Bytes each cache holds right after a ``length``-token prefill of real text, vs its theoretical size.

    kvopt methods replay one recorded prefill; presses run their own. Theoretical: ``kvopt memory``'s
    estimate (the budget's tokens, quantization overheads included); for a press, the kept fraction
    of the full cache.
    """
    from kvopt.eval.decoding import forward, shared_prefill
    from kvopt.local_text import real_text
    from kvopt.memory import estimate
    from kvopt.models.info import ModelInfo

    model, tokenizer = loaded
    info = ModelInfo.from_config(model.config)
    ids = tokenizer(real_text()[0], add_special_tokens=False)["input_ids"][:length]
    shared = shared_prefill(model, ids)
    full = estimate(info, length, dtype=model.dtype).total_bytes
    rows = []
    for spec in specs:
        contender = parse_contender(spec)
        if contender.missing():
            continue
        with torch.inference_mode():
            cache = contender.new_cache(model)
            if contender.family == "kvopt":
                cache.replay_prefill(shared.cache)
                contender.after_prefill(model, cache, ids, tokenizer)
                theoretical = estimate(info, length, methods=cache.methods, dtype=model.dtype).total_bytes
            else:
                with contender.compressing(model):
                    forward(model, ids, cache, 0)
                theoretical = round(full * (1 - contender.ratio))
        rows.append({"method": contender.spec, "length": length, "measured": contender.held_bytes(cache),
                     "theoretical": theoretical, "full": full})  # fmt: skip
        print(rows[-1])
    (results / CHECK_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def check_section(results: Path, model: str | None = None) -> list[str]:
    path = results / CHECK_FILE
    if not path.exists():
        return []
    from kvopt.memory import human_bytes

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        f"## Measured KV bytes vs the theoretical size ({rows[0]['length']}-token prefill)",
        "",
        opening(command(model, ["check"]), row_dates(path), path),
        "",
        "Bytes of the tensors each cache holds right after the prefill (kvopt: positions, validity bits and "
        "buffer slack included) vs `kvopt memory --method`'s theoretical size (the budget's tokens at full "
        "precision; quantization: codes, fp16 scales and zero-points, positions of quantized tokens and the "
        "full-precision remainder). For kvpress presses the theoretical size is (1 − ratio) of the full cache. "
        "`x full (fp32)` is measured bytes over the full cache's theoretical bytes in the model's dtype (fp32 "
        "here); `x fp16 full` compares with a full cache stored in fp16 (twice the fp32 fraction).",
        "",
        "| method | measured | theoretical | measured / theoretical | x full (fp32) | x fp16 full |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        fraction = row["measured"] / row["full"]
        lines.append(
            f"| `{row['method']}` | {human_bytes(row['measured'])} | {human_bytes(row['theoretical'])} | "
            f"{row['measured'] / row['theoretical']:.3f} | {fraction:.3f} | {2 * fraction:.3f} |"
        )
    return lines + [""]


MEMORY_FILE = "decode_memory.jsonl"
#: Every results file BENCHMARKS.md is made from.
RESULT_FILES = ("eval.jsonl", "bench.jsonl", CHECK_FILE, MEMORY_FILE)


def complete(results: Path) -> bool:
    """True when ``results`` holds every step's rows, scored accuracy rows included (steps re-run alone, e.g.
    perplexity only, leave an eval.jsonl without them: the accuracy sections are then kept, not dropped)."""
    if not all((results / name).exists() for name in RESULT_FILES):
        return False
    rows = (json.loads(line) for line in (results / "eval.jsonl").read_text().splitlines() if line.strip())
    return any(row.get("score") is not None for row in rows)


def decode_memory(
    lengths: list[int], specs: list[str], repeats: int, new_tokens: int, results: Path, model: str | None = None
) -> None:
    """One fresh process per (length, method, repeat), methods interleaved within each repeat."""
    rows = []
    results.mkdir(parents=True, exist_ok=True)
    for length in lengths:
        for repeat in range(repeats):
            for spec in specs:
                command = [sys.executable, str(ROOT / "benchmarks" / "decode_memory.py"), "--spec", spec,
                           "--length", str(length), "--new-tokens", str(new_tokens)]  # fmt: skip
                command += ["--model", model] if model else []
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    print(f"decode_memory {spec} @ {length} failed:\n{done.stderr[-2000:]}")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1]) | {"repeat": repeat}
                print(row)
                rows.append(row)
    (results / MEMORY_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def memory_section(results: Path, model: str | None = None) -> list[str]:
    """Decode speed, KV bytes and peak process memory per (length, method), vs HF's QuantizedCache."""
    path = results / MEMORY_FILE
    if not path.exists():
        return []
    from kvopt.memory import estimate, human_bytes
    from kvopt.models.info import ModelInfo

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    info = ModelInfo.from_config(rows_model_config(results, model))
    grouped: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["length"], row["method"]), []).append(row)
    median = lambda key, group: statistics.median(r[key] for r in group)  # noqa: E731
    lines = [
        "## Quantized caches: bytes, decode speed and peak memory (vs HF QuantizedCache)",
        "",
        opening(command(model, ["memory"]), row_dates(path), path),
        "",
        f"One fresh process per run, median of {max(len(g) for g in grouped.values())} runs per length and method "
        "(methods interleaved within each round); KV bytes measured from the tensors after the prompt and "
        f"{rows[0]['new_tokens']} decoded tokens; fp16-equivalent = a full cache stored in fp16 "
        "(the model runs in fp32 here, so `full` is 2x that). Peak RSS is the process high-water mark "
        "during decoding (reset after the prefill; model weights included), growth = its excess over the "
        "RSS when decoding began. Speed ratio: vs `hf-quanto` at the same bits (same length).",
        "",
        "| length | method | decode tok/s | vs quanto | KV held | x fp16 full | x fp32 full | peak RSS | RSS growth |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (length, spec), group in sorted(grouped.items()):
        fp16 = estimate(info, length + group[0]["new_tokens"], dtype=torch.float16).total_bytes
        kv = median("kv_bytes", group)
        bits = quantized_bits(spec)
        peer = grouped.get((length, f"hf-quanto:bits={bits}")) if bits else None
        speed = median("decode_tok_s", group)
        ratio = f"{speed / median('decode_tok_s', peer):.2f}x" if peer else "–"
        lines.append(
            f"| {length} | `{spec}` | {speed:.2f} | {ratio} | {human_bytes(kv)} | {kv / fp16:.3f} | {kv / fp16 / 2:.3f} | "
            f"{median('decode_peak_rss_mb', group):.0f} MB | {median('decode_rss_growth_mb', group):.1f} MB |"
        )
    return lines + [""]


def quantized_bits(spec: str) -> int | None:
    """The bit width of a kvopt spec's quantizer (its default when the spec omits it); None for other specs."""
    from kvopt.methods.spec import parse

    if spec.startswith(("hf", "kvpress")):
        return None
    return next((method.bits for method in parse(spec) if hasattr(method, "bits")), None)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def load_timings(results: Path) -> dict[str, float]:
    """Step timings of earlier (partial) runs into the same results folder, so steps can run separately."""
    path = results / "timings.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_timings(results: Path, timings: dict[str, float]) -> None:
    """Merge this run's step timings into the file (runs of other steps may have saved meanwhile)."""
    results.mkdir(parents=True, exist_ok=True)
    merged = {**load_timings(results), **timings}
    (results / "timings.json").write_text(json.dumps(merged, indent=1))


def compose(args) -> None:
    """Write BENCHMARKS.md (:func:`composed`, its plots into benchmarks/report/) and drop the plots it no longer links."""
    target = ROOT / "BENCHMARKS.md"
    text = composed(args, PLOTS, target.read_text() if target.exists() else "")
    target.write_text(text)
    for plot in PLOTS.rglob("*.png"):  # plots of sections neither regenerated nor kept
        if str(plot.relative_to(ROOT)) not in text:
            plot.unlink()
    print(text)


def composed(args, plots: Path, previous: str) -> str:
    """BENCHMARKS.md from the committed rows: the title and the machine, "What holds on both models" first, a table
    of contents, then every section, each opening with the command that regenerates it and the days its rows were
    measured (:func:`sections.opening`).

    ``args`` are the default model's settings (its grid is described with them); the plots are drawn into
    ``plots`` and linked under benchmarks/report/. After the default model's sections, a part per second model
    found in benchmarks/results/<model>/. When the results folder lacks some results (a step re-run alone, on a
    machine without the earlier results), the sections it has no results for are kept from ``previous`` (the
    earlier BENCHMARKS.md), marked as such, with their step timings; a complete folder rewrites every section.
    """
    timings = load_timings(args.results)
    report = model_report(args.results, plots)
    seconds = second_models()
    extra = ["", *check_section(args.results), *memory_section(args.results), *serving.section(), *load.section(),
             *committed_section(stallfree),
             *committed_section(codec), *committed_section(tiers), *committed_section(speculative),
             *committed_section(frontier), *committed_section(twobit), *committed_section(twobit_layers),
             *committed_section(llamacpp),
             *committed_section(decode_profile), *committed_section(cluster), *committed_section(blend), *committed_section(conversations),
             *committed_section(precision),
             *committed_section(accelerator)]  # fmt: skip
    for name, folder in seconds:
        extra += second_model_part(name, folder, plots)
    body, kept = report + "\n".join(extra), []
    if not complete(args.results):  # a partial run: keep what it lacks (the summary and set-up are always recomputed)
        body, kept = keep_sections(body, re.sub(section_pattern(SUMMARY, SETUP), "", previous, flags=re.S | re.M))
        body = KEPT.sub(r"\1\3\2", body)  # the kept note below the section's opening line
    if kept:  # the kept sections' step timings too
        timings = {**previous_timings(previous), **timings}
    first = body.index("\n## ")
    preamble, body = body[:first].partition("\n\n")[2], body[first + 1 :]  # the report's preamble, below its title
    eval_rows = args.results / "eval.jsonl"
    if kept and (not eval_rows.exists() or not eval_rows.read_text().strip()):
        # The report's summary lines describe the eval results; here those are the kept ones.
        earlier = re.search(r"^- Results: .*?^> .*?\n", previous, flags=re.S | re.M)
        preamble = earlier.group(0) if earlier else preamble
    summary = summary_section([(None, args.results), *seconds])
    setup = setup_section(args, timings, preamble)
    intro = [
        TITLE,
        "",
        "<!-- Generated by `make bench` (benchmarks/run.py); do not edit by hand. -->",
        "",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}. "
        f"Model: {DEFAULT_MODEL} (embedded default, fp32)"
        + "".join(f"; second model: {name} (its own part below)" for name, _ in seconds)
        + ". Peers run in the same process, on the same prompts.",
        "",
    ]
    return "\n".join([*intro, *summary, *contents("\n".join([*summary, *setup, body])), *setup, body])


#: The default model's section on how its grid ran (step times, load time, settings), after the summary.
SETUP = "## Set-up: step times, load time and the grid"
PLOTS = ROOT / "benchmarks" / "report"
#: A section kept from an earlier run: its heading, the note :func:`keep_sections` puts under it, its opening line.
KEPT = re.compile(rf"^(## .*\n\n)({re.escape(KEPT_NOTE)}\n\n)(.*\n\n)", re.M)


def section_pattern(*headings: str) -> str:
    """A regex (re.S | re.M) for the ``## `` sections with these headings, each up to the next one."""
    return rf"^(?:{'|'.join(map(re.escape, headings))})\n.*?(?=^## |\Z)"


def contents(text: str) -> list[str]:
    """The table of contents: a link to every ``## `` section of ``text``."""
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    return ["**Contents**", "", *(f"- [{heading}](#{anchor(heading)})" for heading in headings), ""]


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation dropped, each space a hyphen. mkdocs (the docs
    site includes BENCHMARKS.md) collapses runs of spaces and hyphens; no heading here has one (tested)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def opened(lines: list[str], line: str) -> list[str]:
    """A section's lines (heading, blank, the rest) with ``line`` as its first paragraph."""
    return [lines[0], "", line, *lines[1:]]


def command(model: str | None = None, steps: list[str] | tuple[str, ...] = ()) -> str:
    """The run.py command that measures ``steps`` (those ``model`` runs; every step when none is named) of
    ``model`` (None: the default model)."""
    runs = (SECOND_MODEL_STEPS if model else ALL_STEPS).split(",")
    chosen = ",".join(step for step in steps if step in runs)
    return "python benchmarks/run.py" + (f" --model {model}" if model else "") + (f" --steps {chosen}" if chosen else "")


def summary_section(models: list[tuple[str | None, Path]]) -> list[str]:
    """"What holds on both models" over ``(model, rows folder)`` pairs (None: the default model), opening with the
    commands that measure each model's rows and the days they were measured."""
    lines = both_models.section([(model or DEFAULT_MODEL, folder) for model, folder in models])
    if not lines:
        return []
    dates = [day for _, folder in models for name in both_models.FILES for day in row_dates(folder / name)]
    return opened(lines, opening([command(model) for model, _ in models], dates, [folder for _, folder in models]))


def setup_section(args, timings: dict[str, float], preamble: str) -> list[str]:
    """How the default model's grid was run: its rows, the step times, the load time and the grid's settings."""
    rows = [args.results / name for name in (*RESULT_FILES, both_models.LOSSLESS)]
    return [
        SETUP,
        "",
        opening(command(), [day for path in rows for day in row_dates(path)], args.results),
        "",
        preamble.strip(),
        "",
        "| step | wall time |",
        "|---|---:|",
        *(f"| {name} | {seconds / 60:.1f} min |" for name, seconds in timings.items() if not name.startswith("load")),
        "",
        "Wall time of the latest run of each step; a step filled in parts with `--only` sums its parts' times. "
        "Steps may run in several parts (by length or task, rows are "
        "resumable) and the accuracy and perplexity steps side by side, one thread per core; the timed steps "
        "(bench, speed, decode speed and memory, load) run alone on both cores.",
        "",
        f"Load time of the default model: cold {timings.get('load cold s', float('nan')):.1f} s (GGUF conversion and "
        f"save, once), warm {timings.get('load warm s', float('nan')):.1f} s.",
        "",
        f"Grid: tasks {args.tasks} at {args.lengths} tokens, one needle depth (0.5), {args.samples} sample(s) per "
        f"task and length in the query-agnostic mode (the context is compressed before the question is seen: "
        f"every contender) and {args.aware_samples} in the query-aware mode (question inside the compressed "
        "prompt: every contender but kvzip and the quantizers). kvopt methods replay one recorded lossless prefill "
        "per prompt (identical results, tested); presses run their own. `ratio` follows kvpress's convention for "
        "every method: that fraction of the prompt is removed at the prefill and later tokens are added on top, "
        "so equal ratios hold equal tokens (`KV held`). "
        f"Retention: {', '.join(f'`{m}`' for m in RETENTION[1:])} next to `full` on {args.retention_tasks} with "
        f"at least {args.retention_samples} samples per task and length (query-agnostic; the grid's rows are "
        "reused; the `prompts` column gives each method's count), for the share of full's answers kept. "
        f"Perplexity: {args.ppl_tokens} tokens of real text streamed in chunks of {args.ppl_chunk} for "
        f"{args.ppl_methods} (`streamingllm:sinks=4,window=1020` keeps 1,024 tokens), and "
        f"{args.quant_ppl_tokens} tokens for the quantizers next to HF's QuantizedCache. Bench: {args.new_tokens} "
        f"decoded tokens, median of {args.repeats}.",
        "",
    ]


#: Each section of the evaluation report (kvopt.eval.report): the run.py steps that make its rows, their file, and
#: the field its rows have (None: every row). Without bench rows, the memory plot shows the accuracy rows' peaks.
ACCURACY = (("agnostic", "long", "aware"), "eval.jsonl", "score")
REPORT_SECTIONS = {
    "Accuracy": ACCURACY,
    "Share of the full cache's answers kept": (("agnostic", "retention"), "eval.jsonl", "score"),
    "Perplexity": (("ppl", "quant-ppl"), "eval.jsonl", "ppl"),
    "Speed": (("bench", "speed"), "bench.jsonl", None),
    "Plots": ACCURACY,  # without matplotlib
    "Plots: accuracy": ACCURACY,
    "Plots: memory and speed": (("bench", "speed"), "bench.jsonl", None),
}


def model_report(results: Path, plots: Path, model: str | None = None) -> str:
    """The evaluation report of one rows folder (a second ``model``'s plots in their own folder): its title and
    preamble (rows, tasks, the intervals' caveat), then its sections, each opening with the command that measures
    its rows; plot links relative to the repository root."""
    folder = plots if model is None else plots / results.name
    report = write_report(results, folder, title=model or DEFAULT_MODEL).read_text()
    (folder / "REPORT.md").unlink()
    report = report.replace(f"{ROOT}/", "")
    link = PLOTS.relative_to(ROOT).as_posix() + ("" if model is None else f"/{results.name}")
    report = re.sub(r"\]\((?!https?:)([^)]+\.png)\)", rf"]({link}/\1)", report)
    preamble, _, sections = report.partition("\n## ")
    opened_sections = []
    for section in filter(None, re.split(r"^(?=## )", f"## {sections}", flags=re.M)):
        steps, name, field = REPORT_SECTIONS[section.partition("\n")[0].removeprefix("## ")]
        if not (results / name).exists():
            steps, name, field = ACCURACY
        dates = row_dates(results / name, lambda row: field is None or row.get(field) is not None)
        lines = opened(section.split("\n"), opening(command(model, steps), dates, results / name))
        opened_sections.append("\n".join(lines))
    return preamble + "\n" + "".join(opened_sections)


MODEL_FILE = "model.json"
SUMMARY = both_models.SUMMARY


def rows_model_config(results: Path, model: str | None) -> transformers.PretrainedConfig:
    """The config of the model whose rows lie in ``results``: the copy its run kept there (a second model's wheels
    need not be installed to recompose the report), else the installed model's."""
    kept = results / MODEL_FILE
    entry = json.loads(kept.read_text()) if kept.exists() else {}
    if "config" in entry:
        return transformers.AutoConfig.for_model(**entry["config"])
    return load_config(resolve_model_dir(model))


def second_models() -> list[tuple[str, Path]]:
    """(model name, rows folder) of every second model with rows under benchmarks/results/."""
    folders = sorted(path.parent for path in RESULTS.glob(f"*/{MODEL_FILE}"))
    return [(json.loads((folder / MODEL_FILE).read_text())["model"], folder) for folder in folders]


def second_model_part(name: str, folder: Path, plots: Path) -> list[str]:
    """A second model's sections under one heading (``## Second model: ...``), each one level down."""
    report = model_report(folder, plots, name)
    sections = [*report[report.index("\n## ") + 1 :].splitlines(), "", *check_section(folder, name),
                *memory_section(folder, name), *committed_section(twobit, folder / twobit.ROWS.name)]  # fmt: skip
    # Sections this folder has no rows for (a placeholder line) are left out rather than shown empty.
    parts = re.split(r"^(?=## )", "\n".join(sections), flags=re.M)
    sections = "".join(part for part in parts if not any(text in part for text in PLACEHOLDERS)).splitlines()
    timings = load_timings(folder)
    dates = [day for path in sorted(folder.glob("*.jsonl")) for day in row_dates(path)]
    lines = [
        f"## Second model: {name}",
        "",
        opening(command(name), dates, folder),
        "",
        "The default model's grid on a larger model (" + describe_rows(folder) + "), its steps resumable.",
        "",
    ]
    if timings:
        lines += ["| step | wall time |", "|---|---:|", *(f"| {step} | {sec / 60:.1f} min |" for step, sec in timings.items()),
                  "", "A step filled in parts with `--only` (side by side, one thread each) sums its parts' times.", ""]  # fmt: skip
    return lines + [f"#{line}" if line.startswith("#") else line for line in sections] + [""]


def describe_rows(folder: Path) -> str:
    """Tasks, lengths and samples per task and length of a folder's query-agnostic and query-aware rows."""
    scored = [row for row in both_models.rows(folder, both_models.EVAL) if row.get("score") is not None]
    parts = []
    for mode in ("query_agnostic", "query_aware"):
        in_mode = [row for row in scored if row["mode"] == mode]
        if not in_mode:
            continue
        cells: dict[tuple, set] = {}
        for row in in_mode:
            cells.setdefault((row["method"], row["task"], row["length"]), set()).add((row["depth"], row["sample"]))
        counts = [len(samples) for samples in cells.values()]
        tasks = sorted({row["task"] for row in in_mode})
        lengths = sorted({row["length"] for row in in_mode})
        samples = str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        parts.append(f"{mode}: {', '.join(tasks)} at {', '.join(map(str, lengths))} tokens, "
                     f"{samples} samples per method, task and length")  # fmt: skip
    return "; ".join(parts) or "no scored rows yet"


def committed_section(step, path: Path | None = None) -> list[str]:
    """A step's section from its committed rows (``path``, by default ``step.ROWS``, rendered by ``step.render``);
    none without rows."""
    path = path or step.ROWS
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [*step.render(rows).splitlines(), ""] if rows else []


def previous_timings(previous: str) -> dict[str, float]:
    """Step timings (seconds) from an earlier BENCHMARKS.md's set-up section, for the sections it keeps."""
    found = re.search(section_pattern(SETUP), previous, flags=re.S | re.M)
    setup = found.group(0) if found else ""
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) min \|$", setup, re.M)
    timings = {name: float(minutes) * 60 for name, minutes in rows}
    load = re.search(r"cold ([\d.]+) s .*warm ([\d.]+) s", setup)
    if load:
        timings |= {"load cold s": float(load.group(1)), "load warm s": float(load.group(2))}
    return timings


if __name__ == "__main__":
    main()
