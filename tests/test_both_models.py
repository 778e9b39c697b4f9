"""The cross-model summary of BENCHMARKS.md (benchmarks/both_models.py) on synthetic rows of two models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import both_models  # noqa: E402

from kvopt.eval.contenders import parse_contender  # noqa: E402
from kvopt.eval.runner import EvalGrid, _jobs  # noqa: E402
from kvopt.eval.tasks import TASKS  # noqa: E402


def task_row(method: str, sample: int, score: float, length: int = 4096) -> dict:
    return {"task": "passkey", "length": length, "depth": 0.5, "sample": sample, "seed": 0, "mode": "query_agnostic",
            "method": method, "score": score}  # fmt: skip


def write(folder: Path, name: str, rows: list[dict]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def two_models(tmp_path):
    """Model A: kvzip keeps all of full's answers, the presses half; model B: the opposite. B lacks byte checks."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, kvzip, press in ((a, 1.0, 0.5), (b, 0.0, 1.0)):
        rows = []
        for sample in range(20):
            rows += [task_row("full", sample, 1.0), task_row("kvzip:ratio=0.75", sample, kvzip)]
            rows += [task_row("kvpress:tova:ratio=0.75", sample, float(sample % 2 == 0) if press == 0.5 else 1.0)]
            rows += [task_row("kvpress:snapkv:ratio=0.75", sample, 0.0)]
        write(folder, both_models.EVAL, rows)
    write(a, both_models.LOSSLESS, [{"length": 4096, "same_tokens": True, "max_abs_logit_diff": 2e-6}])
    write(b, both_models.LOSSLESS, [{"length": 4096, "same_tokens": False, "max_abs_logit_diff": 0.3}])
    write(a, both_models.CHECK, [{"method": "adakv:ratio=0.75", "measured": 260, "theoretical": 255, "full": 1000},
                                 {"method": "kvpress:adakv-snapkv:ratio=0.75", "measured": 1000, "theoretical": 250,
                                  "full": 1000}])  # fmt: skip
    return [("A", a), ("B", b)]


def test_each_headline_is_judged_per_model_from_its_rows(two_models):
    lines = both_models.section(two_models)
    table = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    kvzip = table["kvzip keeps more of full's answers than the best kvpress press at 75% removed (query-agnostic)"]
    assert "holds: kvzip kept 100%" in kvzip and "best press `tova` 50%" in kvzip and "(intervals apart)" in kvzip
    assert "does not hold: kvzip kept 0%" in kvzip and kvzip.endswith("| A only |")
    lossless = table["`full` is lossless: the same greedy tokens and logits as HF's DynamicCache"]
    assert "holds: 1/1 prompts same tokens" in lossless and "does not hold: 0/1" in lossless
    adakv = table["Ada-KV's per-head budgets really free memory (bytes held = its budget)"]
    assert "holds: adakv holds 0.26 of full's bytes, kvpress's AdaKV 1.00 (it masks)" in adakv
    assert adakv.endswith("| not measured | A; not measured on B |")
    assert table["... and at 90% removed"].endswith("| not measured | not measured | – |")


def test_one_model_gives_no_summary(two_models):
    assert both_models.section(two_models[:1]) == []


def test_grid_runs_sample_by_sample_so_a_partial_run_is_balanced():
    grid = EvalGrid(tasks=["passkey", "niah"], lengths=[512, 1024], methods=["full"], depths=2, samples=3)
    rows = [job["row"] for job in _jobs(grid, [parse_contender("full")], "tiny", TASKS)]
    assert [row["sample"] for row in rows] == sorted(row["sample"] for row in rows)
    first_third = rows[: len(rows) // 3]
    assert {(r["task"], r["length"], r["depth"]) for r in first_third} == {
        (r["task"], r["length"], r["depth"]) for r in rows
    }  # every cell has its first sample before any has a second


def test_streaming_perplexity_reads_the_canonical_specs_rows_carry(tmp_path):
    """The harness names rows by canonical spec ("window:size=1024" is "window"); the headline must find them, and
    compare them with `full`'s row at the same length, not with the quantizers' shorter stream's."""
    ppl = {"full": 7.09, "streamingllm:budget=1024,window=1020": 7.02, "window": 13.53}
    found = [{"task": "ppl", "method": method, "length": 8000, "ppl": value} for method, value in ppl.items()]
    found += [{"task": "ppl", "method": method, "length": 4096, "ppl": value} for method, value in (("full", 5.0), ("kivi", 5.1))]
    write(tmp_path, both_models.EVAL, found)
    finding = both_models.streaming_perplexity(tmp_path)
    assert finding.holds is True and "ppl full 7.09" in finding.text and "window alone 13.53" in finding.text


def test_a_step_can_run_part_of_its_contenders_now():
    """``--only`` keeps a step's contenders that are named (as typed or canonical), in the step's order, so a grid
    too long for one sitting is filled in parts; nothing named: all of them."""
    import run

    methods = run.agnostic_methods()
    chosen = run.only(methods, "kivi:bits=4,full,kvzip:ratio=0.75,kvpress:tova:ratio=0.75,kvzip:ratio=0.75,window:size=9")
    assert chosen == ["full", "kvzip:ratio=0.75", "kvpress:tova:ratio=0.75", "kivi:bits=4"]
    assert run.only(methods, None) == methods
    assert run.only(run.RETENTION, "tova:ratio=0.9") == []


def test_steps_rerun_alone_leave_a_partial_folder_whose_missing_sections_are_kept(tmp_path):
    """Every step's rows file present but no scored accuracy rows (perplexity re-run alone): not complete, so the
    report keeps the earlier accuracy sections instead of dropping them; one scored row makes it complete."""
    import run

    for name in run.RESULT_FILES:
        (tmp_path / name).write_text(json.dumps({"task": "ppl", "score": None, "ppl": 13.9}) + "\n")
    assert not run.complete(tmp_path)
    with (tmp_path / "eval.jsonl").open("a") as rows:
        rows.write(json.dumps({"task": "passkey", "score": 1.0}) + "\n")
    assert run.complete(tmp_path)
    (tmp_path / "bench.jsonl").unlink()
    assert not run.complete(tmp_path)


def test_kivi_against_quanto_needs_both_answers_and_speed_and_reads_canonical_specs(tmp_path):
    """`kivi:bits=4` rows are named `kivi` (its defaults dropped): found all the same. Speed alone gives no verdict
    when it holds (the answers are not measured) and a negative one when it fails."""
    speed = lambda method, tok_s: {"length": 4096, "method": method, "decode_tok_s": tok_s}  # noqa: E731
    write(tmp_path, both_models.MEMORY, [speed("kivi", 12.0), speed("hf-quanto:bits=4", 10.0),
                                         speed("kivi:bits=2", 9.0), speed("hf-quanto:bits=2", 10.0)])  # fmt: skip
    four, two = both_models.kivi_vs_quanto(4)(tmp_path), both_models.kivi_vs_quanto(2)(tmp_path)
    assert four.holds is None and "decode 1.20x at 4096" in four.text and "answers not measured" in four.text
    assert two.holds is False and "decode 0.90x at 4096" in two.text
    rows = []
    for sample in range(10):
        rows += [task_row("full", sample, 1.0), task_row("kivi", sample, 1.0), task_row("hf-quanto:bits=4", sample, 0.0)]
    write(tmp_path, both_models.EVAL, rows)
    four = both_models.kivi_vs_quanto(4)(tmp_path)
    assert four.holds is True and "kept 100%" in four.text and "vs quanto 0%" in four.text


def test_query_aware_snapkv_reads_only_query_aware_rows_and_needs_four_fifths(tmp_path):
    """The query-aware headline pairs snapkv with full's query-aware answers (the agnostic rows of the same prompts
    do not count) and holds from 80% of full's answers kept."""
    aware = lambda method, sample, score: {**task_row(method, sample, score), "mode": "query_aware"}  # noqa: E731
    rows = []
    for sample in range(10):
        rows += [aware("full", sample, 1.0), aware("snapkv:ratio=0.5", sample, float(sample < 8))]
        rows += [aware("snapkv:ratio=0.75", sample, float(sample < 7)), task_row("snapkv:ratio=0.75", sample, 1.0)]
        rows += [aware("kvpress:snapkv:ratio=0.5", sample, float(sample < 5))]
    write(tmp_path, both_models.EVAL, rows)
    half, quarter = both_models.snapkv_query_aware(0.5)(tmp_path), both_models.snapkv_query_aware(0.75)(tmp_path)
    assert half.holds is True and "snapkv kept 80%" in half.text and "kvpress's 50%" in half.text and "10 prompts" in half.text
    assert quarter.holds is False and "snapkv kept 70%" in quarter.text and "kvpress" not in quarter.text
    assert both_models.snapkv_query_aware(0.9)(tmp_path).holds is None


def test_two_bit_claim_waits_for_every_planned_cell_then_needs_the_prose_share_too(tmp_path):
    """No verdict from a partial 2-bit grid (the short cells and the best share so far are named); once complete, a
    recipe holds only when it keeps >= 80% of full's answers both pooled and on the prose tasks (passkeys kept cannot
    hide prose lost)."""
    grid = tmp_path / both_models.TWO_BIT_GRID
    grid.mkdir()
    plan = {"methods": ["full", "kivi:bits=2", "aquakv"], "tasks": ["passkey", "prose_needle"], "lengths": [2048],
            "prompts_per_cell": 4, "reference": "full", "two_bit": ["kivi:bits=2", "aquakv"]}  # fmt: skip
    (grid / both_models.TWO_BIT_PLAN).write_text(json.dumps(plan))
    assert both_models.two_bit_keeps(tmp_path / "elsewhere").holds is None

    def cell(method: str, task: str, scores: list[float]) -> list[dict]:
        return [{**task_row(method, sample, score, 2048), "task": task, "depth": 0.5} for sample, score in enumerate(scores)]

    # once complete: aquakv keeps every passkey and 2 of 4 prose needles (75%, prose 50%), kivi 7 of 8 (88%, prose 75%)
    found = cell("full", "passkey", [1, 1, 1, 1]) + cell("kivi:bits=2", "passkey", [1, 1, 1, 1])
    found += cell("aquakv", "passkey", [1, 1, 1, 1]) + cell("full", "prose_needle", [1, 1, 1, 1])
    found += cell("kivi:bits=2", "prose_needle", [1, 1, 1, 0]) + cell("aquakv", "prose_needle", [1, 1])
    write(grid, both_models.EVAL, found)
    partial = both_models.two_bit_keeps(tmp_path)
    assert partial.holds is None and "prose_needle@2048 (2/4)" in partial.text and "passkey@2048" not in partial.text
    assert "; so far best `aquakv` kept 100%" in partial.text
    assert partial.text.endswith("(prose 75% [30–95] of 4); 6 prompts")
    write(grid, both_models.EVAL, found + cell("aquakv", "prose_needle", [1, 1, 0, 0])[2:])
    complete = both_models.two_bit_keeps(tmp_path)
    assert complete.holds is False and "best `kivi:bits=2` kept 88%" in complete.text and "at 2048 tokens" in complete.text
    assert "prose tasks 75% [" in complete.text and "`aquakv` 75% [" in complete.text and "(prose 50% [" in complete.text
    write(grid, both_models.EVAL, [row for row in found if row["method"] != "kivi:bits=2" or row["sample"] != 3]
          + cell("kivi:bits=2", "prose_needle", [1, 1, 1, 1])[3:] + cell("kivi:bits=2", "passkey", [1, 1, 1, 1])[3:]
          + cell("aquakv", "prose_needle", [1, 1, 0, 0])[2:])  # fmt: skip
    assert both_models.two_bit_keeps(tmp_path).holds is True


def test_locret_claim_pairs_on_its_own_prompts_at_its_length_and_needs_nine_tenths(tmp_path):
    rows = [task_row("full", sample, 1.0) for sample in range(12)]
    rows += [task_row("locret:ratio=0.75", sample, float(sample != 0)) for sample in range(10)]  # 9 of 10
    rows += [task_row("kvzip:ratio=0.75", sample, 1.0) for sample in range(12)]  # 2 prompts locret did not run
    rows += [task_row("locret:ratio=0.75", sample, 0.0, length=8192) for sample in range(10)]  # another length
    write(tmp_path, both_models.EVAL, rows)
    finding = both_models.locret_keeps(4096, least=10)(tmp_path)
    assert finding.holds is True
    assert finding.text.startswith("locret kept 90% [60–98] of 10") and "kvzip 100% [72–100] of 10" in finding.text
    short = both_models.locret_keeps(4096)(tmp_path)  # fewer prompts than the grid's cell of 24: no verdict yet
    assert short.holds is None and short.text.startswith("not measured: 10 of 24 prompts so far (locret kept 90%")
    write(tmp_path, both_models.EVAL, [*rows[:12], *(task_row("locret:ratio=0.75", s, float(s > 1)) for s in range(10))])
    assert both_models.locret_keeps(4096, least=10)(tmp_path).holds is False
    assert both_models.locret_keeps(8192, least=10)(tmp_path).holds is None
