"""The cluster's routers side by side: KV-aware vs Ray Serve's power of two choices vs round robin (issue 37).

    python benchmarks/cluster.py            # the full run: default model, 2 replicas, 8 system prompts of ~1,000
                                            # tokens x 16 questions, shuffled, 1 request/s; rows into
                                            # benchmarks/results/cluster.jsonl
    python benchmarks/cluster.py --replicas 1   # the same workload on one replica (one router: all are the same)
    python benchmarks/cluster.py --tiny     # a tiny random model, 2 x 3 requests: checks the step works

For each router the same application is deployed anew on a local Ray cluster (empty pools), and the same shuffled
requests arrive at a fixed rate, each streamed through the real ``openai`` client. Per router: the prefix-cache hit
rate (prompt tokens served from a replica's pool, ``usage.prompt_tokens_details.cached_tokens``, over all prompt
tokens), TTFT p50/p99 as the client sees it, output tokens per second over the run, and the router's own time per
decision (``kvopt:router_decision_p99_seconds``, KV-aware only). No KV tier: hits come from the replicas' own pools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sections import conditions_line, opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "cluster.jsonl"
ROUTERS = ("kv", "power_of_two", "round_robin")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_model_folder() -> str:
    """A tiny random llama with the default model's tokenizer, saved once (the test suite's tiny model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvopt.models import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    folder = tempfile.mkdtemp(prefix="kvopt-cluster-bench-")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def workload(tokenizer, systems: int, questions: int, system_tokens: int, seed: int = 0) -> list[list[dict]]:
    """``systems`` system prompts of about ``system_tokens`` tokens of real text, ``questions`` questions each,
    shuffled: chat messages per request."""
    from kvopt.local_text import real_text

    words = " ".join(real_text()).split()
    per_word = max(1.0, len(tokenizer(" ".join(words[:400])).input_ids) / 400)
    span = int(system_tokens / per_word)
    requests = []
    for s in range(systems):
        system = f"You are assistant {s}. " + " ".join(words[s * span : (s + 1) * span])
        for q in range(questions):
            question = f"Question {q}: what does paragraph {q % 7 + 1} say about item {s * questions + q}?"
            requests.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    random.Random(seed).shuffle(requests)
    return requests


async def drive(url: str, model: str, requests: list[list[dict]], rate: float, max_tokens: int) -> list[dict]:
    """Every request streamed at ``rate`` per second; per request its TTFT, tokens and cached tokens."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1800)

    async def one(messages: list[dict], delay: float) -> dict:
        await asyncio.sleep(delay)
        start, first, usage = time.perf_counter(), None, None
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})  # fmt: skip
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            usage = chunk.usage or usage
        return {"ttft": (first or time.perf_counter()) - start, "prompt": usage.prompt_tokens,
                "cached": usage.prompt_tokens_details.cached_tokens, "output": usage.completion_tokens,
                "end": time.perf_counter()}  # fmt: skip

    start = time.perf_counter()
    done = await asyncio.gather(*[one(messages, i / rate) for i, messages in enumerate(requests)])
    for row in done:
        row["end"] -= start
    return done


def decision_times(url: str) -> dict[str, float | None]:
    """The KV-aware router's time per decision from the ingress's ``/metrics``: wall clock and CPU, p50 and p99."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {f"router_{name}_p{quantile}_s": samples.get(f"kvopt:router_{name}_p{quantile}_seconds")
            for name in ("decision", "decision_cpu") for quantile in (50, 99)}  # fmt: skip


def run(router: str, model: str | None, requests: list, args, url: str) -> dict:
    from ray import serve

    from kvopt.cluster import ClusterSpec, build
    from kvopt.serving import ServerSettings

    engine_args = {"model": model, "kv_memory": args.kv_memory, "max_num_seqs": args.max_num_seqs,
                   "max_model_len": args.max_model_len}  # fmt: skip
    spec = ClusterSpec(replicas=args.replicas, router=router)
    serve.run(build(engine_args, ServerSettings("bench", max_waiting=len(requests)), spec, args.max_num_seqs),
              name="kvopt", route_prefix="/")  # fmt: skip
    try:
        done = asyncio.run(drive(url, "bench", requests, args.rate, args.max_tokens))
        decisions = decision_times(url) if router == "kv" else {}
    finally:
        serve.delete("kvopt")
    ttft = sorted(row["ttft"] for row in done)
    return {
        "router": router, "requests": len(done), "replicas": args.replicas, "rate": args.rate,
        "hit_rate": sum(r["cached"] for r in done) / sum(r["prompt"] for r in done),
        "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "output_tok_s": sum(r["output"] for r in done) / max(r["end"] for r in done),
        **decisions, "systems": args.systems, "questions": args.questions, "system_tokens": args.system_tokens,
        "max_tokens": args.max_tokens, "kv_memory": args.kv_memory, "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, 2 x 3 requests (checks the step)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-memory", default="1GB")
    parser.add_argument("--max-model-len", type=int, default=2048, help="each engine's context (the prompts need "
                        "~1,100 tokens; a pool must hold one sequence of this length)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROWS)
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated with the rows)")
    args = parser.parse_args()
    if args.tiny:
        args.systems, args.questions, args.system_tokens, args.rate, args.max_tokens = 2, 3, 200, 4.0, 8
        args.kv_memory = "32MB"
    import ray
    from ray import serve

    from kvopt.models import load_tokenizer

    model = tiny_model_folder() if args.tiny else None
    requests = workload(load_tokenizer(model), args.systems, args.questions, args.system_tokens)
    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for router in ROUTERS if args.replicas > 1 else ROUTERS[-1:]:  # one replica: every router is the same
            row = run(router, model, requests, args, f"http://127.0.0.1:{port}") | {"tiny": args.tiny}
            rows.append(row | ({"conditions": args.conditions} if args.conditions else {}))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if not args.tiny:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            sink.writelines(json.dumps(row) + "\n" for row in rows)


def render(rows: list[dict]) -> str:
    """Markdown for the committed rows (``committed_section`` in benchmarks/run.py): the latest run per pool size and
    replica count, then the issue's targets read from each pool size's two-replica rows."""
    latest: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        runs = latest.setdefault((row.get("kv_memory", "1GB"), row["replicas"]), [])
        if any(seen["router"] == row["router"] for seen in runs):  # a later run of the same setting replaces it
            runs.clear()
        runs.append(row)
    first = rows[-1]
    lines = ["## On a cluster: KV-aware routing across engine replicas (Ray Serve)", "",
             opening(["python benchmarks/cluster.py [--kv-memory 256MB]", "python benchmarks/cluster.py --replicas 1"],
                     row_dates(ROWS), ROWS), "",
             f"A multi-tenant workload on a local Ray cluster: {first['systems']} system prompts of about "
             f"{first['system_tokens']:,} tokens of real text x {first['questions']} questions each, shuffled, arriving "
             f"at {first['rate']:g} request/s, each streamed through the real `openai` client with greedy decoding "
             f"and {first['max_tokens']} new tokens; the default model, one engine per replica (1 CPU, 1 torch thread). "
             "Each router gets a fresh deployment (empty pools) and the same requests. Hit rate: prompt tokens the "
             "serving replica had in its pool (`cached_tokens`) over all prompt tokens; no KV tier, so a hit is the "
             "router's doing. A 1 GB pool holds every system prompt on every replica; a 256 MB pool about half of "
             "them. Router time: the KV-aware router's own time per decision (its `/metrics`), wall clock and the CPU "
             "time of its thread (wall time includes the moments the OS gives the core to the replicas).", "",
             "| pool per replica | replicas | router | requests | prefix-cache hit rate | TTFT p50 | TTFT p99 | "
             "output tok/s | router p50 / p99 (wall) | router p99 (CPU) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (memory, replicas), runs in sorted(latest.items(), key=lambda item: (-_bytes(item[0][0]), -item[0][1])):
        for row in runs:
            wall = "–" if row.get("router_decision_p99_s") is None else \
                f"{_ms(row.get('router_decision_p50_s'))} / {_ms(row['router_decision_p99_s'])}"  # fmt: skip
            lines.append(f"| {memory} | {replicas} | {row['router'] if replicas > 1 else '(one replica)'} | "
                         f"{row['requests']} | {row['hit_rate']:.0%} | {row['ttft_p50']:.2f} s | {row['ttft_p99']:.2f} s "
                         f"| {row['output_tok_s']:.1f} | {wall} | {_ms(row.get('router_decision_cpu_p99_s'))} |")  # fmt: skip
    for (memory, replicas), runs in latest.items():
        if replicas == 2:
            lines += _reading(memory, runs, latest.get((memory, 1), []))
    best = max(row["output_tok_s"] for row in rows if row["replicas"] == 2)
    lines += ["", f"The workload asks {first['rate'] * first['max_tokens']:g} new tokens/s ({first['rate']:g} request/s x "
              f"{first['max_tokens']}); the two replicas made at most {best:.1f}. So TTFT is mostly time spent queued, and a "
              "router that saves prefill work shortens the queue for every request after it."]  # fmt: skip
    lines += conditions_line(rows)
    return "\n".join([*lines, ""])


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.2f} ms"


def _bytes(memory: str) -> float:
    import torch

    from kvopt.engine.config import parse_memory

    return parse_memory(memory, torch.device("cpu"))


def _reading(memory: str, two: list[dict], one: list[dict]) -> list[str]:
    """The targets of issue 37, read from one pool size's two-replica rows (and its one-replica row, if any)."""
    by_router = {row["router"]: row for row in two}
    kv, p2c = by_router.get("kv"), by_router.get("power_of_two")
    if not (kv and p2c):
        return []
    hits = kv["hit_rate"] / p2c["hit_rate"] if p2c["hit_rate"] else float("inf")
    ttft = p2c["ttft_p50"] / kv["ttft_p50"]
    line = (f"{memory} pools, KV-aware vs power of two choices: **{hits:.2f}x the hit rate** (target >= 1.8x: "
            f"{'holds' if hits >= 1.8 else 'does not hold'}) and **{ttft:.1f}x lower TTFT p50** (target >= 2x: "
            f"{'holds' if ttft >= 2 else 'does not hold'}).")  # fmt: skip
    cpu, wall = kv.get("router_decision_cpu_p99_s"), kv.get("router_decision_p99_s")
    if cpu is not None or wall is not None:
        met = [f"{name} {seconds * 1000:.2f} ms ({'holds' if seconds < 0.002 else 'does not hold'})"
               for name, seconds in (("CPU", cpu), ("wall clock", wall)) if seconds is not None]  # fmt: skip
        line += f" The router's p99 per decision (target < 2 ms): {', '.join(met)}."
    if one:
        line += (f" Two replicas on this machine's two cores give {kv['output_tok_s'] / one[0]['output_tok_s']:.2f}x "
                 "one replica's output tok/s: each replica is one core, so two is the most this machine allows.")
    return ["", line]


if __name__ == "__main__":
    sys.exit(main())
