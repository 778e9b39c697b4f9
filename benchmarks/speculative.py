"""Speculative decoding on the default model: decode tok/s with and without drafts, next to HF's prompt lookup.

    python benchmarks/speculative.py                               # ~6 min on 2 shared cores; rows replace the old ones
    python benchmarks/speculative.py --new-tokens 64 --repeats 1   # shorter

Tasks: extracting a passage of real local text (input-grounded: the answer copies the prompt),
editing real code (a stdlib function, input-grounded) and open-ended chat (nothing to copy).
Each runs greedy through kvopt caches (``full`` and ``kivi:bits=4``), plain and with
``prompt_lookup:k=4`` (adaptive; ``full`` also with self-speculation), and through HF ``generate``
with its own cache, plain and with ``prompt_lookup_num_tokens=4``. One thread, systems interleaved
per task and repeated (median kept), so ratios are fair even on a busy machine. Rows go to benchmarks/results/speculative.jsonl; :func:`render` writes the
BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from sections import opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "speculative.jsonl"
SPECULATE = "prompt_lookup:k=4"
#: Self-speculation from two thirds of the depth (SmolLM2 was not trained for early exits: few drafts pass).
SELF = "self:layers=20,k=3"
KVOPT_RUNS = [("full", None), ("full", SPECULATE), ("full", SELF), ("kivi:bits=4", None), ("kivi:bits=4", SPECULATE)]
HF_LOOKUP_TOKENS = 4
CONDITIONS = "1 torch thread, on 2 CPU cores shared with other jobs (contention): compare ratios, not absolute speeds"


def tasks() -> dict[str, str]:
    """User messages: two input-grounded tasks on real local text and code, one open-ended."""
    import textwrap

    from kvopt.local_text import real_text

    text = real_text()[0]
    passage = text[: text.find(" ", 1500)]
    code = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))
    return {
        "extract": f"{passage}\n\nCopy the first three sentences of the text above exactly, word for word.",
        "code-edit": f"{code}\n\nRewrite this Python function with the variable `chunks` renamed to `pieces`. "
        "Output only the code.",
        "chat": "Write a short story about a lighthouse keeper who befriends a storm.",
    }


def run_kvopt(model, ids, new_tokens: int, cache: str, speculate: str | None) -> dict:
    import kvopt

    out = kvopt.generate(model, ids, cache=cache, speculate=speculate, max_new_tokens=new_tokens, eos_token_id=[])
    stats = out.stats
    return {
        "system": "kvopt", "cache": cache, "decoding": speculate or "plain", "tokens": out.tokens,
        "decode_tok_s": out.decode_tokens_per_second, "proposed": stats.proposed, "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate if stats.proposed else None,
        "mean_accepted_length": stats.mean_accepted_length if stats.rounds else None,
        "verifications": stats.rounds, "plain_steps": stats.plain_steps,
    }  # fmt: skip


def run_hf(model, ids, new_tokens: int, lookup: bool) -> dict:
    """HF ``generate`` with its own cache; decode time = total minus a one-token run's (the prefill)."""
    options = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    if lookup:
        options["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
    with torch.inference_mode():
        began = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **options)
        prefill = time.perf_counter() - began
        began = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        total = time.perf_counter() - began
    tokens = out[0, ids.shape[-1] :].tolist()
    return {
        "system": "hf", "cache": "DynamicCache", "decoding": f"prompt_lookup_num_tokens={HF_LOOKUP_TOKENS}" if lookup else "plain",
        "tokens": tokens, "decode_tok_s": (len(tokens) - 1) / max(total - prefill, 1e-9),
    }  # fmt: skip


def measure(new_tokens: int, repeats: int) -> list[dict]:
    import kvopt
    from kvopt.runtime import encode_prompt

    torch.set_num_threads(1)
    model, tokenizer = kvopt.load_model()
    peer = copy.deepcopy(model)
    peer.set_attn_implementation("sdpa")
    systems = [
        *(partial(run_kvopt, model, cache=cache, speculate=speculate) for cache, speculate in KVOPT_RUNS),
        partial(run_hf, peer, lookup=False), partial(run_hf, peer, lookup=True),
    ]  # fmt: skip
    rows = []
    for task, prompt in tasks().items():
        ids = encode_prompt(tokenizer, prompt, chat=True)
        runs = [[system(ids=ids, new_tokens=new_tokens) for system in systems] for _ in range(repeats)]  # interleaved
        results = runs[-1]
        for index, result in enumerate(results):
            result["decode_tok_s"] = statistics.median(run[index]["decode_tok_s"] for run in runs)
        plain = {(r["system"], r["cache"]): r for r in results if r["decoding"] == "plain"}
        for result in results:
            reference = plain[result["system"], result["cache"]]
            result.update(
                task=task, prompt_tokens=ids.shape[-1], new_tokens=len(result["tokens"]), repeats=repeats,
                speedup=result["decode_tok_s"] / reference["decode_tok_s"],
                same_tokens_as_plain=result["tokens"] == reference["tokens"],
                preview=tokenizer.decode(result["tokens"][:24], skip_special_tokens=True),
            )  # fmt: skip
            print(json.dumps({k: result[k] for k in ("task", "system", "cache", "decoding", "decode_tok_s", "speedup")}))
        rows += [{k: v for k, v in result.items() if k != "tokens"} for result in results]
    stamp = {"model": "SmolLM2-135M-Instruct", "conditions": CONDITIONS, "machine": platform.processor() or platform.machine(),
             "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    return [{**row, **stamp} for row in rows]


def render(rows: list[dict]) -> str:
    """The BENCHMARKS.md section for these rows (markdown)."""
    if not rows:
        return ""
    differ = [f"{r['task']}/{r['cache']}" for r in rows if r["system"] == "kvopt" and not r["same_tokens_as_plain"]]
    same = (
        f"Speculative tokens differ from plain ones in: {', '.join(differ)}."
        if differ
        else "kvopt's speculative tokens equal its plain tokens in every row (checked)."
    )
    lines = [
        "## Speculative decoding (single sequence)",
        "",
        opening("python benchmarks/speculative.py", row_dates(ROWS), ROWS),
        "",
        (
            f"{rows[0]['model']}, greedy, {rows[0]['new_tokens']} new tokens, "
            f"median of {rows[0]['repeats']} interleaved runs, "
            f"{rows[0]['conditions']}. kvopt: `kvopt.generate(..., speculate=...)` with the proposer shown (adaptive: "
            "drafting pauses while rounds emit tokens slower than plain steps) against plain decoding through the same "
            "cache; "
            f"HF: `generate(prompt_lookup_num_tokens={HF_LOOKUP_TOKENS})` against plain `generate`, its own cache. "
            f"Speed-up is decode tok/s over the same system's plain decoding. {same}"
        ),
        "",
        "| task | system | cache | decoding | decode tok/s | speed-up | drafts accepted | accepted per verification |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        rate = "" if row.get("acceptance_rate") is None else f"{row['accepted']}/{row['proposed']} ({row['acceptance_rate']:.0%})"
        length = "" if row.get("mean_accepted_length") is None else f"{row['mean_accepted_length']:.2f}"
        lines.append(
            f"| {row['task']} | {row['system']} | `{row['cache']}` | {row['decoding']} | {row['decode_tok_s']:.1f} | "
            f"{row['speedup']:.2f}x | {rate} | {length} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="runs per system (interleaved); the median is kept")
    args = parser.parse_args()
    rows = measure(args.new_tokens, args.repeats)
    ROWS.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(render(rows))


if __name__ == "__main__":
    main()
