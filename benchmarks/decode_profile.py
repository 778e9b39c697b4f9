"""A decode step of the serving engine set against this CPU's limits: where its time goes, op by op, and how far
each kind of op runs from what the core can do (issue 36).

    python benchmarks/decode_profile.py                       # 16 and 64 sequences, default model, 1 thread
    python benchmarks/decode_profile.py --dtype auto --sequences 16   # bf16 where the CPU computes it
    python benchmarks/decode_profile.py --sequences 4 --steps 2 --results /tmp/profile   # a smoke run (a minute)

The limits are measured in the same process, just before: the core's fp32 matrix-multiply rate (a 2048 x 2048
``torch.mm``, the best torch's BLAS does here) and its read bandwidth (``sum`` over 512 MB). Then ``--sequences``
requests of 100-200 tokens of local real text (serving.py's prompts) are prefilled by ``kvopt.LLM`` and, once
every one is decoding, ``--steps`` decode steps run under ``torch.profiler`` with input shapes. Each op's self time
is put in a group: the layers' weight matmuls, the output projection (the vocabulary matmul), attention (the
flash kernel and the log-sum-exp parts), everything else torch runs (norms, RoPE, activations, copies, indexing),
and what the step spends outside torch ops (Python: scheduling, the per-step batch, the model's modules; the
profiler's own cost per op inflates the small ops and this, so shares are of the profiled step). For
the matmuls and attention, FLOPs come from the shapes and bytes from what they must read (weights or keys and
values), so each row says its GFLOP/s and GB/s and their share of the measured limits.

Rows: ``benchmarks/results/decode_profile.jsonl`` (``--results``); a run's rows replace those of the same
sequence count and dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import serving
import torch
from sections import conditions_line, opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "decode_profile.jsonl"
#: Op groups, in the order the table lists them.
GROUPS = ("weight matmuls", "output projection", "attention", "other torch ops", "outside torch ops")
MATMULS = {"aten::mm", "aten::addmm"}
#: kvopt's few-rows linear (kvopt.kernels.cpu; int8 weights, and a decode step's fp32/bf16 rows): ``[[M, K], [N, K], ...]``.
ROWS_LINEAR = "kvopt_cpu::linear_rows"
#: A bf16 linear packed for oneDNN (kvopt.models.packed_linear): ``[[M, K], [N, K], bias, ...]``.
PACKED_LINEAR = "mkldnn::_linear_pointwise"
#: The CPU flash kernel (the decode path calls it directly), whose shapes give its FLOPs and bytes.
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
#: Attention's other ops: SDPA's dispatcher and the log-sum-exp parts (their self time only; no FLOPs counted).
#: kvopt's CPU decode kernel (kvopt.kernels.cpu): its shapes show the pool, not what it read (see ``profile``).
DECODE_KERNEL = "kvopt_cpu::decode_attention"
ATTENTION = {FLASH, DECODE_KERNEL, "aten::scaled_dot_product_attention", "aten::bmm", "aten::logsumexp", "aten::_softmax"}


def limits(dtype: torch.dtype = torch.float32, repeats: int = 5, read_mb: int = 512) -> dict[str, float]:
    """This core's matmul rate in ``dtype`` (GFLOP/s, a 2048-square mm) and read bandwidth (GB/s, a sum over
    ``read_mb``)."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    big = torch.randn(read_mb * 1024 * 1024 // 4)

    def best(work) -> float:
        work()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    return {"matmul_gflops": round(2 * 2048**3 / best(lambda: a @ b) / 1e9, 1),
            "read_gbs": round(big.numel() * 4 / best(big.sum) / 1e9, 1)}  # fmt: skip


def classify(name: str, shapes: list, vocab: int, element: int = 4, weight_element: int | None = None) -> tuple[str, float, float]:
    """``(group, FLOPs, bytes read)`` of one call of an op with these input shapes, ``element`` bytes per value
    (``weight_element`` per weight, default the same; FLOPs and bytes only where they mean something: matmuls and
    the flash kernel)."""
    if name in MATMULS or name == PACKED_LINEAR or name == ROWS_LINEAR:
        if name in MATMULS:  # mm: [[M, K], [K, N]]; addmm: [[N], [M, K], [K, N], [], []] (bias, then beta and alpha)
            (rows, inner), (_, cols) = [shape for shape in shapes if len(shape) == 2][-2:]
        else:  # the packed weight keeps nn.Linear's [N, K]
            (rows, inner), (cols, _) = shapes[0], shapes[1]
        group = "output projection" if cols == vocab else "weight matmuls"
        return group, 2.0 * rows * inner * cols, float((weight_element or element) * inner * cols)
    if name == FLASH:  # query [B, H, q, D] (grouped queries folded: H is the KV heads), keys and values [B, H, k, D]
        (batch, heads, queries, dim), (_, kv_heads, keys, _) = shapes[0], shapes[1]
        return "attention", 4.0 * batch * heads * queries * keys * dim, 2.0 * element * batch * kv_heads * keys * dim
    if name in ATTENTION:
        return "attention", 0.0, 0.0
    return "other torch ops", 0.0, 0.0


def profile(sequences: int, steps: int, kv_memory: str, dtype: str, weights: str | None = None) -> dict:
    """Time ``steps`` decode steps of ``sequences`` running requests and split each step by op group."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kvopt.engine import LLM, SamplingParams

    llm = LLM(kv_memory=kv_memory, max_num_seqs=max(sequences, 1), dtype=dtype, weights=weights)
    core = llm.engine
    prompts = serving.real_prompts(llm.tokenizer, sequences, 100, 200, seed=3)
    params = SamplingParams(max_tokens=steps * 4 + 64, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, params)
    scheduler = core.scheduler
    while scheduler.waiting or any(seq.num_output_tokens == 0 for seq in scheduler.running):
        core.step()
    for _ in range(2):  # warm: every sequence decoding, buffers grown
        core.step()
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        wall.append(time.perf_counter() - start)
    context = statistics.mean(len(seq) for seq in scheduler.running)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        profiled = (time.perf_counter() - start) / steps
    vocab = core.model.config.get_text_config().vocab_size
    element = core.model.dtype.itemsize
    totals = {group: {"seconds": 0.0, "flops": 0.0, "bytes": 0.0, "calls": 0} for group in GROUPS}
    for event in profiler.key_averages(group_by_input_shape=True):
        group, flops, read = classify(event.key, event.input_shapes, vocab, element, 1 if weights == "int8" else None)
        total = totals[group]
        total["seconds"] += event.self_cpu_time_total / 1e6 / steps
        total["flops"] += flops * event.count / steps
        total["bytes"] += read * event.count / steps
        total["calls"] += event.count / steps
    kernel_calls = sum(event.count for event in profiler.key_averages() if event.key == DECODE_KERNEL) / steps
    if kernel_calls:  # one call per layer reads every decoding sequence's keys and values once
        config = core.model.config.get_text_config()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        keys = sum(len(seq) for seq in scheduler.running) * kernel_calls
        totals["attention"]["flops"] += 4.0 * heads * keys * dim
        totals["attention"]["bytes"] += 2.0 * element * kv_heads * keys * dim
    inside = sum(total["seconds"] for total in totals.values())
    totals["outside torch ops"]["seconds"] = max(0.0, profiled - inside)
    step_seconds = statistics.median(wall)
    return {"step": "decode_profile", "sequences": sequences, "context_tokens": round(context), "steps": steps,
            "step_ms": round(1000 * step_seconds, 1), "tok_s": round(sequences / step_seconds, 2),
            "profiled_step_ms": round(1000 * profiled, 1), "threads": torch.get_num_threads(),
            "dtype": str(core.model.dtype).removeprefix("torch."), "weights": weights or "auto",
            "groups": {group: {"ms": round(1000 * total["seconds"], 2), "gflop": round(total["flops"] / 1e9, 4),
                               "mb": round(total["bytes"] / 1e6, 2), "calls": round(total["calls"], 1)}
                       for group, total in totals.items()}}  # fmt: skip


def setting(row: dict) -> tuple:
    """What a row measured: its sequence count, dtype and weights (rows from before these were recorded: float32,
    auto)."""
    return row["sequences"], row.get("dtype", "float32"), row.get("weights", "auto")


def save(path: Path, rows: list[dict]) -> None:
    """Append ``rows``, replacing earlier rows of the same :func:`setting`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    measured = {setting(row) for row in rows}
    kept = [line for line in path.read_text().splitlines() if line.strip() and setting(json.loads(line)) not in measured] \
        if path.exists() else []  # fmt: skip
    path.write_text("".join(f"{line}\n" for line in [*kept, *(json.dumps(row) for row in rows)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", default="16,64", help="requests decoding together, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed, then as many profiled")
    parser.add_argument("--kv-memory", default="1GB")
    parser.add_argument("--dtype", default="fp32", help="the model's and KV's dtype: fp32, bf16 or auto (kvopt.LLM's)")
    parser.add_argument("--weights", default=None, help="kvopt.LLM's weights: int8 (linears in int8, computing in --dtype)")
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated with the rows)")
    parser.add_argument("--results", type=Path, default=ROWS.parent)
    args = parser.parse_args()
    from kvopt.models.cpu_features import model_dtype

    measured = limits(model_dtype(args.dtype, None) or torch.float32)
    print(measured, flush=True)
    rows = []
    for count in (int(part) for part in args.sequences.split(",")):
        row = profile(count, args.steps, args.kv_memory, args.dtype, args.weights) | {"limits": measured, "date": time.strftime("%Y-%m-%d"),
                                                           "torch": torch.__version__}  # fmt: skip
        if args.conditions:
            row["conditions"] = args.conditions
        rows.append(row)
        print(json.dumps(row), flush=True)
    save(args.results / ROWS.name, rows)
    print(render(rows))


# -- the BENCHMARKS.md section ------------------------------------------------------------------
def render(rows: list[dict]) -> str:
    """Markdown for the committed rows (``committed_section`` in benchmarks/run.py)."""
    threads = "/".join(str(count) for count in sorted({row["threads"] for row in rows}))
    lines = [f"## A decode step against this CPU's limits ({threads} thread)", "",
             opening("python benchmarks/decode_profile.py [--dtype auto]", row_dates(ROWS), ROWS), "",
             "The default model, `full` KV, prompts of 100-200 tokens; each op's self time per decode step, from "
             "`torch.profiler`. The limits are measured in each table's own run, just before it: the matmul rate of a "
             "2048-square `torch.mm` in the model's dtype and the read bandwidth of a `sum` over 512 MB. A share of a limit is the "
             "op's rate over it: the matmuls are bounded by arithmetic, attention by the keys and values it reads.",
             ""]  # fmt: skip
    for row in sorted(rows, key=setting):
        limit = row["limits"]
        lines += [f"### {row['sequences']} sequence{'s' if row['sequences'] != 1 else ''} decoding in {setting(row)[1]}{' with int8 weights' if setting(row)[2] == 'int8' else ''} (context ~{row['context_tokens']} tokens): "
                  f"{row['step_ms']:.0f} ms per step, {row['tok_s']:.1f} tok/s ({row['profiled_step_ms']:.0f} ms "
                  "under the profiler, whose cost per op lands mostly on the small ops)", "",
                  f"Limits in this run: matmul {limit['matmul_gflops']} GFLOP/s, read {limit['read_gbs']} GB/s; "
                  f"the model in {row.get('dtype', 'float32')}.", "",
                  "| ops | ms per step | share of the step | calls | GFLOP/s | of the matmul limit | GB/s read | "
                  "of the bandwidth |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        total = sum(group["ms"] for group in row["groups"].values())
        for name in GROUPS:
            group = row["groups"][name]
            seconds = group["ms"] / 1000
            rate = f"{group['gflop'] / seconds:.1f} | {group['gflop'] / seconds / limit['matmul_gflops']:.0%}" \
                if group["gflop"] and seconds else "– | –"  # fmt: skip
            read = f"{group['mb'] / 1000 / seconds:.2f} | {group['mb'] / 1000 / seconds / limit['read_gbs']:.0%}" \
                if group["mb"] and seconds else "– | –"  # fmt: skip
            calls = f"{group['calls']:.0f}" if name != "outside torch ops" else "–"
            lines.append(f"| {name} | {group['ms']:.1f} | {group['ms'] / total:.0%} | {calls} | {rate} | {read} |")
        lines += ["", _reading(row, total)]
        lines += conditions_line([row])
        lines.append("")
    return "\n".join(lines)


def _reading(row: dict, total: float) -> str:
    """One sentence on where the step's time goes, from the row."""
    groups, limit = row["groups"], row["limits"]["matmul_gflops"]
    matmuls = [groups[name] for name in ("weight matmuls", "output projection")]
    seconds = sum(group["ms"] for group in matmuls) / 1000
    rate = sum(group["gflop"] for group in matmuls) / seconds if seconds else 0.0
    small = groups["other torch ops"]["ms"] + groups["outside torch ops"]["ms"]
    read = sum(group["mb"] for group in matmuls) / 1000 / seconds if seconds else 0.0
    return (f"The matmuls take {1000 * seconds / total:.0%} of the profiled step at {rate:.1f} GFLOP/s, "
            f"{rate / limit:.0%} of what a large matmul reaches on this core, reading their weights at {read:.1f} GB/s "
            f"({read / row['limits']['read_gbs']:.0%} of the bandwidth); attention "
            f"{groups['attention']['ms'] / total:.0%}; the many small ops and Python {small / total:.0%}{_profiler_cost(row)}.")


def _profiler_cost(row: dict) -> str:
    """What profiling added to the step (within the step's own spread when it reads as nothing or less)."""
    added = row["profiled_step_ms"] - row["step_ms"]
    if added < 0.5:
        return " (the profiled step took no longer than the unprofiled one, within their spread)"
    return f" (the profiler's own cost, {added:.0f} ms per step, lands mostly there)"


if __name__ == "__main__":
    main()
