"""BENCHMARKS.md's "What holds on both models": each headline claim, measured on every model's rows.

A claim measured on one small model may describe that model more than the method (SmolLM2-135M's
attention loses retrieval under selection methods that work on larger models), so each headline
is recomputed from every model's committed rows (benchmarks/results/ and benchmarks/results/<model>/)
and marked as holding, not holding, or not measured there. Nothing here is typed in by hand.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvopt.eval.contenders import parse_contender
from kvopt.eval.report import KEPT_RULE, Retention, retention

#: Rows of kvopt's eval grid per model folder, and of the steps that measure bytes and speed.
EVAL, CHECK, MEMORY, LOSSLESS = "eval.jsonl", "memory_check.jsonl", "decode_memory.jsonl", "lossless.jsonl"
SUMMARY = "## What holds on both models"


@dataclass(frozen=True)
class Finding:
    """One claim on one model: the numbers behind it and whether they support it (None: not measured)."""

    text: str
    holds: bool | None


def rows(folder: Path, name: str) -> list[dict]:
    path = folder / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def scored_rows(folder: Path, mode: str = "query_agnostic") -> dict[str, list[dict]]:
    """Scored task rows of ``mode`` (query-agnostic unless told) per method spec."""
    found: dict[str, list[dict]] = {}
    for row in rows(folder, EVAL):
        if row.get("score") is not None and row.get("mode") == mode:
            found.setdefault(row["method"], []).append(row)
    return found


def lossless(folder: Path) -> Finding:
    checks = rows(folder, LOSSLESS)
    if not checks:
        return Finding("not measured", None)
    worst = max(row["max_abs_logit_diff"] for row in checks)
    same = sum(row["same_tokens"] for row in checks)
    text = f"{same}/{len(checks)} prompts same tokens, max logit diff {worst:.1e}"
    return Finding(text, same == len(checks) and worst <= 1e-4)


def best_of_presses(scores: dict[str, list[dict]], ratio: float) -> tuple[str, Retention] | None:
    """The kvpress press keeping the most of full's answers at ``ratio`` removed."""
    kept = {spec: retention(found, scores["full"]) for spec, found in scores.items()
            if spec.startswith("kvpress:") and spec.endswith(f":ratio={ratio}")}  # fmt: skip
    kept = {spec: value for spec, value in kept.items() if value is not None}
    return max(kept.items(), key=lambda item: item[1].kept) if kept else None


def kvzip_vs_presses(ratio: float) -> Callable[[Path], Finding]:
    def measure(folder: Path) -> Finding:
        scores = scored_rows(folder)
        ours = retention(scores.get(f"kvzip:ratio={ratio}", []), scores.get("full", []))
        press = best_of_presses(scores, ratio) if "full" in scores else None
        if ours is None or press is None:
            return Finding("not measured", None)
        spec, theirs = press
        clearly = " (intervals apart)" if ours.low > theirs.high else " (intervals overlap)"
        text = (f"kvzip kept {ours.with_accuracy()} vs best press `{spec.split(':')[1]}` {theirs.with_accuracy()}, "
                f"{ours.prompts} prompts")
        return Finding(text + (clearly if ours.kept > theirs.kept else ""), ours.kept > theirs.kept)

    return measure


def snapkv_query_aware(ratio: float) -> Callable[[Path], Finding]:
    """SnapKV's published setting (the question inside the compressed prompt): near-lossless retrieval, here
    read as keeping at least 80% of full's answers."""

    def measure(folder: Path) -> Finding:
        scores = scored_rows(folder, "query_aware")
        ours = retention(scores.get(f"snapkv:ratio={ratio}", []), scores.get("full", []))
        if ours is None:
            return Finding("not measured", None)
        press = retention(scores.get(f"kvpress:snapkv:ratio={ratio}", []), scores["full"])
        text = f"snapkv kept {ours.with_accuracy()}" + (f", kvpress's {press.with_accuracy()}" if press else "")
        return Finding(f"{text}, {ours.prompts} prompts", ours.kept >= 0.8)

    return measure


def adakv_bytes(folder: Path) -> Finding:
    by_method = {row["method"]: row for row in rows(folder, CHECK)}
    ours, press = by_method.get("adakv:ratio=0.75"), by_method.get("kvpress:adakv-snapkv:ratio=0.75")
    if ours is None:
        return Finding("not measured", None)
    text = f"adakv holds {ours['measured'] / ours['full']:.2f} of full's bytes"
    if press is not None:
        text += f", kvpress's AdaKV {press['measured'] / press['full']:.2f} (it masks)"
    return Finding(text, ours["measured"] <= 1.05 * ours["theoretical"] and ours["measured"] < 0.5 * ours["full"])


def kivi_vs_quanto(bits: int) -> Callable[[Path], Finding]:
    """Answers (share of full's kept, intervals overlapping or better) and decode speed (>= quanto's at every
    length): holds when both were measured and hold, does not when either fails."""
    kivi, quanto = (parse_contender(spec).spec for spec in (f"kivi:bits={bits}", f"hf-quanto:bits={bits}"))

    def measure(folder: Path) -> Finding:
        scores = scored_rows(folder)
        ours = retention(scores.get(kivi, []), scores.get("full", []))
        theirs = retention(scores.get(quanto, []), scores.get("full", []))
        speeds: dict[tuple[int, str], list[float]] = {}
        for row in rows(folder, MEMORY):
            speeds.setdefault((row["length"], row["method"]), []).append(row["decode_tok_s"])
        ratios = {length: statistics.median(speeds[(length, kivi)]) / statistics.median(speeds[(length, quanto)])
                  for length, method in speeds if method == kivi and (length, quanto) in speeds}  # fmt: skip
        parts, verdicts = [], []
        if ours is not None and theirs is not None:
            parts.append(f"kept {ours.with_accuracy()} vs quanto {theirs.with_accuracy()}")
            verdicts.append(ours.high >= theirs.low)  # no worse than quanto beyond the noise
        else:
            parts.append("answers not measured")
        if ratios:
            parts.append("decode " + ", ".join(f"{ratio:.2f}x at {length}" for length, ratio in sorted(ratios.items())))
            verdicts.append(min(ratios.values()) >= 1.0)
        else:
            parts.append("decode not measured")
        if not verdicts:
            return Finding("not measured", None)
        # a conjunction: one part failing settles it; holding needs both parts measured
        return Finding("; ".join(parts), False if not all(verdicts) else (True if len(verdicts) == 2 else None))

    return measure


def streaming_perplexity(folder: Path) -> Finding:
    """Sinks + window against full and a plain window, on the longest stream all three ran (a folder also holds
    the quantizers' shorter streams, with a `full` row of their own)."""
    by_length: dict[int, dict[str, float]] = {}
    for row in rows(folder, EVAL):
        if row.get("ppl") is not None:
            by_length.setdefault(row["length"], {})[row["method"]] = row["ppl"]
    # rows name a contender by its canonical spec (defaults dropped: "window:size=1024" is "window")
    wanted = [parse_contender(spec).spec for spec in ("streamingllm:sinks=4,window=1020", "window:size=1024", "full")]
    lengths = [length for length, ppl in by_length.items() if all(spec in ppl for spec in wanted)]
    if not lengths:
        return Finding("not measured", None)
    sinks, window, full = (by_length[max(lengths)][spec] for spec in wanted)
    text = f"ppl full {full:.2f}, sinks + window {sinks:.2f} ({sinks / full - 1:+.1%}), window alone {window:.2f}"
    return Finding(text, sinks / full - 1 <= 0.10 and window > sinks)


#: benchmarks/twobit.py's grid under a model's rows folder: its raw rows and the plan they fill.
TWO_BIT_GRID, TWO_BIT_PLAN = "twobit", "plan.json"
PROSE_TASKS = ("prose_needle", "prose_multikey")
#: Every rows file of a model's folder the headlines read (for the days they were measured).
FILES = (EVAL, CHECK, MEMORY, LOSSLESS, f"{TWO_BIT_GRID}/{EVAL}")


def two_bit_keeps(folder: Path) -> Finding:
    """Some 2-bit recipe keeps >= 80% of full's answers over the whole 2-bit grid and over its needles in prose.

    Judged only once every (method, task, length) cell of the grid's plan has its prompts: a partial grid is
    "not measured", naming the task and length cells still short of prompts (fewest rows of any method) and the
    best recipe's share so far."""
    grid = folder / TWO_BIT_GRID
    if not (grid / TWO_BIT_PLAN).exists():
        return Finding("not measured", None)
    plan = json.loads((grid / TWO_BIT_PLAN).read_text())
    scored = [row for row in rows(grid, EVAL) if row.get("score") is not None and row["method"] in plan["methods"]]
    prompts: dict[tuple, set] = {}
    for row in scored:
        prompts.setdefault((row["method"], row["task"], row["length"]), set()).add((row["depth"], row["sample"]))
    short = {}
    for task in plan["tasks"]:
        for length in plan["lengths"]:
            fewest = min(len(prompts.get((method, task, length), ())) for method in plan["methods"])
            if fewest < plan["prompts_per_cell"]:
                short[f"{task}@{length}"] = fewest
    best = _best_two_bit(plan, scored)
    if short:
        cells = ", ".join(f"{cell} ({count}/{plan['prompts_per_cell']})" for cell, count in short.items())
        so_far = f"; so far {best[0]}" if best else ""
        return Finding(f"not measured: 2-bit grid cells still short of prompts: {cells}{so_far}", None)
    if best is None:
        return Finding("not measured: full answered none of the 2-bit grid's prose prompts", None)
    text, holds = best
    lengths = "/".join(str(length) for length in sorted(plan["lengths"]))
    return Finding(f"{text} at {lengths} tokens", holds)


def _best_two_bit(plan: dict, scored: list[dict]) -> tuple[str, bool] | None:
    """The 2-bit recipe keeping the most of full's answers on its weaker side (pooled or prose), beside the others,
    and whether it keeps >= 80% on both; None when full answered none of the prose prompts."""
    by_method = {method: [row for row in scored if row["method"] == method] for method in plan["methods"]}
    reference = by_method[plan["reference"]]
    prose_reference = [row for row in reference if row["task"] in PROSE_TASKS]
    shares = {}
    for spec in plan["two_bit"]:
        pooled = retention(by_method[spec], reference)
        prose = retention([row for row in by_method[spec] if row["task"] in PROSE_TASKS], prose_reference)
        if pooled is not None and prose is not None:
            shares[spec] = pooled, prose
    if not shares:
        return None
    # the prose share must hold too: a pooled share can hide prose needles lost behind kept passkeys
    spec, (pooled, prose) = max(shares.items(), key=lambda item: min(item[1][0].kept, item[1][1].kept))
    others = ", ".join(f"`{other}` {all_.cell()} (prose {own.cell()})" for other, (all_, own) in shares.items()
                       if other != spec)  # fmt: skip
    text = f"best `{spec}` kept {pooled.with_accuracy()}, prose tasks {prose.cell()}; {others}"
    return f"{text}; {pooled.prompts} prompts", pooled.kept >= 0.8 and prose.kept >= 0.8


def locret_keeps(length: int, least: int = 24) -> Callable[[Path], Finding]:
    """Locret's trained heads against full (and kvzip, on the same prompts) at 75% removed, query-agnostic, judged
    once ``least`` prompts (the grid's cell: 3 tasks x 8 samples) are paired."""

    def measure(folder: Path) -> Finding:
        scores = {spec: [r for r in found if r["length"] == length] for spec, found in scored_rows(folder).items()}
        ours = retention(scores.get("locret:ratio=0.75", []), scores.get("full", []))
        if ours is None:
            return Finding("not measured", None)
        if ours.prompts < least:
            return Finding(f"not measured: {ours.prompts} of {least} prompts so far (locret kept {ours.cell()})", None)
        prompt = lambda r: (r["task"], r["depth"], r["sample"])  # noqa: E731
        prompts = {prompt(r) for r in scores["locret:ratio=0.75"]}
        kvzip = retention([r for r in scores.get("kvzip:ratio=0.75", []) if prompt(r) in prompts], scores["full"])
        beside = f"; kvzip {kvzip.cell()} on the same prompts" if kvzip else ""
        return Finding(f"locret kept {ours.with_accuracy()}{beside}, {ours.prompts} prompts", ours.kept >= 0.9)

    return measure


#: (headline, how it is measured on one model's folder).
HEADLINES: list[tuple[str, Callable[[Path], Finding]]] = [
    ("`full` is lossless: the same greedy tokens and logits as HF's DynamicCache", lossless),
    ("kvzip keeps more of full's answers than the best kvpress press at 75% removed (query-agnostic)",
     kvzip_vs_presses(0.75)),
    ("... and at 90% removed", kvzip_vs_presses(0.9)),
    ("SnapKV with the question inside the prompt (query-aware) keeps >= 80% of full's answers at 50% removed",
     snapkv_query_aware(0.5)),
    ("... and at 75% removed", snapkv_query_aware(0.75)),
    ("Ada-KV's per-head budgets really free memory (bytes held = its budget)", adakv_bytes),
    ("`kivi:bits=4` answers as well as HF quanto 4-bit and decodes faster", kivi_vs_quanto(4)),
    ("`kivi:bits=2` answers as well as HF quanto 2-bit and decodes faster", kivi_vs_quanto(2)),
    ("Streaming with attention sinks stays within 10% of full's perplexity; a plain window does worse",
     streaming_perplexity),
    ("A 2-bit recipe keeps >= 80% of full's answers, prose needles included (passkey, niah, niah_multivalue, "
     "prose_needle, prose_multikey; query-agnostic)", two_bit_keeps),
    ("Locret's trained retaining heads keep >= 90% of full's answers at 75% removed (4k, query-agnostic)",
     locret_keeps(4096)),
    ("... and at 8k", locret_keeps(8192)),
]


def section(models: list[tuple[str, Path]]) -> list[str]:
    """The summary table over ``(model label, rows folder)`` pairs; none with fewer than two models."""
    if len(models) < 2:
        return []
    verdict = {True: "holds", False: "does not hold", None: "not measured"}
    header = ["headline", *(label for label, _ in models), "holds on"]
    lines = [
        SUMMARY,
        "",
        "Each headline recomputed from each model's rows (sections below); `kept` is the share of full's correct "
        f"answers the method also gives on the same prompts, with its 95% Wilson interval. {KEPT_RULE} "
        "`not measured`: that model's results folder has no rows for it yet (a section marked as kept from an "
        "earlier run has none).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for headline, measure in HEADLINES:
        findings = [measure(folder) for _, folder in models]
        cells = [f"{verdict[f.holds]}: {f.text}" if f.holds is not None else f.text for f in findings]
        holding = [label for (label, _), f in zip(models, findings) if f.holds]
        measured = [f for f in findings if f.holds is not None]
        if len(holding) == len(models):
            where = "both"
        elif holding and len(measured) < len(models):  # no verdict where a model has no rows yet
            unmeasured = [label for (label, _), f in zip(models, findings) if f.holds is None]
            where = ", ".join(holding) + "; not measured on " + ", ".join(unmeasured)
        elif holding:
            where = ", ".join(holding) + " only"
        else:
            where = "neither" if len(measured) == len(models) else "–"
        lines.append("| " + " | ".join([headline, *cells, where]) + " |")
    return lines + [""]
