"""The line every BENCHMARKS.md section opens with: the command that regenerates it and the days its rows were measured.

One helper for every section builder (benchmarks/run.py and each step's ``render``/``section``), so a reader finds,
in the same words at the top of each section, how to redo it and how old its numbers are.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def opening(commands: str | Sequence[str], dates: Sequence[str], rows: Path | Sequence[Path], note: str = "") -> str:
    """``Measured <dates> with `<command>` (rows: `<path>`; <note>).``: paths relative to the repository root."""
    commands = [commands] if isinstance(commands, str) else commands
    rows = [rows] if isinstance(rows, Path) else rows
    shown = ", ".join(f"`{where(path)}{'/' if path.is_dir() else ''}`" for path in rows)
    return (f"Measured {' / '.join(sorted(set(dates))) or 'on an unrecorded date'} with "
            f"{' and '.join(f'`{command}`' for command in commands)} (rows: {shown}{'; ' + note if note else ''}).")  # fmt: skip



def conditions_line(rows: Sequence[dict]) -> list[str]:
    """The lines closing a table: what else ran on the machine while its rows were measured (nothing if unstated)."""
    conditions = sorted({row["conditions"] for row in rows if row.get("conditions")})
    return ["", f"Measured with {'; '.join(conditions)}."] if conditions else []

def read_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (none when it is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def seed_working_rows(rows: Path, work: Path, tag: dict) -> None:
    """A fresh machine resumes a resumable run from its committed rows: those of ``rows`` matching ``tag`` (e.g.
    ``{"model": ..., "step": ...}``), without the stamp :func:`merge_working_rows` adds, become its working file
    ``work`` when that does not exist yet, so only the missing cells run."""
    stamp = set(tag) - {"model"} | {"conditions", "date"}
    seeded = [{k: v for k, v in row.items() if k not in stamp} for row in read_rows(rows)
              if all(row.get(k) == v for k, v in tag.items())]  # fmt: skip
    if seeded and not work.exists():
        work.parent.mkdir(parents=True, exist_ok=True)
        work.write_text("".join(json.dumps(row) + "\n" for row in seeded))


def merge_working_rows(rows: Path, work: Path, tag: dict, conditions: str) -> None:
    """The working file's rows, stamped with ``tag`` (but its model, which they name), ``conditions`` and today,
    replace the rows of ``rows`` matching ``tag``; the other rows stay, and nothing changes while ``work`` holds
    none (a ``--collect`` on a machine that ran nothing keeps the committed rows)."""
    new = read_rows(work)
    if not new:
        return
    kept = [row for row in read_rows(rows) if any(row.get(k) != v for k, v in tag.items())]
    stamp = {k: v for k, v in tag.items() if k != "model"}
    stamp |= {"conditions": conditions, "date": time.strftime("%Y-%m-%d")}
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text("".join(json.dumps(row) + "\n" for row in kept + [{**stamp, **row} for row in new]))


def where(path: Path) -> str:
    """``path`` as the report names it: from the repository root, or whole when outside (``--results``)."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def row_dates(path: Path, keep: Callable[[dict], bool] = lambda row: True) -> list[str]:
    """The days the kept rows of ``path`` (JSON lines) were measured: a row's own ``date`` stamp, else the day git
    says its line was written (rows are committed as they are measured; today for a line not committed yet).
    Outside git's history only stamped rows have a day."""
    if not path.exists():
        return []
    lines = committed_lines(path) or [(None, line) for line in path.read_text().splitlines()]
    days = {row.get("date") or day for day, line in lines if line.strip() and keep(row := json.loads(line))}
    return sorted(days - {None})


def committed_lines(path: Path) -> list[tuple[str, str]] | None:
    """``(day, text)`` of each line of ``path``, the day from ``git blame`` (author time in the author's zone);
    None where git cannot tell (no checkout, a file git does not track)."""
    done = subprocess.run(["git", "blame", "--line-porcelain", "--", path.name], cwd=path.parent,
                          capture_output=True, text=True, encoding="utf-8")  # fmt: skip
    if done.returncode:
        return None
    lines, seconds, zone = [], 0, timezone.utc
    for line in done.stdout.splitlines():
        if line.startswith("author-time "):
            seconds = int(line.split()[1])
        elif line.startswith("author-tz "):
            tz = line.split()[1]
            zone = timezone((-1 if tz[0] == "-" else 1) * timedelta(hours=int(tz[1:3]), minutes=int(tz[3:5])))
        elif line.startswith("\t"):
            lines.append((datetime.fromtimestamp(seconds, zone).strftime("%Y-%m-%d"), line[1:]))
    return lines
