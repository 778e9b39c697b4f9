"""benchmarks/cluster.py's section: the latest run per replica count, and the issue's targets read from its rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cluster  # noqa: E402


def row(router: str, replicas: int = 2, hit_rate: float = 0.5, ttft_p50: float = 1.0, tok_s: float = 10.0,
        decision: float | None = None, memory: str = "1GB") -> dict:  # fmt: skip
    times = {} if decision is None else {"router_decision_p50_s": decision / 4, "router_decision_p99_s": decision,
                                         "router_decision_cpu_p99_s": decision / 2}  # fmt: skip
    return {"router": router, "replicas": replicas, "requests": 128, "rate": 1.0, "hit_rate": hit_rate,
            "ttft_p50": ttft_p50, "ttft_p99": 2 * ttft_p50, "output_tok_s": tok_s, "systems": 8, "questions": 16,
            "system_tokens": 1000, "max_tokens": 32, "kv_memory": memory, **times}  # fmt: skip


def test_the_section_reads_the_targets_from_the_two_replica_rows():
    rows = [row("kv", hit_rate=0.9, ttft_p50=0.5, tok_s=20.0, decision=0.0004), row("power_of_two", hit_rate=0.45),
            row("round_robin", hit_rate=0.4), row("round_robin", replicas=1, tok_s=12.5)]  # fmt: skip
    text = cluster.render(rows)
    assert "| 1GB | 2 | kv | 128 | 90% | 0.50 s | 1.00 s | 20.0 | 0.10 ms / 0.40 ms | 0.20 ms |" in text
    assert "| 1GB | 1 | (one replica) |" in text
    assert "2.00x the hit rate** (target >= 1.8x: holds)" in text
    assert "2.0x lower TTFT p50** (target >= 2x: holds)" in text
    assert "(target < 2 ms): CPU 0.20 ms (holds), wall clock 0.40 ms (holds)" in text
    assert "give 1.60x one replica's output tok/s" in text


def test_each_pool_size_is_read_on_its_own():
    rows = [row("kv", hit_rate=0.9), row("power_of_two", hit_rate=0.85),
            row("kv", hit_rate=0.9, memory="256MB"), row("power_of_two", hit_rate=0.45, memory="256MB")]  # fmt: skip
    text = cluster.render(rows)
    assert text.index("| 1GB | 2 | kv") < text.index("| 256MB | 2 | kv")
    assert "1GB pools, KV-aware vs power of two choices: **1.06x the hit rate** (target >= 1.8x: does not hold)" in text
    assert "256MB pools, KV-aware vs power of two choices: **2.00x the hit rate** (target >= 1.8x: holds)" in text


def test_a_target_missed_is_said_and_a_later_run_replaces_the_earlier_one():
    earlier = [row("kv", hit_rate=0.9, ttft_p50=0.5), row("power_of_two", hit_rate=0.45)]
    later = [row("kv", hit_rate=0.5, ttft_p50=0.9, decision=0.003), row("power_of_two", hit_rate=0.45)]
    text = cluster.render(earlier + later)
    assert "| 2 | kv | 128 | 90% |" not in text and "| 2 | kv | 128 | 50% |" in text
    assert "(target >= 1.8x: does not hold)" in text and "(target >= 2x: does not hold)" in text
    assert "CPU 1.50 ms (holds), wall clock 3.00 ms (does not hold)" in text
