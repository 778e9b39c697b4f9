"""The report generator on small synthetic results: tables, intervals, plots, missing and corrupt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvopt.errors import KVOptError
from kvopt.eval import report
from kvopt.eval.report import load_rows, wilson_interval, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FULL_BYTES = 1_000_000
# (spec, method_name, family, ratio)
METHODS = [
    ("hf", "hf", "hf", None),
    ("full", "full", "kvopt", None),
    ("snapkv:ratio=0.5", "snapkv", "kvopt", 0.5),
    ("snapkv:ratio=0.75", "snapkv", "kvopt", 0.75),
    ("kvpress:snapkv:ratio=0.5", "kvpress:snapkv", "kvpress", 0.5),
]


def score_of(ratio: float | None, length: int, depth: float) -> float:
    """Baselines always right; compressed methods miss the mid-depth needle at the longer length."""
    return 0.0 if ratio and length == 2048 and depth == 0.5 else 1.0


def task_rows() -> list[dict]:
    rows = []
    for spec, name, family, ratio in METHODS:
        for mode in ("query_agnostic", "query_aware"):
            for task in ("passkey", "niah"):
                for length in (1024, 2048):
                    for depth in (0.0, 0.5, 1.0):
                        for sample in range(2):
                            kept = 1 - (ratio or 0)
                            rows.append({
                                "task": task, "length": length, "depth": depth, "sample": sample, "seed": 0,
                                "mode": mode, "method": spec, "method_name": name, "family": family,
                                "ratio": ratio, "score": score_of(ratio, length, depth), "prediction": "x",
                                "answers": ["x"], "prompt_tokens": length - 40,
                                "kv_bytes_peak": int(FULL_BYTES * kept * length / 1024),
                                "kv_bytes_full": FULL_BYTES * length // 1024, "compression": 1 - kept,
                                "prefill_s": 0.1, "decode_tok_s": 30.0, "wall_s": 0.2,
                                "model": "SmolLM2-135M-Instruct", "unknown_extra_key": [1, 2],
                            })
    return rows


def ppl_rows() -> list[dict]:
    return [
        {"task": "ppl", "length": 4096, "depth": None, "sample": 0, "seed": 0, "mode": "streaming",
         "method": spec, "method_name": name, "family": family, "ratio": ratio, "score": None,
         "ppl": ppl, "tokens": 4000, "ppl_first": ppl - 1, "first_tokens": 1000,
         "kv_bytes_peak": 2_000_000, "kv_bytes_full": 4_000_000, "model": "SmolLM2-135M-Instruct"}
        for (spec, name, family, ratio), ppl in zip(METHODS[:3], (10.0, 10.0, 11.0))
    ]


def bench_rows() -> list[dict]:
    rows = []
    for spec, family, speed in (("hf", "hf", 40.0), ("full", "kvopt", 30.0), ("window:size=512", "kvopt", 20.0)):
        for length in (1024, 2048):
            for repeat, jitter in enumerate((0.0, 5.0, -1.0)):
                kv = 512 * 1000 if spec.startswith("window") else length * 1000
                rows.append({"method": spec, "method_name": spec.split(":")[0], "family": family, "length": length,
                             "repeat": repeat, "prefill_s": 0.5, "decode_tok_s": speed + jitter, "kv_bytes": kv,
                             "new_tokens": 16})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, path


def test_wilson_known_cases():
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(10, 10)[1] == 1.0
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(2.5, 5)  # fractional successes: mean 0.5, symmetric interval
    assert low < 0.5 < high and low == pytest.approx(1 - high)
    for n in range(1, 200):  # the mean always lies inside, rounding included (plots draw mean - low)
        for successes in (0, n):
            low, high = wilson_interval(successes, n)
            assert low <= successes / n <= high


def test_report_tables_and_plots(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "MAX_HEATMAPS", 3)  # the cap, and fewer PNGs to draw
    results = tmp_path / "results"
    results.mkdir()
    write_jsonl(results / "eval.jsonl", task_rows() + ppl_rows())
    write_jsonl(results / "bench.jsonl", bench_rows())

    path = write_report(results, tmp_path / "out", title="Test run")
    assert path == tmp_path / "out" / "REPORT.md"
    text = path.read_text(encoding="utf-8")

    assert text.startswith("# Test run")
    assert "SmolLM2-135M-Instruct" in text and "compare the 95% Wilson" in text
    assert "### Mode `query_agnostic`" in text and "### Mode `query_aware`" in text
    assert "#### passkey" in text and "#### all tasks" in text
    # snapkv 0.5, passkey, 2048: 3 depths x 2 samples, the 2 mid-depth ones fail -> 4/6.
    snap_lines = [line for line in text.splitlines() if line.startswith("| `snapkv:ratio=0.5` |")]
    assert "67% [30–90] (n=6)" in snap_lines[0]
    assert "100% [61–100] (n=6)" in snap_lines[0]  # same table, length 1024
    # Baselines lead every table: hf, then full, then kvopt methods, then peers.
    table = text.split("#### passkey")[1]
    order = [table.index(f"| `{spec}` |") for spec, *_ in METHODS]
    assert order == sorted(order)

    ppl_section = text.split("## Perplexity")[1].split("## Speed")[0]
    assert "+10.0%" in ppl_section and "(first 1000)" in ppl_section and "baseline" in ppl_section

    speed_section = text.split("## Speed")[1].split("## Plots")[0]
    window_1024 = next(line for line in speed_section.splitlines() if line.startswith("| `window:size=512` | 1024 |"))
    assert "| 3 | 0.500 | 20.0 |" in window_1024 and "0.50×" in window_1024  # median 20 vs hf's 40

    images = sorted(line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("!["))
    heatmaps = [name for name in images if name.startswith("heatmap_")]
    assert len(heatmaps) == 3 and "more (method, mode) heatmaps omitted" in text
    assert {"frontier_query_agnostic.png", "frontier_query_aware.png", "memory_vs_length.png", "speed_vs_length.png"} <= set(images)
    assert "heatmap_hf_query_agnostic.png" in heatmaps
    for name in images:
        assert not set(name) & set(":=, ")
        assert_png(tmp_path / "out" / name)


def test_missing_bench_uses_eval_memory(tmp_path):
    write_jsonl(tmp_path / "eval.jsonl", [r for r in task_rows() if r["task"] == "passkey" and r["mode"] == "query_aware"])
    text = write_report(tmp_path, tmp_path / "out").read_text(encoding="utf-8")
    assert "No bench.jsonl rows" in text
    assert "#### passkey" not in text  # one task: no per-task split
    assert "speed_vs_length.png" not in text
    assert_png(tmp_path / "out" / "memory_vs_length.png")


def test_missing_and_empty_eval(tmp_path):
    text = write_report(tmp_path, tmp_path / "out").read_text(encoding="utf-8")
    assert "eval.jsonl is missing" in text and "No bench.jsonl rows" in text
    (tmp_path / "eval.jsonl").write_text("\n", encoding="utf-8")
    text = write_report(tmp_path, tmp_path / "out").read_text(encoding="utf-8")
    assert "eval.jsonl is empty" in text
    with pytest.raises(KVOptError, match="does not exist"):
        write_report(tmp_path / "nope", tmp_path / "out")


def test_corrupt_line_names_file_and_line(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n', encoding="utf-8")
    with pytest.raises(KVOptError, match=r"eval\.jsonl, line 3"):
        load_rows(path)
    path.write_text('{"a": 1}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(KVOptError, match="line 2: expected a JSON object"):
        load_rows(path)


def test_retention_pairs_each_method_with_the_reference_prompt_by_prompt():
    def row(method: str, sample: int, score: float) -> dict:
        return {"task": "passkey", "length": 1024, "depth": 0.5, "sample": sample, "seed": 0, "mode": "query_agnostic",
                "method": method, "method_name": method.split(":")[0], "family": "kvopt", "score": score}  # fmt: skip

    full = [row("full", s, score) for s, score in enumerate([1, 1, 1, 0])]
    # Solves two of full's three answers, the prompt full misses, and one prompt full never ran.
    method = [row("tova:ratio=0.75", s, score) for s, score in enumerate([1, 0, 1, 1, 1])]
    lines = report._retention_section(full + method, report._methods(full + method))
    line = next(line for line in lines if line.startswith("| `tova:ratio=0.75` |"))
    low, high = wilson_interval(2, 3)
    assert f"| 4 | 75% vs 75% | 67% [{low * 100:.0f}–{high * 100:.0f}] of 3 |" in line
    assert report._retention_section(method, report._methods(method)) == []  # no reference, no table


def _prompt_rows(method: str, scores: list[float], task: str = "passkey") -> list[dict]:
    return [{"task": task, "length": 2048, "depth": 0.5, "sample": sample, "seed": 0, "mode": "query_agnostic",
             "method": method, "score": score} for sample, score in enumerate(scores)]  # fmt: skip


def test_kept_is_the_share_of_the_references_answers_never_a_ratio_of_accuracies():
    from kvopt.eval.report import retention

    full = _prompt_rows("full", [1, 1, 0, 0])
    only_misses = retention(_prompt_rows("m", [0, 0, 1, 1]), full)
    assert only_misses.kept == 0.0 and only_misses.accuracy == 0.5 and only_misses.reference_accuracy == 0.5
    assert only_misses.low == 0.0 and only_misses.cell().startswith("0% [0–")
    # A higher accuracy than full's (gains on full's misses) still keeps at most 100%: here half.
    better = retention(_prompt_rows("m", [1, 0, 1, 1]), full)
    assert better.accuracy == 0.75 and better.kept == 0.5 and better.high < 1.0
    assert better.with_accuracy() == f"{better.cell()} (accuracy 75% vs full's 50%)"
    assert retention(_prompt_rows("m", [1, 1]), _prompt_rows("full", [0, 0])) is None  # nothing to keep


def test_kept_pairs_by_prompt_identity_not_by_row_order():
    from kvopt.eval.report import retention

    full = _prompt_rows("full", [1, 0, 1])
    method = list(reversed(_prompt_rows("m", [1, 0, 0])))
    other_task = _prompt_rows("m", [1, 1, 1], task="niah")  # full never ran these prompts: not paired
    rerun = [dict(method[0], score=1.0)]  # a second row for a prompt: its first row counts
    kept = retention(method + other_task + rerun, full)
    assert kept.prompts == 3 and kept.answered == 2 and kept.kept == 0.5


def test_kept_credits_a_partial_score_up_to_the_references_on_that_prompt():
    from kvopt.eval.report import retention

    # niah_multivalue: full finds 2 of 4 values on the first prompt, all 4 on the second.
    full = _prompt_rows("full", [0.5, 1.0, 0.0], task="niah_multivalue")
    method = _prompt_rows("m", [1.0, 0.25, 0.75], task="niah_multivalue")
    kept = retention(method, full)
    # credited min(1.0, 0.5) + min(0.25, 1.0) + min(0.75, 0.0) of full's 1.5
    assert kept.answered == 1.5 and kept.kept == (0.5 + 0.25) / 1.5
    assert (kept.low, kept.high) == wilson_interval(0.75, 1.5)
    assert kept.cell().startswith("50% [") and kept.cell().endswith("of 1.5")


def test_keep_sections_puts_missing_ones_back_in_their_place_marked_once():
    from kvopt.eval.report import KEPT_NOTE, NO_BENCH, NO_TASKS, keep_sections

    old = "# T\nold intro\n## A\n\na1\n## B\n\nb1\n## C (4096 tokens)\n\nc1\n"
    new = "# T\nnew intro\n## A\n\na2\n## C (8192 tokens)\n\nc2\n"
    merged, kept = keep_sections(new, old)
    assert kept == ["## B"]
    assert merged.index("## A") < merged.index("## B") < merged.index("## C (8192")
    assert "a2" in merged and "c2" in merged and "a1" not in merged and "c1" not in merged and "new intro" in merged
    assert merged.count(KEPT_NOTE) == 1 and f"{KEPT_NOTE}\n\nb1" in merged
    again, _ = keep_sections(new, merged)  # kept twice: still one note
    assert again.count(KEPT_NOTE) == 1 and again == merged
    placeholders = f"# T\n## Accuracy\n\n{NO_TASKS}\n## Speed\n\n{NO_BENCH}\n"
    restored, kept = keep_sections(placeholders, "# T\n## Accuracy\n\nt1\n## Speed\n\ns1\n")
    assert kept == ["## Accuracy", "## Speed"] and "t1" in restored and "s1" in restored
    assert NO_BENCH not in restored and NO_TASKS not in restored
