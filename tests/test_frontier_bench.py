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


def test_the_peak_is_read_before_each_eviction_not_only_after():
    held = [100]

    class Cache:
        def nbytes(self) -> int:
            return held[0]

    def act() -> None:  # a chunk stored (held 100), then evicted down to 40
        held[0] = 40

    peak = [0]
    frontier._watched(act, Cache(), peak)()
    assert peak == [100] and held == [40]


def test_a_run_on_one_model_replaces_only_that_models_rows_of_its_step():
    old = [cost("full", 30.0), cost("full", 40.0, model=QWEN), {"step": "decode", "method": "full", "batch": 4}]
    assert frontier.others(old, "cost", 4, QWEN) == [old[0], old[2]]
    assert frontier.others(old, "cost", 4, frontier.MODEL) == [old[1], old[2]]


def test_a_cost_run_at_named_lengths_replaces_only_those_lengths_rows():
    old = [cost("full", 30.0, model=QWEN), cost("full", 90.0, length=8192, model=QWEN)]
    assert frontier.others(old, "cost", 4, QWEN, [8192]) == [old[0]]
    assert frontier.others(old, "cost", 4, QWEN) == []


def answered(method: str, scores: list[float], length: int = 4096) -> list[dict]:
    return [{"task": "passkey", "depth": 0.5, "sample": index, "length": length, "mode": "query_agnostic",
             "method": method, "score": score} for index, score in enumerate(scores)]  # fmt: skip


def test_locret_tables_pair_on_locrets_prompts_pick_the_best_press_and_judge_the_target():
    evaluated = {
        frontier.MODEL: [],
        QWEN: [
            *answered("full", [1, 1, 1, 1, 0, 1]),  # the sixth prompt: not one locret ran, so left out
            *answered("locret:ratio=0.75", [1, 1, 1, 1, 1]),
            *answered("kvzip:ratio=0.75", [1, 1, 0, 1, 0]),
            *answered("kvpress:tova:ratio=0.75", [1, 0, 0, 0, 0]),
            *answered("kvpress:snapkv:ratio=0.75", [1, 1, 0, 0, 0]),
            *answered("tova:ratio=0.9", [1, 0, 0, 1, 0]),
            *answered("kvpress:tova:ratio=0.9", [0, 1, 0, 0, 0]),
            *answered("kvpress:snapkv:ratio=0.9", [1, 1]),  # tried on two prompts only: not the best press
        ],
    }
    timed = [cost("full", 30.0, model=QWEN), cost("locret:ratio=0.75", 33.0, model=QWEN)]
    lines = frontier._learned_part(frontier.rows_by_step(timed), evaluated)
    assert "| `locret:ratio=0.75` | 5 | 100% [57–100] (n=5) | 100% [51–100] of 4 | 1.10x |" in lines
    assert "| `kvzip:ratio=0.75` | 5 | 60% [23–88] (n=5) | 75% [30–95] of 4 | – |" in lines
    assert "| `tova:ratio=0.75` | 0 | not measured | – | – |" in lines
    assert any(line.startswith("| `kvpress:snapkv:ratio=0.75` | 5 |") for line in lines)
    assert not any("kvpress:tova:ratio=0.75" in line or "kvpress:snapkv:ratio=0.9" in line for line in lines)
    assert "| `tova:ratio=0.9` | 5 | 40% [12–77] (n=5) | 50% [15–85] of 4 | – |" in lines
    assert "| `shallowzip:ratio=0.9` | 0 | not measured | – | – |" in lines
    assert any(line.startswith("| `kvpress:tova:ratio=0.9` | 5 |") for line in lines)
    assert any("at 1.10x `full`'s prefill: **met**" in line for line in lines)
    assert any(line.startswith("Not measured yet:") and f"{QWEN} at 8192" in line for line in lines)


def test_locret_target_is_not_met_when_it_keeps_too_little_and_not_judged_when_its_prefill_was_not_timed():
    evaluated = {QWEN: [*answered("full", [1] * 10), *answered("locret:ratio=0.75", [1] * 8 + [0, 0])]}
    timed = [cost("full", 30.0, model=QWEN), cost("locret:ratio=0.75", 31.0, model=QWEN)]
    (verdict,) = [line for line in frontier._learned_part(frontier.rows_by_step(timed), evaluated) if "Target" in line]
    assert "kept 80% [49–94] of 10 at 1.03x" in verdict and verdict.endswith("**not met**.")
    evaluated = {QWEN: [*answered("full", [1] * 10), *answered("locret:ratio=0.75", [1] * 10)]}
    (verdict,) = [line for line in frontier._learned_part({}, evaluated) if "Target" in line]
    assert "at – `full`'s prefill: **not judged yet: its prefill is not timed at 4096 tokens (step `cost`)**" in verdict
