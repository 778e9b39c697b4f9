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
* ``batch``: ``--batch`` different 8k prompts decoded together (``frontier.py``'s ``decode-batch``): the rows'
  KV, not the weights, is then what a step mostly reads.
* ``kernel``: decode tok/s after an 8k prompt at batch 1 and 8 for the quantized specs whose stored tokens
  the fused Triton kernel reads (:mod:`kvopt.kernels.quantized_attention`), through the kernel and through the
  torch path (``kvopt.kernels.disabled()``), next to ``full``.
* ``ops``: what one decode step costs each contender of ``twobit`` and ``rocket``: wall time, tensor operations
  dispatched (each at least one kernel launch), and on CUDA the kernels launched and the time the GPU was busy;
  a step whose wall time is far above its busy time is bound by launches, not by the bytes it reads.

Rows: ``benchmarks/results/accelerator.jsonl`` (one file, rewritten step by step); :func:`render` writes
the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import frontier
import twobit
from sections import opening, row_dates

ROWS = Path(__file__).parent / "results" / "accelerator.jsonl"
MODEL = frontier.MODEL
TWOBIT = ["full", *twobit.DECODE_METHODS]
#: Specs whose quantized parts the fused kernel reads: timed through it and through the torch path.
KERNEL_SPECS = ["kivi:bits=2", "kivi:bits=4", "tokenquant:bits=4"]
KERNEL_BATCHES = (1, 8)
PATHS = ("fused", "torch")
STEPS = "kernel,twobit,ops,rocket,batch,prefill,cost"  # ops after twobit: its calibrations are then cached


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def timed_prefills(model, tokenizer, specs: list[str], lengths: list[int], repeats: int, own_prefill: bool) -> list[dict]:
    """Prefill seconds per spec and length, interleaved; ``own_prefill``: through :meth:`KVCache.prefill` (the
    query-agnostic methods' own passes run there) rather than one forward."""
    from kvopt.api import build_cache
    from kvopt.eval.decoding import forward, synchronize

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


Emit = Callable[[dict], None]


def print_row(row: dict) -> None:
    print(json.dumps(row), flush=True)


class StepRows:
    """One step's rows in :data:`ROWS`, written as each is measured: a step stopped by a time limit keeps what it
    measured (marked ``"complete": false`` until the step ends)."""

    def __init__(self, step: str, stamp: dict) -> None:
        self.step, self.stamp, self.rows = step, stamp, []

    def add(self, row: dict) -> None:
        print_row(row)
        self.rows.append({"step": self.step, **self.stamp, **row, "complete": False})
        self._save()

    def finish(self, rows: list[dict]) -> None:
        self.rows = [{"step": self.step, **self.stamp, **row} for row in rows]
        self._save()

    def _save(self) -> None:
        old = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()] if ROWS.exists() else []
        ROWS.parent.mkdir(parents=True, exist_ok=True)
        kept = [row for row in old if row["step"] != self.step]
        ROWS.write_text("".join(json.dumps(row) + "\n" for row in kept + self.rows))


def read_path(path: str):
    """The context a contender's reads run in: the fused kernels where they serve (``fused``), or the torch path."""
    from kvopt import kernels

    return contextlib.nullcontext() if path == "fused" else kernels.disabled()


@torch.inference_mode()
def kernel_decode(model, tokenizer, length: int, new_tokens: int, repeats: int, emit: Emit = print_row) -> list[dict]:
    """Decode tok/s (all rows) of :data:`KERNEL_SPECS` through the fused kernel and the torch path, and of ``full``,
    for ``KERNEL_BATCHES`` different ``length``-token prompts decoded together; interleaved repeats (each row
    handed to ``emit`` as it is measured)."""
    rows = []
    contenders = [("full", "torch"), *((spec, path) for spec in KERNEL_SPECS for path in PATHS)]
    for batch in KERNEL_BATCHES:
        prompt = frontier.batch_prompt(model, tokenizer, batch, length - new_tokens - 8)
        for repeat in range(repeats):
            for spec, path in contenders:
                with read_path(path):
                    seconds, kv_bytes = frontier.timed_batch_decode(model, prompt, spec, new_tokens)
                rows.append({"method": spec, "path": path, "batch": batch, "length": length, "repeat": repeat,
                             "new_tokens": new_tokens, "decode_tok_s": round(batch * (new_tokens - 1) / seconds, 3),
                             "kv_bytes": kv_bytes})  # fmt: skip
                emit(rows[-1])
    return rows


@torch.inference_mode()
def step_costs(model, tokenizer, specs: list[str], length: int, steps: int, emit: Emit = print_row) -> list[dict]:
    """Per contender after a ``length``-token prompt: wall ms per decode step (``steps`` timed), tensor operations
    dispatched in one step, and on CUDA the kernels and GPU-busy ms per step (from the profiler). Specs the fused
    kernel serves are measured through it and through the torch path."""
    from torch.profiler import ProfilerActivity, profile

    from kvopt.api import build_cache
    from kvopt.eval.decoding import forward, shared_prefill, synchronize

    device, ids = model.device, frontier.prompt_ids(tokenizer, length - 2 * steps - 8)
    shared, rows = shared_prefill(model, ids), []
    for spec, path in ((spec, path) for spec in specs for path in (PATHS if spec in KERNEL_SPECS else ("fused",))):
        cache = build_cache(spec, model)
        cache.replay_prefill(shared.cache)
        token, position = int(shared.logits.argmax()), len(ids)

        def decode(count: int) -> None:
            nonlocal token, position
            with read_path(path):
                for _ in range(count):
                    token, position = int(forward(model, [token], cache, position).argmax()), position + 1

        decode(2)  # warm-up
        counter = OpCounter()
        with counter:
            decode(1)
        synchronize(device)
        began = time.perf_counter()
        decode(steps)
        synchronize(device)
        row = {"method": spec, "path": path, "length": length, "steps": steps,
               "ops_per_step": sum(counter.ops.values()),
               "top_ops": counter.ops.most_common(8),
               "wall_ms_per_step": round((time.perf_counter() - began) * 1e3 / steps, 3)}  # fmt: skip
        if device.type == "cuda":
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
                decode(steps)
            kernels = [e for e in profiled.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            row["kernels_per_step"] = round(sum(e.count for e in kernels) / steps, 1)
            row["busy_ms_per_step"] = round(sum(e.self_device_time_total for e in kernels) / 1e3 / steps, 3)
        rows.append(row)
        emit(row)
    return rows


def run_step(step: str, model, tokenizer, args, emit: Emit = print_row) -> list[dict]:
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
    if step == "batch":
        return frontier.measure_batch_decode(model, tokenizer, args.repeats, args.new_tokens, args.batch)
    if step == "kernel":
        return kernel_decode(model, tokenizer, args.length, args.new_tokens, args.repeats, emit)
    if step == "ops":
        from kvopt.models.info import ModelInfo

        specs = [*TWOBIT, *frontier.decode_methods(ModelInfo.from_config(model.config), args.length)[1:]]
        specs = args.ops_specs.split(",") if args.ops_specs else specs
        return step_costs(model, tokenizer, specs, args.length, args.ops_steps, emit)
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
        f"## On a GPU: the timed targets of #16 and #17, the fused quantized kernel ({first['device']})",
        "",
        opening("python benchmarks/accelerator.py --device cuda", row_dates(ROWS), ROWS),
        "",
        f"{MODEL} (fp32), {first['device']}, torch {first['torch']}, transformers {first['transformers']}; "
        "batch 1 unless a table says otherwise, eager attention through kvopt's caches, the GPU synchronized before each clock read; "
        "interleaved repeats, medians. The same code and prompts as the CPU sections above; on the CPU a decode "
        "step is bound by the weights and by arithmetic, here by kernel launches and memory traffic.",
        "",
    ]
    batch = by_step.get("batch", [{}])[0].get("batch")
    for title, step, key, base in (
        ("Decode, 2-bit caches", "twobit", "decode_tok_s", "kivi:bits=2"),
        ("Decode, RocketKV vs SnapKV at equal stored bytes", "rocket", "decode_tok_s", "full"),
        (f"Decode, {batch} different prompts together (tok/s over all rows)", "batch", "decode_tok_s", "full"),
    ):
        lines += _speed_table(title, by_step.get(step, []), key, base)
    lines += _kernel_table(by_step.get("kernel", []))
    lines += _ops_table(by_step.get("ops", []))
    for title, step in (("Prefill, FastKV vs SnapKV", "prefill"), ("Prefill, query-agnostic methods", "cost")):
        lines += _prefill_table(title, by_step.get(step, []))
    return "\n".join(lines) + "\n"


def _kernel_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    lines = [
        f"### Decode through the fused quantized kernel (after {first['length']} tokens, "
        f"{first['new_tokens']} decoded)",
        "", "The quantized parts read by one Triton kernel per layer (`kvopt/kernels/quantized_attention.py`) or "
        "by the torch path (`kvopt.kernels.disabled()`: dequantize, then attend); tok/s over all rows, medians.", "",
        "| batch | method | fused tok/s | torch path tok/s | fused vs torch | fused vs `full` | KV held |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for batch in dict.fromkeys(row["batch"] for row in rows):
        speeds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        held = {}
        for row in rows:
            if row["batch"] == batch:
                speeds[row["method"], row["path"]].append(row["decode_tok_s"])
                held[row["method"]] = row["kv_bytes"]
        median = {key: statistics.median(values) for key, values in speeds.items()}
        full = median.get(("full", "torch"))
        for spec in held:
            fused, torch_path = median.get((spec, "fused")), median.get((spec, "torch"))
            cells = [f"{fused:.1f}" if fused else "-", f"{torch_path:.1f}" if torch_path else "-",
                     f"{fused / torch_path:.2f}x" if fused and torch_path else "-",
                     f"{(fused or torch_path) / full:.2f}x" if full else "-"]  # fmt: skip
            lines.append(f"| {batch} | `{spec}` | {' | '.join(cells)} | {held[spec] / 1e6:.0f} MB |")
    return [*lines, "", *_notes(rows)]


def _ops_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    lines = [
        f"### What a decode step costs (after {first['length']} tokens, {first['steps']} steps)", "",
        "Wall time per step against the time the GPU was busy in it (the profiler's kernel time): where the wall "
        "time is several times the busy time, the step waits on the host launching kernels, not on the bytes it "
        "reads. Operations: tensor operations dispatched in one step (each at least one kernel).", "",
        "| method | wall ms/step | GPU busy ms/step | kernels/step | operations/step | most frequent operations |",
        "|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for row in rows:
        top = ", ".join(f"{name} {count}" for name, count in row["top_ops"][:5])
        busy, kernels = row.get("busy_ms_per_step", "-"), row.get("kernels_per_step", "-")
        path = " (torch path)" if row.get("path") == "torch" else ""
        lines.append(f"| `{row['method']}`{path} | {row['wall_ms_per_step']:.1f} | {busy} | {kernels} | "
                     f"{row['ops_per_step']} | {top} |")  # fmt: skip
    stopped = first.get("stopped")
    return [*lines, "", *([f"Stopped: {stopped}.", ""] if stopped else []), *_notes(rows)]


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
    return [*lines, "", *_notes(rows)]


def _notes(rows: list[dict]) -> list[str]:
    """The rows' notes (what a row measured that its table does not say), once each, under the table; and whether
    the step was stopped by its time limit before its last contender."""
    notes = dict.fromkeys(row["note"] for row in rows if row.get("note"))
    if any(row.get("complete") is False for row in rows):
        notes["the step was stopped by its time limit after these rows"] = None
    return [*(f"Note: {note}." for note in notes), *([""] if notes else [])]


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
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together (batch step)")
    parser.add_argument("--ops-steps", type=int, default=16, help="decode steps timed and profiled (ops step)")
    parser.add_argument("--ops-specs", help="comma-separated contenders of the ops step (default: twobit's, rocket's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    model, tokenizer = kvopt.load_model(device=device)
    stamp = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
             "model": MODEL, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    for step in args.steps.split(","):
        began, rows = time.perf_counter(), StepRows(step, stamp)
        rows.finish(run_step(step, model, tokenizer, args, rows.add))
        print(f"{step}: {time.perf_counter() - began:.0f} s", flush=True)
    print(render([json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main()
