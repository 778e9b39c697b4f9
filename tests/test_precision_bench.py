"""benchmarks/precision.py: each bf16 or int8 cell is paired with its fp32 cell on the same prompts, and a run's rows replace
only its own model's and dtype's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import precision  # noqa: E402


def row(dtype, method, sample, score, prediction, model="m", task="passkey"):
    return {"model": model, "dtype": dtype, "task": task, "length": 2048, "depth": 0.5, "sample": sample, "seed": 0,
            "mode": "query_agnostic", "method": method, "score": score, "prediction": prediction,
            "conditions": "one thread"}  # fmt: skip


def test_bf16_and_int8_are_each_paired_with_fp32_on_the_same_prompts():
    rows = [row("fp32", "full", s, 1, " 42") for s in range(4)]
    rows += [row("bf16", "full", s, score, text) for s, score, text in ((0, 1, " 42"), (1, 1, "42 "), (2, 0, " 7"), (3, 1, " 42."))]
    rows += [row("bf16", "full", 9, 1, " 42")]  # no fp32 twin: left out
    rows += [row("int8", "full", s, score, text) for s, score, text in ((0, 0, " 9"), (1, 1, " 42"))]
    text = precision.render(rows)
    assert "### m" in text and "passkey at 2,048 tokens." in text
    assert "| `full` | bf16 | 4 | 100% [51–100] (n=4) | 75% [30–95] (n=4) | 75% [30–95] of 4 | 2/4 |" in text  # " 42." is another text
    assert "| `full` | int8 | 2 | 100% [34–100] (n=2) | 50% [9–91] (n=2) | 50% [9–91] of 2 | 1/2 |" in text


def test_a_run_replaces_only_its_model_and_dtype_and_a_fresh_machine_resumes_from_the_rows(tmp_path, monkeypatch):
    from kvopt.eval.runner import load_done, row_key

    monkeypatch.setattr(precision, "ROWS", tmp_path / "rows.jsonl")
    monkeypatch.setattr(precision, "WORK", tmp_path / "work")
    committed = [row("fp32", "full", 0, 1, "a"), row("bf16", "full", 0, 1, "a"), row("fp32", "full", 0, 0, "b", model="q")]
    precision.ROWS.write_text("".join(json.dumps(r) + "\n" for r in committed))
    precision.seed("m", "bf16")
    work = precision.work_file("m", "bf16")
    assert load_done(work) == {row_key(committed[1])} and "dtype" not in json.loads(work.read_text())
    fresh = {k: v for k, v in row("bf16", "full", 1, 0, "c").items() if k not in ("dtype", "conditions")}
    work.write_text(work.read_text() + json.dumps(fresh) + "\n")
    precision.merge("m", "bf16")
    rows = [json.loads(line) for line in precision.ROWS.read_text().splitlines()]
    assert [(r["model"], r["dtype"], r["sample"]) for r in rows] == [("m", "fp32", 0), ("q", "fp32", 0), ("m", "bf16", 0), ("m", "bf16", 1)]
    assert rows[-1]["conditions"] == precision.CONDITIONS


def test_collecting_without_working_rows_keeps_the_committed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "ROWS", tmp_path / "rows.jsonl")
    monkeypatch.setattr(precision, "WORK", tmp_path / "work")
    committed = json.dumps(row("bf16", "full", 0, 1, "a")) + "\n"
    precision.ROWS.write_text(committed)
    precision.merge("m", "bf16")  # `--collect` on a machine that ran nothing
    assert precision.ROWS.read_text() == committed
