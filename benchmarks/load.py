"""Load test of `kvopt serve` over loopback: many concurrent streaming clients, mixed prompt lengths.

    python benchmarks/load.py            # 200 clients: kvopt full and snapkv:ratio=0.5, transformers serve (~15 min)
    python benchmarks/load.py --systems "kvopt:full;transformers" --clients 16

Each system is a server subprocess on a free loopback port (`kvopt serve --kv-method SPEC [--dtype]`,
`transformers serve` on the same model folder, with or without its continuous batching, or llama.cpp's
`llama-server` on the default model's GGUF or its F16 re-type, `--llama-parallel` slots) with
`--threads` CPU threads. Once `/health` answers and a first request has run, every client sends
one streamed `/v1/completions` request at once (real text, `--prompt-tokens` long, greedy,
`max_tokens` each, usage requested) and reads it to the end. Per system: lost responses
(transport error, non-200 status) and malformed ones (an event that is not `data: <JSON>`, an
error event, no usage, more text events than tokens; a stream ending without `data: [DONE]` is
counted apart, as OpenAI's client accepts it), the server's RSS (its process tree) idle before,
peak during and idle after the load, TTFT and inter-token latency percentiles as the clients see
them, and output tokens per second over the whole run. A server that refuses its settings is a
row marked not run, one that dies a row marked failed, each with its last log line.

Rows go to benchmarks/results/load.jsonl (a row replaces the previous one of the same system and load);
benchmarks/run.py turns them into the BENCHMARKS.md section (`section()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from sections import opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "load.jsonl"
SYSTEMS = "kvopt:full;kvopt:snapkv:ratio=0.5;transformers;transformers-cb"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(system: str, model_dir: Path, port: int, args) -> list[str]:
    """The command line of ``system``: ``kvopt:SPEC``, ``transformers``/``transformers-cb`` or
    ``llama-server:WEIGHTS``, each on ``port`` with ``--threads`` CPU threads."""
    if system.startswith("transformers"):  # "transformers-cb": with its continuous batching
        executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
        batching = ["--continuous-batching"] if system == "transformers-cb" else []
        return [executable, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *batching]
    if system.startswith("llama-server:"):
        return llama_server_command(system.removeprefix("llama-server:"), port, args)
    spec = system.removeprefix("kvopt:")
    dtype = ["--dtype", args.dtype] if args.dtype else []
    return [sys.executable, "-m", "kvopt.cli.main", "serve", "--model", str(model_dir), "--served-model-name",
            str(model_dir), "--port", str(port), "--kv-method", spec, "--kv-memory", args.kv_memory,
            "--max-waiting", str(args.clients), "--no-access-log", *dtype]  # fmt: skip


def llama_server_command(weights: str, port: int, args) -> list[str]:
    """llama.cpp's ``llama-server`` on the default model's GGUF (``Q4_1``) or its F16 re-type: ``--llama-parallel``
    slots sharing one unified KV cache (``--llama-kv`` cells) with room for every slot's longest request, continuous
    batching (its default), flash attention as it decides (on for a quantized KV cache)."""
    from llamacpp import weight_files

    binary = args.llama_server or shutil.which("llama-server")
    if not binary:
        raise SystemExit("no llama-server binary: build it from llama.cpp (cmake -DLLAMA_BUILD_SERVER=ON ... "
                         "--target llama-server) and pass --llama-server PATH or put it on PATH")  # fmt: skip
    (path,) = weight_files(weights).values()
    context = args.llama_parallel * (args.prompt_tokens[1] + args.max_tokens + 16)
    return [binary, "--model", str(path), "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
            "--threads-batch", str(args.threads), "--parallel", str(args.llama_parallel), "--ctx-size", str(context),
            "--kv-unified", "--cache-type-k", args.llama_kv, "--cache-type-v", args.llama_kv,
            "--flash-attn", "on" if args.llama_kv != "f16" else "auto", "--no-webui"]  # fmt: skip


def tree_rss(process: psutil.Process) -> int:
    """Resident bytes of the server and its children."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


class RssSampler(threading.Thread):
    """The server's RSS every 100 ms while the load runs (its peak)."""

    def __init__(self, process: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.process, self.peak, self.stopped = process, tree_rss(process), threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.peak = max(self.peak, tree_rss(self.process))


async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: when each text event arrived, usage, and what (if anything) went wrong."""
    sent, times, usage, done, problem = time.perf_counter(), [], None, False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"lost": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == line or done:
                    problem = problem or f"unexpected line {line[:80]!r}"
                elif data == "[DONE]":
                    done = True
                else:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        problem = problem or f"error event {data[:200]}"
                    usage = chunk.get("usage") or usage
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(time.perf_counter())
    except (httpx.HTTPError, OSError) as error:
        return {"lost": f"{type(error).__name__}: {error}"}
    except json.JSONDecodeError as error:
        return {"malformed": f"bad JSON: {error}"}
    tokens = (usage or {}).get("completion_tokens", 0)
    if problem is None and (not tokens or len(times) > tokens):
        problem = f"usage {usage} for {len(times)} text events"
    if problem:
        return {"malformed": problem}
    return {"sent": sent, "times": times, "tokens": tokens, "done": done}


async def run_load(url: str, bodies: list[dict], timeout: float) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, body) for body in bodies))
        return results, time.perf_counter() - started


def wait_healthy(url: str, process: subprocess.Popen, log, timeout: float) -> str | None:
    """None once /health answers 200; else why not (the server's last output line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return exit_reason(process, log)
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"no healthy /health within {timeout:.0f} s"


def stop_server(process: subprocess.Popen) -> None:
    """Ask the server to stop (SIGTERM: open requests get their shutdown time), kill it after a minute."""
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def exit_reason(process: subprocess.Popen, log) -> str:
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    return f"the server exited with {process.returncode}: {lines[-1] if lines else 'no output'}"


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else None  # noqa: E731
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


def measure(system: str, model_dir: Path, prompts: list[str], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = {"system": system, "clients": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens": "-".join(map(str, args.prompt_tokens)),
            "threads": args.threads, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if system.startswith("kvopt:"):
        base |= {"kv_memory": args.kv_memory, "dtype": args.dtype}
    if system.startswith("llama-server:"):
        base |= {"parallel": args.llama_parallel, "kv": args.llama_kv}
    extra = {} if system.startswith("transformers") else {"ignore_eos": True}
    bodies = [{"model": str(model_dir), "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}} | extra for prompt in prompts]  # fmt: skip
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(server_command(system, model_dir, port, args), stdout=log, stderr=subprocess.STDOUT,
                                   text=True, env=env)  # fmt: skip
        try:
            problem = wait_healthy(url, process, log, args.start_timeout)
            if problem:
                return base | {"status": "not run", "reason": problem}
            server = psutil.Process(process.pid)
            warm = {key: value for key, value in bodies[0].items() if not key.startswith("stream")}
            try:  # the first request's set-up stays out of the timing
                httpx.post(url + "/v1/completions", json=warm, timeout=args.timeout)
            except httpx.HTTPError:
                process.wait(10)
                return base | {"status": "failed", "reason": f"on a first request, {exit_reason(process, log)}"}
            time.sleep(1.0)
            before = tree_rss(server)
            sampler = RssSampler(server)
            sampler.start()
            results, seconds = asyncio.run(run_load(url, bodies, args.timeout))
            sampler.stopped.set()
            sampler.join()
            time.sleep(2.0)  # idle again: what the server keeps after the load
            died = exit_reason(process, log) if process.poll() is not None else None
            after = 0 if died else tree_rss(server)
        finally:
            stop_server(process)
    completed = [r for r in results if "times" in r]
    ttft = [r["times"][0] - r["sent"] for r in completed if r["times"]]
    itl = [later - earlier for r in completed for earlier, later in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in completed)
    problems = [r.get("lost") or r.get("malformed") for r in results if "times" not in r]
    return base | {
        "status": "failed" if died else "ok", "reason": died, "ok": len(completed),
        "lost": sum("lost" in r for r in results), "malformed": sum("malformed" in r for r in results),
        "problems": problems[:5], "without_done": sum(not r["done"] for r in completed),
        "rss_before_mb": before / 2**20, "rss_peak_mb": max(sampler.peak, before) / 2**20, "rss_after_mb": after / 2**20,
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "output_tokens": tokens, "seconds": seconds,
        "tok_s": tokens / seconds,
    }  # fmt: skip


def save(row: dict) -> None:
    """Replace the row of the same system and load in the committed JSONL (other rows stay)."""
    key = lambda r: (r["system"], r.get("dtype"), r.get("parallel"), r.get("kv"), r["clients"], r["prompt_tokens"],
                     r["max_tokens"])  # noqa: E731
    ROWS.parent.mkdir(parents=True, exist_ok=True)
    kept = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()] if ROWS.exists() else []
    ROWS.write_text("".join(json.dumps(r) + "\n" for r in [*(r for r in kept if key(r) != key(row)), row]))


def section(path: Path = ROWS) -> list[str]:
    """Markdown for the load-test rows (empty when none were measured)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return []
    rows.sort(key=lambda row: -row["clients"])
    pools = sorted({row["kv_memory"] for row in rows if "kv_memory" in row})
    lines = [
        "", "## `kvopt serve` under load: concurrent streaming clients over loopback", "",
        opening("python benchmarks/load.py", row_dates(path), path), "",
        "All clients start at once, each streaming one `/v1/completions` request "
        "(greedy, `max_tokens` new tokens, `ignore_eos` where the server has it) with a prompt of local real text "
        "(lengths drawn uniformly from the range shown); the default model (kvopt and transformers in the checkpoint's "
        "fp32 unless a `--dtype` is named; llama-server on its GGUF, Q4_1, or an F16 re-type), server and clients on "
        f"the same 2 CPU cores, the server with {' / '.join(sorted({str(r.get('threads', '?')) for r in rows}))} "
        "thread(s) (`--threads`: the clients need the other core). TTFT: request sent to first text event; ITL: between successive text events (one per token); "
        "tok/s: all output tokens over the wall time of the whole load. Lost: transport error or non-200; malformed: a "
        "broken event, an error event, no usage, or more text events than tokens. RSS: the server's process tree, "
        "idle before, peak during, idle 2 s after"
        + (f"; kvopt preallocates its KV pool (`--kv-memory {' / '.join(pools)}`), so its RSS hardly moves with the load, "
           "and a compressed method frees blocks inside the pool (room for more requests), not process memory." if pools
           else "."),
        "",
        "| system | clients | prompt tokens | max_tokens | ok / lost / malformed | TTFT p50 / p95 / p99 | ITL p50 / p95 / p99 "
        "| output tok/s | RSS before / peak / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in rows:
        head = f"| {_system(row)} | {row['clients']} | {row['prompt_tokens']} | {row['max_tokens']} |"
        if "ok" not in row:
            lines.append(f"{head} {row['status']}: {row['reason']} | | | | |")
            continue
        if row["status"] != "ok":
            head += f" {row['status']}: {row['reason']};"
        lines.append(
            f"{head} {row['ok']} / {row['lost']} / {row['malformed']} | {_seconds(row['ttft_s'])} | {_seconds(row['itl_s'])} "
            f"| {row['tok_s']:.1f} | {row['rss_before_mb']:.0f} / {row['rss_peak_mb']:.0f} / {row['rss_after_mb']:.0f} MB |"
        )
    undone = [f"`{row['system']}` ({row['without_done']})" for row in rows if row.get("without_done")]
    if undone:
        lines += ["", f"Streams that ended without `data: [DONE]` (OpenAI's client accepts that): {', '.join(undone)}."]
    return lines + [""]


def _system(row: dict) -> str:
    """The system with what it ran in: kvopt's ``--dtype``, llama-server's slots and KV type."""
    if "parallel" in row:
        return f"`{row['system']}` ({row['parallel']} slots, {row['kv']} KV)"
    return f"`{row['system']}`" + (f" `--dtype {row['dtype']}`" if row.get("dtype") else "")


def _seconds(quantiles: dict) -> str:
    return " / ".join("–" if quantiles[q] is None else f"{quantiles[q]:.2f} s" for q in ("p50", "p95", "p99"))


def main() -> None:
    from serving import real_prompts, token_range

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=SYSTEMS, help="';'-separated: kvopt:SPEC (engine --kv-method), transformers, transformers-cb, "
                        "llama-server:Q4_1 or llama-server:F16 (llama.cpp's server on the default model's GGUF)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--prompt-tokens", default="16-256", type=token_range, help="prompt lengths, drawn uniformly from LOW-HIGH")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-memory", default="1GB", help="kvopt's KV pool (`kvopt serve`'s default)")
    parser.add_argument("--dtype", default=None, help="kvopt serve's --dtype (fp32, bf16, auto); default: the checkpoint's")
    parser.add_argument("--llama-server", default=None, help="llama-server:WEIGHTS systems: the binary (default: on PATH)")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots (requests at once)")
    parser.add_argument("--llama-kv", default="f16", choices=("f16", "q8_0"), help="llama-server's KV cache type")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per server (OMP_NUM_THREADS): the clients need a core too, and spinning "
                             "threads on a busy 2-core machine slow a server ~10x")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a client waits for its whole response")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()

    from kvopt.models import load_tokenizer
    from kvopt.models.loading import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tokenizer = load_tokenizer(model_dir)
    low, high = args.prompt_tokens
    prompts = [tokenizer.decode(ids) for ids in real_prompts(tokenizer, args.clients, low, high, seed=1)]
    for system in args.systems.split(";"):
        row = measure(system, model_dir, prompts, args)
        save(row)  # at once: a later system's failure keeps this one
        print(json.dumps(row), flush=True)
    print("\n".join(section()))


if __name__ == "__main__":
    main()
