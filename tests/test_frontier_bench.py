"""benchmarks/frontier.py's report parts that take a second model: the cost table per model, the peak table, and a
run of one model replacing only that model's rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import frontier  # noqa: E402

QWEN = "qwen2.5-coder-0.5b"


def cost(method: str, seconds: float, length: int = 4096, model: str | None = None) -> dict:
    row = {"step": "cost", "method": method, "length": length, "repeat": 0, "prefill_s": seconds}
    return row if model is None else {**row, "model": model}


def test_cost_rows_of_two_models_get_their_own_rows_and_ratios():
    rows = [cost("full", 30.0), cost("kvzip:ratio=0.75", 120.0), cost("full", 40.0, model=QWEN),
            cost("locret:ratio=0.75", 44.0, model=QWEN)]  # fmt: skip
    lines = frontier._cost_part(frontier.rows_by_step(rows))
    assert "| 4096 | `kvzip:ratio=0.75` | 120.00 | 4.00x |" in lines
    assert f"| 4096 ({QWEN}) | `locret:ratio=0.75` | 44.00 | 1.10x |" in lines
    assert f"| 4096 ({QWEN}) | `kvzip:ratio=0.75` | not measured | – |" in lines
    assert "| 4096 | `locret:ratio=0.75` | not measured | – |" in lines


def test_peak_rows_compare_each_method_with_full():
    rows = [{"step": "peak", "method": spec, "length": 16384, "model": QWEN, "kv_bytes_peak": peak,
             "kv_bytes_end": end, "prefill_s": 300.0} for spec, peak, end in
            (("full", 400e6, 400e6), ("locret:budget=1024", 40e6, 25e6))]  # fmt: skip
    lines = frontier._peak_part(frontier.rows_by_step([cost("full", 30.0), *rows]))
    assert f"| {QWEN} | `locret:budget=1024` | 40.0 MB | 1/10.0 | 25.0 MB | 300.0 |" in lines
    assert any("16,384-token prompt" in line for line in lines)


def test_a_run_on_one_model_replaces_only_that_models_rows_of_its_step():
    old = [cost("full", 30.0), cost("full", 40.0, model=QWEN), {"step": "decode", "method": "full", "batch": 4}]
    assert frontier.others(old, "cost", 4, QWEN) == [old[0], old[2]]
    assert frontier.others(old, "cost", 4, frontier.MODEL) == [old[1], old[2]]
