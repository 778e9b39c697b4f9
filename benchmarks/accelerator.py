"""The timed targets of #16 and #17 on an accelerator (a CUDA GPU), where a session is lent one.

On this project's 2-core CPU a decode step of the default model is bound by reading its weights and by
arithmetic, so methods that cut the bytes a step reads (rocketkv's sparse attention) or that trade
arithmetic for bytes (aquakv's cross-layer prediction) are measured where they are at their worst.
This script re-runs the same timed comparisons as ``frontier.py`` and ``twobit.py`` on a GPU, with the
same code paths, and writes rows tagged with the device:

    python benchmarks/accelerator.py --device cuda            # every step, a few minutes on one H100

Steps (the same prompts of local real text; interleaved repeats, medians kept; the GPU synchronized
before every clock read):

* ``twobit``: decode tok/s after an 8k prompt for ``full``, ``kivi:bits=2``, ``kvquant:bits=2`` and
  ``aquakv:bits=2`` (#17's bar: no slower than 0.8x ``kivi:bits=2``), and their calibration time there.
* ``rocket``: decode tok/s after an 8k prompt for ``full``, ``rocketkv`` at budgets 256 and 512, and
  ``snapkv`` holding the bytes each stores (#16's bar: 2x ``full``), as ``frontier.py``'s ``decode`` step.
* ``prefill``: prefill seconds at 4k and 8k for ``full``, ``fastkv`` and ``snapkv`` (``frontier.py``'s).
* ``cost``: the query-agnostic methods' prefill seconds at 2k and 4k (``frontier.py``'s ``cost``).

Rows: ``benchmarks/results/accelerator.jsonl`` (one file, rewritten step by step); :func:`render` writes
the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import frontier
import twobit

ROWS = Path(__file__).parent / "results" / "accelerator.jsonl"
MODEL = frontier.MODEL
TWOBIT = ["full", *twobit.DECODE_METHODS]
STEPS = "twobit,rocket,prefill,cost"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def timed_prefills(model, tokenizer, specs: list[str], lengths: list[int], repeats: int, own_prefill: bool) -> list[dict]:
    """Prefill seconds per spec and length, interleaved; ``own_prefill``: through :meth:`KVCache.prefill` (the
    query-agnostic methods' own passes run there) rather than one forward."""
    from kvopt.api import build_cache
    from kvopt.eval.decoding import forward

    device = model.device
    rows = []
    for length in lengths:
        ids = frontier.prompt_ids(tokenizer, length)
        for spec in specs:  # warm-up: kernels chosen, workspaces allocated
            build_cache(spec, model).prefill(model, torch.tensor([ids[:512]], device=device), tokenizer=tokenizer)
        for repeat in range(repeats):
            for spec in specs:
                cache = build_cache(spec, model)
                synchronize(device)
                began = time.perf_counter()
                if own_prefill:
                    cache.prefill(model, torch.tensor([ids], device=device), tokenizer=tokenizer)
                else:
                    forward(model, ids, cache, 0)
                synchronize(device)
                rows.append({"method": spec, "length": length, "repeat": repeat,
                             "prefill_s": round(time.perf_counter() - began, 4), "kv_bytes": cache.nbytes()})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def run_step(step: str, model, tokenizer, args) -> list[dict]:
    if step == "twobit":
        calibration = twobit.calibrations(model, TWOBIT)
        rows = twobit.decode_speed(model, tokenizer, TWOBIT, args.length, args.new_tokens, args.repeats)
        return [{**row, **calibration.get(row["method"], {})} for row in rows]
    if step == "rocket":  # frontier's decode rows carry one run each; the section takes medians
        return frontier.measure_decode(model, tokenizer, args.repeats, args.new_tokens, args.length)
    if step == "prefill":
        return timed_prefills(model, tokenizer, frontier.PREFILL, frontier.PREFILL_LENGTHS, args.repeats, False)
    if step == "cost":
        specs, lengths = frontier.AGNOSTIC_COST, frontier.AGNOSTIC_COST_LENGTHS
        return timed_prefills(model, tokenizer, specs, lengths, args.repeats, True)
    raise SystemExit(f"unknown step {step!r}; choose from {STEPS}")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


# -- the section ------------------------------------------------------------------------------------------------


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section for these rows (markdown)."""
    if not rows:
        return ""
    by_step, first = frontier.rows_by_step(rows), rows[0]
    lines = [
        f"## On a GPU: the timed targets of #16 and #17 ({first['device']})",
        "",
        f"`python benchmarks/accelerator.py --device cuda` (rows: `benchmarks/results/accelerator.jsonl`), {MODEL} "
        f"(fp32), {first['device']}, torch {first['torch']}, transformers {first['transformers']}, {first['date']}; "
        "batch 1, eager attention through kvopt's caches, the GPU synchronized before each clock read; "
        "interleaved repeats, medians. The same code and prompts as the CPU sections above; on the CPU a decode "
        "step is bound by the weights and by arithmetic, here by kernel launches and memory traffic.",
        "",
    ]
    for title, step, key, base in (
        ("Decode, 2-bit caches", "twobit", "decode_tok_s", "kivi:bits=2"),
        ("Decode, RocketKV vs SnapKV at equal stored bytes", "rocket", "decode_tok_s", "full"),
    ):
        lines += _speed_table(title, by_step.get(step, []), key, base)
    for title, step in (("Prefill, FastKV vs SnapKV", "prefill"), ("Prefill, query-agnostic methods", "cost")):
        lines += _prefill_table(title, by_step.get(step, []))
    return "\n".join(lines) + "\n"


def _speed_table(title: str, rows: list[dict], key: str, base: str) -> list[str]:
    if not rows:
        return []
    length, new_tokens = rows[0]["length"], rows[0]["new_tokens"]
    # every run's value: twobit rows list theirs (``runs_tok_s``), frontier rows are one run each
    speeds = {spec: [v for r in group for v in r.get("runs_tok_s", [r[key]])]
              for spec, group in frontier.per_method(rows).items()}  # fmt: skip
    reference = statistics.median(speeds[base]) if base in speeds else None
    lines = [f"### {title} (after {length} tokens, {new_tokens} decoded)", "",
             f"| method | decode tok/s | vs `{base}` | runs |", "|---|---:|---:|---|"]  # fmt: skip
    for spec, runs in speeds.items():
        median = statistics.median(runs)
        ratio = f"{median / reference:.2f}x" if reference else "-"
        lines.append(f"| `{spec}` | {median:.1f} | {ratio} | {', '.join(f'{r:.1f}' for r in runs)} |")
    return [*lines, ""]


def _prefill_table(title: str, rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [f"### {title}", "", "| length | method | prefill s | vs `full` | KV held |", "|---:|---|---:|---:|---:|"]
    for length in dict.fromkeys(r["length"] for r in rows):
        groups = frontier.per_method([r for r in rows if r["length"] == length])
        full = statistics.median(r["prefill_s"] for r in groups["full"]) if "full" in groups else None
        for spec, group in groups.items():
            value, held = statistics.median(r["prefill_s"] for r in group), group[0]["kv_bytes"] / 1e6
            ratio = f"{value / full:.2f}x" if full else "-"
            lines.append(f"| {length} | `{spec}` | {value * 1e3:.1f} ms | {ratio} | {held:.1f} MB |")
    return [*lines, ""]


def main() -> None:
    import transformers

    import kvopt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=STEPS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=frontier.DECODE_LENGTH, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    model, tokenizer = kvopt.load_model(device=device)
    stamp = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
             "model": MODEL, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    for step in args.steps.split(","):
        began = time.perf_counter()
        new = [{"step": step, **stamp, **row} for row in run_step(step, model, tokenizer, args)]
        print(f"{step}: {time.perf_counter() - began:.0f} s", flush=True)
        old = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()] if ROWS.exists() else []
        ROWS.parent.mkdir(parents=True, exist_ok=True)
        ROWS.write_text("".join(json.dumps(row) + "\n" for row in [r for r in old if r["step"] != step] + new))
    print(render([json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main()
