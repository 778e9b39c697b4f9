"""Reading result rows (``eval.jsonl``, ``bench.jsonl``): every row whole, or one error naming its line.

Resuming and reporting both trust these rows: a corrupt line or a row without the fields that
identify it (``{}``) would be skipped as done, or averaged as a result, so it fails instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvopt.errors import KVOptError

Row = dict[str, Any]
#: Fields every ``eval.jsonl`` row has: what it measured (resuming matches on them).
EVAL_ROW_KEYS = ("task", "length", "mode", "method")
#: Fields every ``bench.jsonl`` row has.
BENCH_ROW_KEYS = ("method", "length", "prefill_s", "decode_tok_s", "kv_bytes")


def load_rows(path: Path, required: tuple[str, ...] = ()) -> list[Row]:
    """Rows of a JSONL file; ``[]`` if it is missing, so a partial run still gets a report.

    Blank lines are skipped; a corrupt line, or a row lacking a ``required`` field, raises rather
    than being dropped, because silently losing rows would bias the means.
    """
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    with path.open(encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KVOptError(
                    f"{path}, line {number}: not valid JSON ({exc.msg}); fix or delete that line"
                ) from None
            if not isinstance(row, dict):
                raise KVOptError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
            missing = [key for key in required if key not in row]
            if missing:
                raise KVOptError(f"{path}, line {number}: the row lacks {', '.join(missing)}; fix or delete that line")
            rows.append(row)
    return rows
