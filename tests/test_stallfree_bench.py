"""benchmarks/stallfree.py: its section (a table per arrival mode, the issue's targets computed from the rows against
fixed-4096 of the same run, holding or not), the Prometheus-style histogram quantile and the arrival times. No server."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import stallfree  # noqa: E402


def row(config: str, arrivals: str = "fixed", p50: float = 0.2, p99: float = 0.5, tok_s: float = 10.0,
        ttft: float | None = 12.0, target: float | None = None, **extra) -> dict:  # fmt: skip
    documents = 0 if arrivals == "none" else 6
    return {"config": config, "arrivals": arrivals, "users": 4, "threads": 1, "documents": documents,
            "document_tokens": [3000, 6000] if documents else [], "interval": 8.0, "chat_tokens": 48,
            "document_new_tokens": 16, "kv_memory": "1GB", "max_model_len": 8192, "cpus": 2,
            "cpu_flags": ["avx2", "avx512_f"], "date": "2025-01-02", "status": "ok", "reason": None,
            "chat_itl_p50": p50, "chat_itl_p99": p99, "chat_ttft_p50": 0.1, "chat_ttft_p99": 0.3, "output_tok_s": tok_s,
            "document_ttft_p50": ttft if documents else None, "prediction_p50": 1.02, "prediction_p90": 1.4,
            "missed_steps": 3.0 if target else 0.0, "prefill_budget": 4096.0 if target is None else 200.0,
            "itl_target_s": target, **extra}  # fmt: skip


def test_the_tables_and_each_target_holding():
    rows = [row("fixed-4096", p50=0.2, p99=10.0, tok_s=10.0, ttft=12.0),
            row("fixed-512", p50=0.25, p99=2.0, tok_s=9.0, ttft=16.0),
            row("auto", p50=0.2, p99=0.5, tok_s=9.8, ttft=14.0, target=0.2)]  # fmt: skip
    text = stallfree.render(rows)
    assert text.startswith("## Chat beside documents (stall-free serving)\n\nMeasured 2025-01-02 with "
                           "`python benchmarks/stallfree.py` (rows: `benchmarks/results/stallfree.jsonl`")  # fmt: skip
    assert "flags: avx2, avx512_f" in text and "1 torch thread(s)" in text
    assert "Fixed arrivals (4 chat users, 1 thread(s)):" in text
    assert "| `fixed-4096` | 0.20 s | 10.00 s | 50.00x | 0.10 s / 0.30 s | 10.00 | 1.00x | 12.00 s | 1.00x | 1.02 / 1.40 | – | – / 4096 |" in text
    assert "| `fixed-512` | 0.25 s | 2.00 s | 8.00x | 0.10 s / 0.30 s | 9.00 | 0.90x | 16.00 s | 1.33x |" in text
    assert "| `auto` | 0.20 s | 0.50 s | 2.50x | 0.10 s / 0.30 s | 9.80 | 0.98x | 14.00 s | 1.17x | 1.02 / 1.40 | 3 | 0.20 s / 200 |" in text
    line = next(line for line in text.splitlines() if line.startswith("- `auto`, fixed arrivals"))
    assert "chat p99 ITL 2.50x its p50 (<= 3x: holds)" in line
    assert "output tok/s 0.98x fixed-4096's (>= 0.95x: holds)" in line
    assert "document TTFT p50 1.17x fixed-4096's (<= 1.5x: holds)" in line
    assert not any(line.startswith("- `fixed-512`") for line in text.splitlines())  # targets are read for targets only
    assert "](benchmarks/report/stallfree_itl.png)" in text


def test_each_target_not_holding_against_the_baseline_of_its_own_run():
    rows = [row("fixed-4096", p50=0.2, p99=10.0, tok_s=10.0, ttft=12.0),
            row("auto", p50=0.2, p99=0.7, tok_s=9.0, ttft=20.0, target=0.2),
            row("fixed-4096", "poisson", p50=0.2, p99=8.0, tok_s=5.0, ttft=10.0),
            row("auto", "poisson", p50=0.2, p99=0.6, tok_s=5.0, ttft=15.0, target=0.2)]  # fmt: skip
    text = stallfree.render(rows)
    fixed = next(line for line in text.splitlines() if line.startswith("- `auto`, fixed arrivals"))
    assert "chat p99 ITL 3.50x its p50 (<= 3x: does not hold)" in fixed
    assert "output tok/s 0.90x fixed-4096's (>= 0.95x: does not hold)" in fixed
    assert "document TTFT p50 1.67x fixed-4096's (<= 1.5x: does not hold)" in fixed
    poisson = next(line for line in text.splitlines() if line.startswith("- `auto`, poisson arrivals"))
    assert "(<= 3x: holds)" in poisson and "output tok/s 1.00x" in poisson and "(<= 1.5x: holds)" in poisson
    assert text.index("Fixed arrivals") < text.index("Poisson arrivals")


def test_without_a_baseline_the_targets_are_not_measured():
    text = stallfree.render([row("target-250ms", p50=0.2, p99=0.4, target=0.25),
                             row("fixed-4096", status="not run", reason="no healthy /health")])  # fmt: skip
    line = next(line for line in text.splitlines() if line.startswith("- `target-250ms`"))
    assert "(<= 3x: holds)" in line and "(>= 0.95x: not measured)" in line and "(<= 1.5x: not measured)" in line
    assert "| `fixed-4096` | not run: no healthy /health |" in text


def test_the_no_documents_comparison():
    rows = [row("fixed-4096", "none", p50=0.20, p99=0.30, tok_s=20.0), row("auto", "none", p50=0.21, p99=0.31,
            tok_s=19.5, target=0.2)]  # fmt: skip
    text = stallfree.render(rows)
    assert "No documents (4 chat users, 1 thread(s)): the chat users alone." in text
    assert "| `auto` | 0.21 s | 0.31 s | 1.48x | 0.10 s / 0.30 s | 19.50 | 0.97x | 0.20 s |" in text
    assert "chat ITL p50 1.05x and output tok/s 0.97x fixed-4096's (equal within 10%: holds)" in text
    assert "stallfree_itl.png" not in text  # no run with documents: nothing to plot
    slower = stallfree.render([rows[0], row("auto", "none", p50=0.25, p99=0.3, tok_s=20.0, target=0.2)])
    assert "chat ITL p50 1.25x and output tok/s 1.00x fixed-4096's (equal within 10%: does not hold)" in slower


def test_a_later_row_of_the_same_run_replaces_the_earlier_one():
    text = stallfree.render([row("fixed-4096"), row("auto", p99=5.0, target=0.2), row("auto", p99=0.5, target=0.2)])
    assert "| `auto` | 0.20 s | 0.50 s |" in text and "| `auto` | 0.20 s | 5.00 s |" not in text
    cut = stallfree.render([row("fixed-4096", status="cut")])
    assert "| `fixed-4096` (cut at the `--duration` bound) | 0.20 s |" in cut


def test_the_histogram_quantile_interpolates_as_prometheus_does():
    # 10 observations: 2 in (0, 0.5], 6 in (0.5, 1.0], 2 in (1.0, 2.0], none above.
    buckets = {0.5: 2, 1.0: 8, 2.0: 10, math.inf: 10}
    assert stallfree.histogram_quantile(0.5, buckets) == pytest.approx(0.5 + 0.5 * (5 - 2) / 6)
    assert stallfree.histogram_quantile(0.9, buckets) == pytest.approx(1.0 + 1.0 * (9 - 8) / 2)
    assert stallfree.histogram_quantile(0.1, buckets) == pytest.approx(0.5 * 1 / 2)  # the first bucket starts at 0
    assert stallfree.histogram_quantile(1.0, buckets) == pytest.approx(2.0)
    # A rank in the +Inf bucket gives the highest finite bound; order of the buckets does not matter.
    assert stallfree.histogram_quantile(0.9, [(math.inf, 10), (0.25, 1), (4.0, 5)]) == 4.0
    assert stallfree.histogram_quantile(0.5, {0.5: 0, math.inf: 0}) is None  # no observations
    assert stallfree.histogram_quantile(0.5, {0.5: 3}) is None  # no +Inf bucket
    assert stallfree.histogram_quantile(-0.1, buckets) == -math.inf and stallfree.histogram_quantile(1.1, buckets) == math.inf


def test_the_sample_quantile_and_the_arrivals():
    assert stallfree.quantile([0.3, 0.1, 0.2, 0.4], 0.5) == 0.2
    assert stallfree.quantile(list(range(1, 101)), 0.99) == 99
    assert stallfree.quantile([], 0.5) is None
    assert stallfree.arrival_times("fixed", 3, 8.0) == [8.0, 16.0, 24.0]
    poisson = stallfree.arrival_times("poisson", 400, 8.0, seed=1)
    assert poisson == stallfree.arrival_times("poisson", 400, 8.0, seed=1) and poisson == sorted(poisson)
    assert 7.0 < poisson[-1] / len(poisson) < 9.0  # the same mean interval
    assert stallfree.arrival_times("none", 3, 8.0) == []
