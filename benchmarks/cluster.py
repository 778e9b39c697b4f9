"""The cluster's routers side by side: KV-aware vs Ray Serve's power of two choices vs round robin (issue 37).

    python benchmarks/cluster.py            # the full run: default model, 2 replicas, 8 system prompts of ~1,000
                                            # tokens x 16 questions, shuffled, 1 request/s; rows into
                                            # benchmarks/results/cluster.jsonl
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


def decision_p99(url: str) -> float | None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples.get("kvopt:router_decision_p99_seconds")


def run(router: str, model: str | None, requests: list, args, url: str) -> dict:
    from ray import serve

    from kvopt.cluster import ClusterSpec, build
    from kvopt.serving import ServerSettings

    engine_args = {"model": model, "kv_memory": args.kv_memory, "max_num_seqs": args.max_num_seqs}
    spec = ClusterSpec(replicas=args.replicas, router=router)
    serve.run(build(engine_args, ServerSettings("bench", max_waiting=len(requests)), spec, args.max_num_seqs),
              name="kvopt", route_prefix="/")  # fmt: skip
    try:
        done = asyncio.run(drive(url, "bench", requests, args.rate, args.max_tokens))
        decision = decision_p99(url) if router == "kv" else None
    finally:
        serve.delete("kvopt")
    ttft = sorted(row["ttft"] for row in done)
    return {
        "router": router, "requests": len(done), "replicas": args.replicas, "rate": args.rate,
        "hit_rate": sum(r["cached"] for r in done) / sum(r["prompt"] for r in done),
        "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "output_tok_s": sum(r["output"] for r in done) / max(r["end"] for r in done),
        "router_decision_p99_s": decision,
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
    parser.add_argument("--out", type=Path, default=ROWS)
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
        for router in ROUTERS:
            rows.append(run(router, model, requests, args, f"http://127.0.0.1:{port}") | {"tiny": args.tiny})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if not args.tiny:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as sink:
            sink.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    sys.exit(main())
