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
