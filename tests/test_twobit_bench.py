"""benchmarks/twobit.py: the section's header names the decode length only when decode rows exist."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import twobit  # noqa: E402

ROWS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "twobit.jsonl"


def test_a_grid_without_decode_rows_heads_its_column_without_a_length():
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    length = next(row["length"] for row in rows if row.get("kind") == "decode")
    assert f"| decode tok/s @ {length} |" in twobit.render(rows)
    cut = [{**row, "decode_length": None} if row.get("kind") == "meta" else row
           for row in rows if row.get("kind") != "decode"]  # fmt: skip
    text = twobit.render(cut)
    assert "| decode tok/s |" in text and "@ -" not in text


def test_kept_by_length_pairs_each_length_and_names_a_length_still_filling():
    def row(method, length, sample, score):
        return {"task": "passkey", "length": length, "depth": 0.5, "sample": sample, "mode": "query_agnostic",
                "method": method, "seed": 0, "score": score}  # fmt: skip

    scored = {
        "full": [row("full", 2048, s, 1.0) for s in range(4)] + [row("full", 4096, s, float(s < 1)) for s in range(2)],
        # answers every 2k prompt, and at 4k only the prompt full misses: it keeps none of full's 4k answers
        "kivi:bits=2": [row("kivi:bits=2", 2048, s, 1.0) for s in range(4)]
        + [row("kivi:bits=2", 4096, s, float(s == 1)) for s in range(2)],
    }
    header, rule, kivi = twobit.kept_by_length(scored)[1:]
    assert header == "| method | kept @ 2048 | kept @ 4096 (2 prompts) |" and rule == "|---|---:|---:|"
    assert kivi.startswith("| `kivi:bits=2` | 100% [") and "| 0% [" in kivi
    assert twobit.kept_by_length({"full": scored["full"][:4], "kivi:bits=2": scored["kivi:bits=2"][:4]}) == []
