"""Speed and memory benchmark: prefill time, decode tok/s and KV bytes, side by side with HF.

Every contender decodes the same prompt of real text for the same number of tokens (no early
stop) through the same greedy loop, interleaved repeat by repeat so machine drift hits all
alike; medians are reported with ratios to plain HF ``DynamicCache`` from the same run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from kvopt.errors import KVOptError
from kvopt.eval.contenders import parse_contender
from kvopt.eval.decoding import QUERY_AWARE, run_prompt
from kvopt.eval.rows import BENCH_ROW_KEYS, load_rows
from kvopt.paths import writable_file

BENCH_FILE = "bench.jsonl"


def run_bench(
    lengths: list[int],
    methods: list[str],
    out_dir: Path,
    new_tokens: int = 128,
    repeats: int = 3,
    model_name: str | None = None,
    loaded: tuple | None = None,
    log: Callable[[str], None] = print,
    device: str | None = None,
) -> list[dict]:
    """Measure every method at every length into ``out_dir/bench.jsonl``; return this run's rows.

    Rows of lengths not measured in this run are kept (each length's ratios still come from
    one run), so long-context speed can be measured separately from short-context runs.
    """
    from kvopt.api import load_model
    from kvopt.local_text import real_text

    if not lengths or any(length < 1 for length in lengths):
        raise KVOptError("--lengths needs positive prompt lengths in tokens; use e.g. --lengths 512,2048")
    if new_tokens < 2 or repeats < 1:
        raise KVOptError(
            f"--new-tokens={new_tokens} and --repeats={repeats} must be at least 2 and 1; a decode speed needs two tokens"
        )
    specs = methods if "hf" in methods else ["hf", *methods]
    contenders = [parse_contender(spec) for spec in specs]
    path = writable_file(Path(out_dir) / BENCH_FILE, "--out")  # before minutes of measuring
    earlier = load_rows(path, BENCH_ROW_KEYS)
    model, tokenizer = loaded or load_model(model_name, device=device)
    text, _ = real_text()
    all_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(all_ids) < max(lengths):
        all_ids = (all_ids * (max(lengths) // len(all_ids) + 1))
    rows = []
    for length in lengths:
        ids = all_ids[:length]
        run_prompt(model, contenders[0], ids[:64], [], 2, QUERY_AWARE, set())  # warm-up
        for repeat in range(repeats):
            for contender in contenders:
                outcome = run_prompt(model, contender, ids, [], new_tokens, QUERY_AWARE, set(), tokenizer)
                rows.append(
                    {
                        "method": contender.spec,
                        "method_name": contender.method_name,
                        "family": contender.family,
                        "length": length,
                        "repeat": repeat,
                        "prefill_s": round(outcome.prefill_s, 4),
                        "decode_tok_s": round(outcome.decode_tok_s, 3),
                        "kv_bytes": outcome.kv_bytes_peak,
                        "new_tokens": new_tokens,
                    }
                )
                log(f"{length:>6} {contender.spec:<28} prefill {outcome.prefill_s:6.2f} s  decode {outcome.decode_tok_s:6.2f} tok/s")
    kept = [row for row in earlier if row["length"] not in lengths]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept + rows))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (length, method) with ratios to the ``hf`` row of the same length."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["length"], row["method"]), []).append(row)
    medians = {
        key: {
            "length": key[0],
            "method": key[1],
            "prefill_s": statistics.median(r["prefill_s"] for r in group),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in group),
            "kv_bytes": group[-1]["kv_bytes"],
            "repeats": len(group),
        }
        for key, group in groups.items()
    }
    for (length, _), entry in medians.items():
        base = medians.get((length, "hf"))
        entry["decode_vs_hf"] = entry["decode_tok_s"] / base["decode_tok_s"] if base else None
        entry["prefill_vs_hf"] = base["prefill_s"] / entry["prefill_s"] if base else None
        entry["bytes_vs_hf"] = entry["kv_bytes"] / base["kv_bytes"] if base else None
    return sorted(medians.values(), key=lambda e: (e["length"], e["method"] != "hf", e["method"]))
