"""Chat beside documents: stall-free serving against fixed step budgets, through the real server (issue 72).

    python benchmarks/stallfree.py                 # every config, fixed and Poisson arrivals, then chat only (~40 min)
    python benchmarks/stallfree.py --configs fixed-4096,auto --arrivals fixed --documents 1 --users 2 --interval 3 \\
        --rows /tmp/stallfree.jsonl --plots /tmp   # a smoke run (a couple of minutes), nothing committed
    python benchmarks/stallfree.py --plot-only     # redraw the plot and print the section from the committed rows

The workload: ``--users`` chat users each ask short questions back to back through the real ``openai`` client
(streamed chat completions, greedy, ``--chat-tokens`` new tokens, ``ignore_eos``), recording when every text event
arrives (one event per token; chat ITL = the gaps between successive events of one response). Beside them,
``--documents`` long documents of local real text (``--document-tokens`` long in turn, cut by the default model's
tokenizer, each followed by a short question) are sent as streamed ``/v1/completions`` (``--document-new-tokens``
new tokens), arriving every ``--interval`` seconds (``fixed``) or as a seeded Poisson process of the same mean
(``poisson``); ``none`` runs the chat users alone for as long as the documents' arrivals would span, for
``fixed-4096`` and ``auto`` only (the target must cost nothing when there is nothing to protect). Chat users stop
asking once every document is answered (or the ``--duration`` bound passes).

Each configuration is a fresh ``kvopt serve --kv-memory 1GB --max-model-len 8192 --threads T --no-access-log`` with
its own step options (:data:`CONFIGS`), configurations run one after another within each arrival mode. Per run a
row: chat ITL p50 / p99, output tok/s (every output token, chat and documents, over the run's wall time), document
TTFT p50 (arrival to first text event), the step-time model's predicted ÷ measured step time (p50 / p90,
interpolated from the server's ``kvopt:step_time_predicted_over_measured`` histogram over the run, as Prometheus'
``histogram_quantile`` does), steps that missed the target, the final prefill budget and the target, the CPU's flags.
Rows go to ``--rows`` (default benchmarks/results/stallfree.jsonl; a row replaces the one of the same config,
arrivals, users and threads), the per-event timeline to ``<rows stem>_timeline.jsonl.gz`` beside it, and the plot
(chat ITL over time, documents' arrivals marked, fixed-4096 and auto) to ``--plots``/stallfree_itl.png.
:func:`render` writes the BENCHMARKS.md section from the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sections import conditions_line, opening, read_rows, where

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "stallfree.jsonl"
PLOTS = ROOT / "benchmarks" / "report"
PLOT_NAME = "stallfree_itl.png"
BASELINE = "fixed-4096"
#: Configuration -> the `kvopt serve` options beside the common ones (fixed-4096 is the engine before the target).
CONFIGS = {
    "fixed-4096": ["--itl-target-ms", "off"],
    "fixed-2048": ["--itl-target-ms", "off", "--max-num-batched-tokens", "2048"],
    "fixed-512": ["--itl-target-ms", "off", "--max-num-batched-tokens", "512"],
    "auto": ["--itl-target-ms", "auto"],
    "target-250ms": ["--itl-target-ms", "250"],
    "target-500ms": ["--itl-target-ms", "500"],
}
#: Configurations run without documents (arrivals ``none``): today's default and the target's.
CHAT_ONLY = ("fixed-4096", "auto")
#: Configurations with a latency target: the issue's targets are read for these.
TARGETED = ("auto", "target-250ms", "target-500ms")
ARRIVALS = ("fixed", "poisson", "none")
#: CPU flags worth naming for a CPU step time (the rest do not change the kernels torch runs).
RELEVANT_FLAGS = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16")
#: The issue's targets against fixed-4096 in the same run; with no documents, "equal within noise" is this much.
ITL_SPREAD, THROUGHPUT, TTFT, NOISE = 3.0, 0.95, 1.5, 0.10
QUESTIONS = [
    "What is a Python list comprehension?", "How do I open a file in Python?", "What does a dictionary store?",
    "Why use a virtual environment?", "What is a generator?", "How does exception handling work?",
    "What is the difference between a tuple and a list?", "What does the with statement do?",
    "How do I sort a list of numbers?", "What is a lambda function?", "What is recursion?",
    "How do I read a CSV file?", "What is a decorator?", "What does import do?", "What is a class?",
    "How do I format a string?",
]  # fmt: skip
DOCUMENT_QUESTION = "\n\nQuestion: in one sentence, what is the text above about?\nAnswer:"


# --------------------------------------------------------------------------- the workload


def arrival_times(mode: str, count: int, interval: float, seed: int = 0) -> list[float]:
    """Seconds after the run starts at which each document arrives: every ``interval`` (``fixed``), or a Poisson
    process of the same mean (``poisson``, seeded); none for ``none``."""
    if mode == "none":
        return []
    if mode == "fixed":
        return [interval * (index + 1) for index in range(count)]
    draw, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        at += draw.expovariate(1 / interval)
        times.append(at)
    return times


def documents(tokenizer, count: int, sizes: list[int]) -> list[tuple[int, str]]:
    """``count`` documents of local real text, ``sizes`` tokens long in turn (cut by ``tokenizer``), each from its
    own stretch of the text (no two share a prefix the cache could reuse), followed by a short question."""
    from kvopt.local_text import real_text

    lengths = [sizes[index % len(sizes)] for index in range(count)]
    text = real_text()[0]
    ids = tokenizer(text[: 8 * sum(lengths) + 4096], add_special_tokens=False)["input_ids"]
    while len(ids) < sum(lengths):
        ids = ids + ids[1:]  # shifted by one: the repeat starts no document the same way
    made, at = [], 0
    for length in lengths:
        made.append((length, tokenizer.decode(ids[at : at + length]) + DOCUMENT_QUESTION))
        at += length
    return made


async def drive(url: str, model: str, docs: list[tuple[float, int, str]], args, chat_seconds: float) -> dict:
    """The chat users and the documents against one server; every time relative to the run's start (seconds)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=args.timeout)
    start = time.perf_counter()
    now = lambda: time.perf_counter() - start  # noqa: E731
    stop = asyncio.Event()
    chat: list[dict] = []
    answered: list[dict] = [{"arrival": arrival, "size": size, "times": [], "tokens": None} for arrival, size, _ in docs]

    async def user(index: int) -> None:
        asked = 0
        while not stop.is_set():
            record = {"user": index, "sent": now(), "times": [], "tokens": None}
            chat.append(record)
            question = QUESTIONS[(index + asked * args.users) % len(QUESTIONS)]
            asked += 1
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": question}], max_tokens=args.chat_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        record["times"].append(now())
                    if chunk.usage:
                        record["tokens"] = chunk.usage.completion_tokens
            except (openai.OpenAIError, OSError) as error:
                record["error"] = f"{type(error).__name__}: {error}"[:300]
                return  # a failing server: this user stops rather than spinning
            record["end"] = now()

    async def document(record: dict, prompt: str) -> None:
        await asyncio.sleep(max(0.0, record["arrival"] - now()))
        record["sent"] = now()
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=args.document_new_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    record["times"].append(now())
                if chunk.usage:
                    record["tokens"], record["prompt_tokens"] = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        except (openai.OpenAIError, OSError) as error:
            record["error"] = f"{type(error).__name__}: {error}"[:300]
            return
        record["end"] = now()

    users = [asyncio.create_task(user(index)) for index in range(args.users)]
    pending = [asyncio.create_task(document(record, prompt)) for record, (_, _, prompt) in zip(answered, docs)]
    if pending:
        _, late = await asyncio.wait(pending, timeout=args.duration)
    else:
        await asyncio.sleep(min(chat_seconds, args.duration))
        late = set()
    stop.set()  # no new questions; the ones asked finish (within the bound)
    _, still = await asyncio.wait(users, timeout=max(1.0, args.duration - now()))
    for task in [*late, *still]:
        task.cancel()
    await asyncio.gather(*late, *still, return_exceptions=True)
    await client.close()
    return {"chat": chat, "documents": answered, "cut": bool(late or still)}


# --------------------------------------------------------------------------- /metrics


def scrape(url: str) -> dict:
    """The step-budget series of ``/metrics``: the ratio histogram's cumulative buckets, the missed-steps counter,
    the prefill budget and target gauges."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found = {"buckets": {}, "missed": 0.0, "budget": None, "target": None}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "kvopt:step_time_predicted_over_measured_bucket":
                bound = float(sample.labels["le"])
                found["buckets"][bound] = found["buckets"].get(bound, 0.0) + sample.value
            elif sample.name == "kvopt:step_target_missed_total":
                found["missed"] += sample.value
            elif sample.name == "kvopt:step_prefill_budget_tokens":
                found["budget"] = sample.value
            elif sample.name == "kvopt:step_itl_target_seconds":
                found["target"] = sample.value
    return found


def histogram_quantile(q: float, buckets: dict[float, float] | list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram from its cumulative buckets (upper bound -> count, ``inf`` included), as
    Prometheus' ``histogram_quantile`` computes it: linear interpolation inside the bucket holding the rank (the
    first bucket starts at 0); a rank in the ``+Inf`` bucket gives the highest finite bound. None without
    observations (or without a ``+Inf`` bucket)."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    pairs = sorted(dict(buckets).items())
    if not pairs or pairs[-1][0] != math.inf:
        return None
    counts, running = [], 0.0
    for _, count in pairs:  # counts are cumulative; a scrape mid-update may dip: made monotonic, as Prometheus does
        running = max(running, count)
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(pairs) - 1:
        return pairs[-2][0] if len(pairs) > 1 else None
    upper = pairs[index][0]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (pairs[index - 1][0], counts[index - 1]) if index > 0 else (0.0, 0.0)
    inside = counts[index] - below
    return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of samples by nearest rank (the smallest sample with at least ``q`` of them at or below)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


# --------------------------------------------------------------------------- one run


def server_command(config: str, port: int, args) -> list[str]:
    return [sys.executable, "-m", "kvopt.cli.main", "serve", "--port", str(port), "--kv-memory", args.kv_memory,
            "--max-model-len", str(args.max_model_len), "--threads", str(args.threads), "--no-access-log",
            *CONFIGS[config]]  # fmt: skip


def relevant_flags() -> list[str]:
    from kvopt.models.cpu_features import cpu_flags

    flags = cpu_flags()
    return sorted(flag for flag in flags if flag in RELEVANT_FLAGS or flag.startswith("amx_"))


def measure(config: str, arrivals: str, docs: list[tuple[int, str]], args) -> tuple[dict, dict]:
    """One fresh server and one run of the workload: its row and its timeline."""
    import httpx

    from load import exit_reason, free_port, stop_server, wait_healthy

    times = arrival_times(arrivals, len(docs), args.interval, args.seed)
    chosen = [(at, size, prompt) for at, (size, prompt) in zip(times, docs)]
    base = {"config": config, "arrivals": arrivals, "users": args.users, "threads": args.threads,
            "documents": len(chosen), "document_tokens": args.document_tokens[: len(chosen)],
            "interval": args.interval if chosen else None, "seed": args.seed if arrivals == "poisson" else None,
            "chat_tokens": args.chat_tokens, "document_new_tokens": args.document_new_tokens,
            "server_options": CONFIGS[config], "kv_memory": args.kv_memory, "max_model_len": args.max_model_len,
            "cpus": os.cpu_count(), "cpu_flags": relevant_flags(), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    base |= {"conditions": args.conditions} if args.conditions else {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(server_command(config, port, args), stdout=log, stderr=subprocess.STDOUT, text=True,
                                   env=env)  # fmt: skip
        try:
            problem = wait_healthy(url, process, log, args.start_timeout)
            if problem:
                return base | {"status": "not run", "reason": problem}, {}
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            try:  # the first requests' set-up stays out of the timing
                httpx.post(url + "/v1/chat/completions", timeout=args.timeout, json={
                    "model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 8})
                httpx.post(url + "/v1/completions", timeout=args.timeout, json={
                    "model": model, "prompt": " ".join(QUESTIONS), "max_tokens": 4})  # shares no document's prefix
            except httpx.HTTPError:
                process.wait(10)
                return base | {"status": "failed", "reason": f"on a first request, {exit_reason(process, log)}"}, {}
            before = scrape(url)
            chat_seconds = args.chat_seconds or args.documents * args.interval  # what the documents would span
            done = asyncio.run(drive(url, model, chosen, args, chat_seconds))
            died = exit_reason(process, log) if process.poll() is not None else None
            after = None if died else scrape(url)
        finally:
            stop_server(process)
    return summarize(base, done, before, after, died), timeline(base, done, after)


def summarize(base: dict, done: dict, before: dict, after: dict | None, died: str | None) -> dict:
    """A run's row from what the clients saw and the server's step series before and after it."""
    chat, docs = done["chat"], done["documents"]
    itl = [later - earlier for r in chat for earlier, later in zip(r["times"], r["times"][1:])]
    ttft = [r["times"][0] - r["arrival"] for r in docs if r["times"]]
    # A chat user's wait for the first token of each new question: where a stall hides that ITL does not show.
    asked = [r["times"][0] - r["sent"] for r in chat if r["times"]]
    responses = [*chat, *docs]
    tokens = sum(r["tokens"] if r.get("tokens") is not None else len(r["times"]) for r in responses)
    ends = [r.get("end") or (r["times"][-1] if r["times"] else 0.0) for r in responses]
    seconds = max(ends, default=0.0)
    row = base | {
        "status": "failed" if died else ("cut" if done["cut"] else "ok"), "reason": died,
        "chat_responses": sum("end" in r for r in chat), "chat_itl_samples": len(itl),
        "chat_itl_p50": quantile(itl, 0.50), "chat_itl_p99": quantile(itl, 0.99),
        "chat_ttft_p50": quantile(asked, 0.50), "chat_ttft_p99": quantile(asked, 0.99),
        "chat_output_tokens": sum(r["tokens"] or len(r["times"]) for r in chat),
        "documents_answered": sum("end" in r for r in docs), "document_ttft_p50": quantile(ttft, 0.50),
        "document_ttft_max": max(ttft, default=None), "output_tokens": tokens, "seconds": seconds,
        "output_tok_s": tokens / seconds if seconds else None,
        "errors": [r["error"] for r in responses if "error" in r][:3],
        # Text events over usage's tokens: 1 when every token came as its own event.
        "events_per_token": sum(len(r["times"]) for r in responses) / tokens if tokens else None,
    }  # fmt: skip
    if after is not None:
        run = {bound: count - before["buckets"].get(bound, 0.0) for bound, count in after["buckets"].items()}
        row |= {"prediction_p50": histogram_quantile(0.5, run), "prediction_p90": histogram_quantile(0.9, run),
                "steps_predicted": run.get(math.inf, 0.0), "missed_steps": after["missed"] - before["missed"],
                "prefill_budget": after["budget"], "itl_target_s": after["target"] or None}  # fmt: skip
    return row


def timeline(base: dict, done: dict, after: dict | None) -> dict:
    """The run's events, compactly (ms): each chat response's user, sent time and event times; each document's
    arrival, size and first and last event."""
    ms = lambda seconds: round(seconds * 1000)  # noqa: E731
    return {key: base[key] for key in ("config", "arrivals", "users", "threads", "date")} | {
        "target_s": after and (after["target"] or None),
        "chat": [[r["user"], ms(r["sent"]), [ms(t) for t in r["times"]]] for r in done["chat"]],
        "documents": [[ms(r["arrival"]), r["size"], r["times"] and ms(r["times"][0]), r["times"] and ms(r["times"][-1])]
                      for r in done["documents"]],
    }  # fmt: skip


def key(row: dict) -> tuple:
    return row["config"], row["arrivals"], row["users"], row["threads"]


def save(path: Path, row: dict) -> None:
    """Replace the row of the same config, arrivals, users and threads (the other rows stay)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [r for r in read_rows(path) if key(r) != key(row)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*kept, row]))


def timeline_path(rows: Path) -> Path:
    return rows.with_name(f"{rows.stem}_timeline.jsonl.gz")


def save_timeline(path: Path, entry: dict) -> None:
    kept = [e for e in read_timeline(path) if key(e) != key(entry)]
    with gzip.open(path, "wt") as sink:
        sink.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in [*kept, entry])


def read_timeline(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with gzip.open(path, "rt") as source:
        return [json.loads(line) for line in source if line.strip()]


# --------------------------------------------------------------------------- the plot


def plot(timeline_file: Path, folder: Path) -> Path | None:
    """Chat ITL over time with each document's arrival marked, fixed-4096 beside auto, one row per arrival mode
    with documents: ``folder``/stallfree_itl.png (None without such runs or without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    entries = {(e["config"], e["arrivals"]): e for e in read_timeline(timeline_file)}
    modes = [mode for mode in ARRIVALS[:2] if any((config, mode) in entries for config in (BASELINE, "auto"))]
    if not modes:
        return None
    figure = Figure(figsize=(12, 3.8 * len(modes)), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(len(modes), 2, squeeze=False, sharey=True)
    for row, mode in enumerate(modes):
        for column, config in enumerate((BASELINE, "auto")):
            axes, entry = grid[row][column], entries.get((config, mode))
            axes.set_title(f"{config}, {mode} arrivals", fontsize=10)
            axes.set_yscale("log")
            axes.grid(alpha=0.3)
            if entry is None:
                axes.text(0.5, 0.5, "not measured", ha="center", transform=axes.transAxes)
                continue
            for user in sorted({r[0] for r in entry["chat"]}):
                points = [(later / 1000, (later - earlier) / 1000) for u, _, times in entry["chat"] if u == user
                          for earlier, later in zip(times, times[1:])]  # fmt: skip
                if points:
                    axes.scatter(*zip(*points), s=4, alpha=0.6, label=f"chat user {user}")
            waits = [(times[0] / 1000, (times[0] - sent) / 1000) for _, sent, times in entry["chat"] if times]
            if waits:  # a question's wait for its first token: the stall ITL does not show
                axes.scatter(*zip(*waits), s=18, marker="x", color="dimgray", label="chat TTFT (new question)")
            sizes = sorted({doc[1] for doc in entry["documents"]})
            for arrival, size, _, _ in entry["documents"]:
                axes.axvline(arrival / 1000, color="black", alpha=0.35 + 0.5 * (size == sizes[-1]), linewidth=1,
                             linestyle="--" if size == sizes[0] else "-")  # fmt: skip
            if entry.get("target_s"):
                axes.axhline(entry["target_s"], color="red", linewidth=1, label=f"target {entry['target_s']:.2f} s")
            axes.set_xlabel("seconds into the run")
            if column == 0:
                axes.set_ylabel("chat ITL, and TTFT (x), s")
            axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)  # below: hides no point
    figure.suptitle("Chat inter-token latency (dots, at each token) and time to a question's first token (x); "
                    "vertical lines: documents arriving (dashed: the shorter ones)", fontsize=10)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / PLOT_NAME
    figure.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------- the section


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section (``committed_section`` in benchmarks/run.py): a table per arrival mode, the
    no-documents comparison, the issue's targets read from the rows against fixed-4096 of the same run, the plot."""
    latest: dict[tuple, dict] = {}
    for row in rows:  # a later row of the same run replaces the earlier one
        latest.pop(key(row), None)
        latest[key(row)] = row
    rows = list(latest.values())
    measured = [row for row in rows if row.get("status") in ("ok", "cut")]
    first = next((row for row in measured if row["documents"]), measured[0] if measured else rows[0])
    flags = sorted({flag for row in rows for flag in row.get("cpu_flags", [])})
    sizes = first.get("document_tokens") or []
    threads = " / ".join(sorted({str(row["threads"]) for row in rows}))
    configs = "; ".join(f"`{name}`: `{' '.join(options)}`" for name, options in CONFIGS.items())
    lines = [
        "## Chat beside documents (stall-free serving)", "",
        opening("python benchmarks/stallfree.py", [row["date"] for row in rows if row.get("date")], ROWS,
                f"timeline: `{where(timeline_path(ROWS))}`"), "",
        f"{first['users']} chat users ask short questions back to back through the real `openai` client (streamed chat "
        f"completions, greedy, {first['chat_tokens']} new tokens, `ignore_eos`) while long documents of local real text "
        f"({' and '.join(f'{size:,}' for size in sizes)} tokens{' in turn' if len(sizes) > 1 else ''}, cut by the "
        "default model's tokenizer, each with a short question) arrive as streamed `/v1/completions` "
        f"({first['document_new_tokens']} new tokens): {first['documents']} per run, one every "
        f"{first.get('interval') or 0:g} s (fixed) or as a seeded Poisson process of the same mean; chat users stop "
        "asking once every document is answered. Each configuration is a fresh `kvopt serve --kv-memory "
        f"{first['kv_memory']} --max-model-len {first['max_model_len']} --threads T` on the default model (fp32), "
        f"configurations one after another within each arrival mode: {configs} (`fixed-4096` is the engine before "
        "the target; `auto`, serve's default, is 3x the decoding batch's own step, at least 3x one sequence's decode "
        "step timed at start-up; with nothing decoding a step may run 10x the target). Chat ITL: the "
        "gaps between successive text events of one response (one per token), all users, the whole run; output "
        "tok/s: every output token, chat and documents, over the run's wall time; document TTFT: arrival to first "
        "text event; chat TTFT: a question sent to its first text event (a stall ITL cannot show: a question asked "
        "while a long prefill step runs waits for it). Prediction: the step-time model's predicted over measured step time, p50 / p90 interpolated from "
        "the server's `kvopt:step_time_predicted_over_measured` histogram over the run (as Prometheus' "
        "`histogram_quantile`); missed steps: `kvopt:step_target_missed_total` over the run; budget: the last "
        f"`kvopt:step_prefill_budget_tokens`. Machine: {first.get('cpus', '?')} CPU cores "
        f"(flags: {', '.join(flags) or 'none known'}), the server with {threads} torch thread(s), the clients on the "
        "other core(s).",
    ]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["arrivals"], row["users"], row["threads"]), []).append(row)
    order = lambda item: (ARRIVALS.index(item[0][0]) if item[0][0] in ARRIVALS else 9, -item[0][1], item[0][2])  # noqa: E731
    readings = []
    for (arrivals, users, threads), group in sorted(groups.items(), key=order):
        group.sort(key=lambda row: list(CONFIGS).index(row["config"]) if row["config"] in CONFIGS else 99)
        baseline = next((row for row in group if row["config"] == BASELINE and _ok(row)), None)
        title = f"{users} chat users, {threads} thread(s)"
        if arrivals == "none":
            lines += ["", f"No documents ({title}): the chat users alone.", "",
                      "| config | chat ITL p50 | chat ITL p99 | p99/p50 | chat TTFT p50 / p99 | output tok/s | vs fixed-4096 "
                      "| target |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
            for row in group:
                cells = [*_chat_cells(row, baseline), _s(row.get("itl_target_s"))] if _ok(row) else _failed(row, 7)
                lines.append(f"| {_config(row)} | {' | '.join(cells)} |")
            readings += _quiet(group, baseline, title)
            continue
        lines += ["", f"{arrivals.capitalize()} arrivals ({title}):", "",
                  "| config | chat ITL p50 | chat ITL p99 | p99/p50 | chat TTFT p50 / p99 | output tok/s | vs fixed-4096 "
                  "| document TTFT p50 | vs fixed-4096 | prediction p50 / p90 | missed steps | target / last budget |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for row in group:
            if not _ok(row):
                lines.append(f"| {_config(row)} | {' | '.join(_failed(row, 11))} |")
                continue
            targeted = bool(row.get("itl_target_s"))
            ttft = row["document_ttft_p50"]
            cells = [*_chat_cells(row, baseline), _s(ttft), _x(_ratio(ttft, baseline and baseline["document_ttft_p50"])),
                     f"{_f(row.get('prediction_p50'))} / {_f(row.get('prediction_p90'))}",
                     f"{row['missed_steps']:.0f}" if targeted and row.get("missed_steps") is not None else "–",
                     f"{_s(row.get('itl_target_s'))} / {_f(row.get('prefill_budget'), 0)}"]  # fmt: skip
            lines.append(f"| {_config(row)} | {' | '.join(cells)} |")
        readings += _targets(arrivals, group, baseline, title)
    if readings:
        lines += ["", f"The issue's targets, each against `{BASELINE}` in the same run: chat p99 ITL <= {ITL_SPREAD:g}x its "
                  f"p50, output tok/s >= {THROUGHPUT:g}x, document TTFT p50 <= {TTFT:g}x; with no documents, chat ITL "
                  f"p50 and output tok/s within {NOISE:.0%}.", "", *readings]  # fmt: skip
    if any(row["config"] in (BASELINE, "auto") and row["documents"] and _ok(row) for row in rows):
        lines += ["", f"![Chat inter-token latency and chat TTFT over time, documents' arrivals marked, {BASELINE} and auto]"
                  f"({where(PLOTS / PLOT_NAME)})"]  # fmt: skip
    lines += conditions_line(rows)
    return "\n".join([*lines, ""])


def _targets(arrivals: str, group: list[dict], baseline: dict | None, title: str) -> list[str]:
    """One line per targeted configuration: the issue's three targets, each holds or not, from the rows."""
    lines = []
    for row in group:
        if row["config"] not in TARGETED or not _ok(row):
            continue
        spread = _ratio(row["chat_itl_p99"], row["chat_itl_p50"])
        throughput = _ratio(row["output_tok_s"], baseline and baseline["output_tok_s"])
        ttft = _ratio(row["document_ttft_p50"], baseline and baseline["document_ttft_p50"])
        lines.append(f"- `{row['config']}`, {arrivals} arrivals ({title}): chat p99 ITL {_x(spread)} its p50 "
                     f"(<= {ITL_SPREAD:g}x: {_holds(spread, lambda v: v <= ITL_SPREAD)}); output tok/s {_x(throughput)} "
                     f"{BASELINE}'s (>= {THROUGHPUT:g}x: {_holds(throughput, lambda v: v >= THROUGHPUT)}); document TTFT "
                     f"p50 {_x(ttft)} {BASELINE}'s (<= {TTFT:g}x: {_holds(ttft, lambda v: v <= TTFT)}).")  # fmt: skip
    return lines


def _quiet(group: list[dict], baseline: dict | None, title: str) -> list[str]:
    """With no documents, each targeted configuration's chat ITL p50 and output tok/s against fixed-4096's."""
    lines = []
    for row in group:
        if row["config"] not in TARGETED or not _ok(row):
            continue
        itl = _ratio(row["chat_itl_p50"], baseline and baseline["chat_itl_p50"])
        throughput = _ratio(row["output_tok_s"], baseline and baseline["output_tok_s"])
        same = None if itl is None or throughput is None else max(abs(itl - 1), abs(throughput - 1))
        lines.append(f"- `{row['config']}`, no documents ({title}): chat ITL p50 {_x(itl)} and output tok/s "
                     f"{_x(throughput)} {BASELINE}'s (equal within {NOISE:.0%}: {_holds(same, lambda v: v <= NOISE)}).")  # fmt: skip
    return lines


def _chat_cells(row: dict, baseline: dict | None) -> list[str]:
    """Chat ITL p50, p99 and their ratio, chat TTFT p50 / p99, output tok/s and its ratio to the baseline's."""
    return [_s(row["chat_itl_p50"]), _s(row["chat_itl_p99"]), _x(_ratio(row["chat_itl_p99"], row["chat_itl_p50"])),
            f"{_s(row.get('chat_ttft_p50'))} / {_s(row.get('chat_ttft_p99'))}", _f(row["output_tok_s"]),
            _x(_ratio(row["output_tok_s"], baseline and baseline["output_tok_s"]))]  # fmt: skip


def _config(row: dict) -> str:
    return f"`{row['config']}`" + (" (cut at the `--duration` bound)" if row.get("status") == "cut" else "")


def _failed(row: dict, cells: int) -> list[str]:
    return [f"{row['status']}: {row.get('reason')}", *[""] * (cells - 1)]


def _ok(row: dict) -> bool:
    return row.get("status") in ("ok", "cut")


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _holds(value: float | None, test) -> str:
    return "not measured" if value is None else ("holds" if test(value) else "does not hold")


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.2f} s"


def _x(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def _f(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--arrivals", default=",".join(ARRIVALS),
                        help=f"comma-separated: fixed, poisson, none (no documents: {', '.join(CHAT_ONLY)} only)")
    parser.add_argument("--documents", type=int, default=6, help="documents per run")
    parser.add_argument("--document-tokens", default="3000,6000", help="documents' lengths, in turn")
    parser.add_argument("--document-new-tokens", type=int, default=16)
    parser.add_argument("--users", type=int, default=4, help="chat users")
    parser.add_argument("--chat-tokens", type=int, default=48, help="new tokens per chat answer")
    parser.add_argument("--interval", type=float, default=8.0, help="seconds between documents (the mean, for poisson)")
    parser.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed")
    parser.add_argument("--chat-seconds", type=float, default=None,
                        help="a no-documents run's length; default: documents x interval (their arrivals' span)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (the clients need a core)")
    parser.add_argument("--duration", type=float, default=900.0, help="seconds a run may take at most")
    parser.add_argument("--kv-memory", default="1GB")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a client waits for a response")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--rows", type=Path, default=ROWS, help="rows file (the timeline goes beside it)")
    parser.add_argument("--plots", type=Path, default=PLOTS, help=f"folder of the plot ({PLOT_NAME})")
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated with the rows)")
    parser.add_argument("--plot-only", action="store_true", help="no runs: redraw the plot, print the section")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := [name for name in configs if name not in CONFIGS]:
        parser.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if unknown := [mode for mode in args.arrivals.split(",") if mode not in ARRIVALS]:
        parser.error(f"unknown arrival mode(s) {', '.join(unknown)}; choose from {', '.join(ARRIVALS)}")
    args.document_tokens = [int(size) for size in args.document_tokens.split(",")]
    if not args.plot_only:
        from kvopt.models import load_tokenizer

        docs = documents(load_tokenizer(), args.documents, args.document_tokens)
        for arrivals in args.arrivals.split(","):
            for config in (name for name in configs if arrivals != "none" or name in CHAT_ONLY):
                row, events = measure(config, arrivals, docs if arrivals != "none" else [], args)
                save(args.rows, row)  # at once: a later run's failure keeps this one
                if events:
                    save_timeline(timeline_path(args.rows), events)
                print(summary_line(row), flush=True)
    drawn = plot(timeline_path(args.rows), args.plots)
    print(f"rows: {args.rows}; timeline: {timeline_path(args.rows)}; plot: {drawn or 'not drawn'}")
    if args.plot_only:
        print(render(read_rows(args.rows)) if read_rows(args.rows) else f"no rows in {args.rows}")


def summary_line(row: dict) -> str:
    if not _ok(row):
        return f"{row['config']:>13} {row['arrivals']:>7}: {row['status']}: {row.get('reason')}"
    return (f"{row['config']:>13} {row['arrivals']:>7}: chat ITL p50 {_s(row['chat_itl_p50'])} p99 "
            f"{_s(row['chat_itl_p99'])} | {_f(row['output_tok_s'])} tok/s | doc TTFT p50 {_s(row['document_ttft_p50'])} "
            f"({row['documents_answered']}/{row['documents']}) | prediction p50/p90 {_f(row.get('prediction_p50'))}/"
            f"{_f(row.get('prediction_p90'))} | missed {_f(row.get('missed_steps'), 0)} | target "
            f"{_s(row.get('itl_target_s'))} budget {_f(row.get('prefill_budget'), 0)} | {row['seconds']:.0f} s "
            f"| chat TTFT p50/p99 {_s(row.get('chat_ttft_p50'))}/{_s(row.get('chat_ttft_p99'))} "
            f"| {row['status']}{' ' + str(row['errors']) if row['errors'] else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
