"""The KV cache codec on the default model: bytes per token per encoding and method, speed, perplexity gap.

    python benchmarks/codec.py                      # ~5 min on 2 shared cores; rows replace the old ones
    python benchmarks/codec.py --methods full       # one method
    python benchmarks/codec.py --accuracy           # passkey / niah answered from saved caches (resumable)

A ~2,000-token prompt of real local text (:func:`kvopt.local_text.real_text`) is prefilled
once per method (``full``, ``snapkv:ratio=0.75``, ``kivi:bits=4``); the cache is encoded with
every codec (``raw``, ``int8``, ``int4``, ``cachegen``), decoded, and the next ``--held-out``
tokens of the same text are scored from the decoded cache (fed ``--chunk`` tokens at a time).
The perplexity gap of a lossy codec is relative to the ``raw`` (lossless) cache of the same
method. Sizes are whole files (header, positions, scales included); ``vs fp16`` compares with
the same file holding its floating keys/values in fp16 (the model runs fp32 on the CPU, so
``raw`` holds 4 bytes per element). Encode/decode times are medians of ``--repeats``, the
encodings interleaved, on one thread. Rows go to benchmarks/results/codec.jsonl; :func:`render`
writes the BENCHMARKS.md section.

``--accuracy`` runs the eval harness (:func:`kvopt.eval.runner.run_eval`) on passkey and niah
at 2,048 tokens: each prompt's context is prefilled once (shared by every contender), saved with
each encoding, loaded, and then the question is answered from the loaded cache (contenders
``saved:<encoding>:full``, next to ``full`` never saved). Per-sample rows go to
``benchmarks/results/codec_accuracy/eval.jsonl`` (resumable), their summary into the same rows file
(``kind: accuracy``), which the other runs keep.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvopt.models.forward import cache_kwargs
from sections import opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "codec.jsonl"
METHODS = ("full", "snapkv:ratio=0.75", "kivi:bits=4")
ENCODINGS = ("raw", "int8", "int4", "cachegen")
CONDITIONS = "1 torch thread, on 2 CPU cores shared with other jobs (contention): compare ratios, not absolute speeds"
ACCURACY = ROOT / "benchmarks" / "results" / "codec_accuracy"
ACCURACY_TASKS = ("passkey", "niah")


def float_kv_elements(cache, model) -> int:
    """Elements of the floating keys/values the codec may encode lossily (KIVI's packed codes excluded)."""
    from kvopt.codec.state import Dumper

    dumper = Dumper({id(m): name for name, m in model.named_modules()}, len(cache.layers))
    for index, layer in enumerate(cache.layers):
        dumper.layer(layer, index)
    return sum(t.numel() for t, role, _ in dumper.tensors.items if role is not None and t.is_floating_point())


@torch.inference_mode()
def held_out_nll(model, cache, held: torch.Tensor, chunk: int) -> float:
    """Mean negative log-likelihood of ``held[1:]`` fed after ``cache`` (which holds the prompt)."""
    total, count = 0.0, 0
    for start in range(0, held.numel() - 1, chunk):
        piece = held[start : start + chunk]
        targets = held[start + 1 : start + 1 + piece.numel()]
        logits = model(input_ids=piece[None], **cache_kwargs(model, cache), use_cache=True).logits[0, : targets.numel()]
        total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        count += targets.numel()
    return total / count


def delta_share(data: bytes) -> str:
    """How many lossily encoded key tensors of a file chained token deltas (cachegen keeps them where smaller)."""
    from kvopt.codec import container

    keys = [d for d in container.unpack(data, "benchmark")[0]["tensors"] if d.get("role") == "key"]
    return f"{sum(d['delta'] for d in keys)}/{len(keys)}"


def timed(function, repeats: int) -> tuple[object, float]:
    """``(result, median milliseconds)`` of ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        times.append((time.perf_counter() - started) * 1000)
    return result, statistics.median(times)


def run(methods: list[str], prompt_tokens: int, held_out: int, chunk: int, repeats: int) -> list[dict]:
    import kvopt
    from kvopt.codec import cache_bytes, cache_from_bytes
    from kvopt.local_text import real_text

    torch.set_num_threads(1)
    model, tokenizer = kvopt.load_model()
    text, source = real_text()
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0, : prompt_tokens + held_out]
    prompt, held = ids[:prompt_tokens], ids[prompt_tokens:]
    rows = []
    for method in methods:
        cache = kvopt.cache(method, model)
        started = time.perf_counter()
        with torch.inference_mode():
            model(prompt[None], **cache_kwargs(model, cache))
        prefill_ms = (time.perf_counter() - started) * 1000  # what loading a saved cache saves
        kv_fp16_saving = float_kv_elements(cache, model) * 2  # bytes fp32 keys/values would lose in fp16
        files, encode_ms, decode_ms = {}, {}, {}
        for _ in range(repeats):  # encodings interleaved, so a busy machine slows them alike
            for encoding in ENCODINGS:
                files[encoding], ms = timed(lambda: cache_bytes(cache, model, encoding), 1)
                encode_ms.setdefault(encoding, []).append(ms)
                _, ms = timed(lambda: cache_from_bytes(files[encoding], model), 1)
                decode_ms.setdefault(encoding, []).append(ms)
        raw_fp16 = len(files["raw"]) - kv_fp16_saving
        nll = {encoding: held_out_nll(model, cache_from_bytes(files[encoding], model)[0], held, chunk) for encoding in ENCODINGS}
        for encoding in ENCODINGS:
            size = len(files[encoding])
            row = {
                "method": method, "encoding": encoding, "prompt_tokens": prompt_tokens, "bytes": size,
                "bytes_per_token": size / prompt_tokens, "vs_raw": len(files["raw"]) / size, "vs_fp16": raw_fp16 / size,
                "encode_ms": statistics.median(encode_ms[encoding]), "decode_ms": statistics.median(decode_ms[encoding]),
                "prefill_ms": prefill_ms,
                "ppl": math.exp(nll[encoding]), "ppl_raw": math.exp(nll["raw"]),
                "ppl_gap": math.exp(nll[encoding] - nll["raw"]) - 1, "key_deltas": delta_share(files[encoding]), "held_out_tokens": held.numel() - 1, "chunk": chunk,
                "text": source, "model": "SmolLM2-135M-Instruct (fp32)", "repeats": repeats, "conditions": CONDITIONS,
                "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("method", "encoding", "bytes_per_token", "vs_fp16", "ppl_gap", "key_deltas")}), flush=True)
    return rows


def accuracy(length: int, samples: int) -> list[dict]:
    """Summary rows of passkey / niah answered from caches saved and loaded with each encoding (eval harness)."""
    from kvopt.eval.runner import EvalGrid, run_eval

    torch.set_num_threads(1)
    methods = ["full", *(f"saved:{encoding}:full" for encoding in ENCODINGS)]
    grid = EvalGrid(tasks=list(ACCURACY_TASKS), lengths=[length], methods=methods, depths=1, samples=samples)
    path = run_eval(grid, ACCURACY, progress=False)
    done = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for task in ACCURACY_TASKS:
        for method in methods:
            group = [row for row in done if (row["task"], row["method"], row["length"]) == (task, method, length)]
            rows.append({
                "kind": "accuracy", "task": task, "length": length, "method": method,
                "encoding": method.split(":")[1] if method.startswith("saved:") else "never saved",
                "samples": len(group), "score": statistics.fmean(row["score"] for row in group),
                "correct": sum(row["score"] == 1.0 for row in group), "model": group[0]["model"],
                "conditions": "1 torch thread; one shared lossless prefill per prompt, saved and loaded per encoding",
                "date": time.strftime("%Y-%m-%d"),
            })  # fmt: skip
            print(json.dumps({k: rows[-1][k] for k in ("task", "method", "samples", "score")}), flush=True)
    return rows


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section for the rows of :data:`ROWS` (sizes and perplexity; accuracy when measured)."""
    scores = [row for row in rows if row.get("kind") == "accuracy"]
    rows = [row for row in rows if row.get("kind") != "accuracy"]
    if not rows:
        return ""
    first = rows[0]
    commands = ["python benchmarks/codec.py", *(["python benchmarks/codec.py --accuracy"] if scores else [])]
    lines = [
        "## KV cache codec: `kvopt.save_cache` and `kvopt.load_cache`",
        "",
        opening(commands, row_dates(ROWS), ROWS),
        "",
        f"{first['model']}, a {first['prompt_tokens']:,}-token prompt of real local text ({first['text']}); the perplexity "
        f"gap is measured on the next {first['held_out_tokens']} tokens fed after the decoded cache ({first['chunk']} at a "
        "time), relative to the lossless `raw` file of the same method. Sizes are whole files (header, positions, "
        "scales included); `vs fp16` compares with the raw file holding its floating K/V in fp16. "
        f"Encode/decode: median of {first['repeats']}, {first['conditions']}.",
        "",
        "| method | encoding | bytes/token | vs raw | vs fp16 | encode ms | load ms (prefill ms) | ppl | gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['encoding']} | {row['bytes_per_token']:,.0f} | {row['vs_raw']:.2f}x | "
            f"{row['vs_fp16']:.2f}x | {row['encode_ms']:.0f} | {row['decode_ms']:.0f} ({row['prefill_ms']:,.0f}) | "
            f"{row['ppl']:.3f} | {row['ppl_gap'] * 100:+.2f}% |"
        )
    chained = sorted({row["key_deltas"] for row in rows if row["encoding"] == "cachegen" and not row["key_deltas"].endswith("/0")})
    lines += [
        "",
        "Load: `cache_from_bytes` (checks, cache rebuilt from its spec, tensors decoded); prefill: computing the same "
        "prompt instead. KIVI's packed codes are stored as they are (never re-quantized), so only its few "
        f"full-precision tokens and the entropy coder change its size. Key tensors for which cachegen kept token "
        f"deltas: {', '.join(chained)} (they compressed worse than the plain codes on this model's post-RoPE keys).",
    ]
    return "\n".join(lines + render_accuracy(scores)) + "\n"


def render_accuracy(rows: list[dict]) -> list[str]:
    """The accuracy table: one row per encoding, a column per task (mean score, samples)."""
    if not rows:
        return []
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    cell = {(row["task"], row["method"]): row for row in rows}
    lines = [
        "",
        f"Accuracy after a save and a load ({rows[0]['model']}, {rows[0]['length']:,}-token prompts, "
        f"`python benchmarks/codec.py --accuracy`, measured {rows[0]['date']}): the context is prefilled once, saved "
        "with the encoding, loaded, then the question is asked and answered greedily (the eval harness, "
        "query-agnostic; per-sample rows in `benchmarks/results/codec_accuracy/eval.jsonl`). Score: mean of the "
        "tasks' scores (1 = the needle's value recalled).",
        "",
        "| encoding | " + " | ".join(tasks) + " |",
        "|---|" + "---:|" * len(tasks),
    ]
    for method in methods:
        scores = [cell[(task, method)] for task in tasks]
        lines.append(f"| {scores[0]['encoding']} (`{method}`) | "
                     + " | ".join(f"{row['score']:.2f} ({row['correct']}/{row['samples']})" for row in scores) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated method specs")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--held-out", type=int, default=513, help="tokens scored after the prompt (+1)")
    parser.add_argument("--chunk", type=int, default=16, help="tokens per forward while scoring")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy", action="store_true", help="passkey / niah from saved caches instead")
    parser.add_argument("--samples", type=int, default=8, help="samples per task (--accuracy)")
    parser.add_argument("--out", type=Path, default=ROWS)
    args = parser.parse_args()
    kept = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] if args.out.exists() else []
    if args.accuracy:  # replaces the accuracy rows, keeps the others (and the other way round)
        kept = [row for row in kept if row.get("kind") != "accuracy"] + accuracy(args.prompt_tokens, args.samples)
    else:
        rows = run(args.methods.split(","), args.prompt_tokens, args.held_out, args.chunk, args.repeats)
        kept = rows + [row for row in kept if row.get("kind") == "accuracy"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in kept))
    print(render(kept))


if __name__ == "__main__":
    main()
