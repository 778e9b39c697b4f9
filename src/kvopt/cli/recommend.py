"""``kvopt recommend``: which spec to serve for a KV memory budget, a context and a quality floor (kvopt.eval.recommend)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvopt.cli.options import DeviceOption, ModelOption

console = Console()


def recommend(
    memory: Annotated[str, typer.Option(help="KV memory for all sequences together: 1GB, 512MiB or bytes")],
    context: Annotated[int, typer.Option(min=1, help="tokens per sequence (prompt + answer)")],
    model: ModelOption = None,
    quality: Annotated[Optional[float], typer.Option(help="share of full's answers to keep, in (0, 1], e.g. 0.95")] = None,
    batch: Annotated[int, typer.Option(min=1, help="sequences held at once")] = 1,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL of {\"prompt\": ...} or {\"messages\": [...]}: rank "
                                                         "full and the top candidates by agreement on them")] = None,  # fmt: skip
    top: Annotated[int, typer.Option(min=1, help="with --prompts: candidates run beside full")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1, help="with --prompts: greedy answer tokens per prompt")] = 32,
    dtype: Annotated[str, typer.Option(help="KV dtype the memory is counted in: float16, bfloat16, float32")] = "float16",
    results: Annotated[Optional[Path], typer.Option(help="committed rows (default: this checkout's benchmarks/results)")] = None,
    device: DeviceOption = "auto",
) -> None:
    """List the specs that fit, ranked by measured quality, and print the one to use with its `kvopt serve` line."""
    from kvopt.eval.recommend import recommend as rank
    from kvopt.memory import human_bytes

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("answering your prompts", total=None)
        found = rank(
            memory, context, model, quality, batch, prompts, dtype=dtype, results=results, top=top,
            max_tokens=max_tokens, device=device,
            progress=lambda done, total, spec: bar.update(task, completed=done, total=total, description=spec),
        )  # fmt: skip
    floor = f", keeping >= {found.quality:.0%} of full's answers" if found.quality else ""
    title = f"{found.model}: specs fitting {human_bytes(found.memory)} at {found.context} tokens x batch {found.batch} ({found.dtype}){floor}"
    table = Table(title=title, show_header=True)
    for column in ("#", "spec", "KV bytes", "quality (evidence)", "decode (rows' machine)"):
        table.add_column(column, justify="right" if column in ("#", "KV bytes") else "left", overflow="fold")
    for rank_number, candidate in enumerate(found.candidates, start=1):
        table.add_row(str(rank_number), candidate.spec, human_bytes(candidate.kv_bytes), candidate.evidence(), candidate.speed())
    console.print(table)
    lines = [f"measured rows: {found.rows}"]
    if found.nearest:
        lines.append(f"note: {found.nearest}")
    if found.prompts:
        lines.append(f"your prompts: {found.prompts} (answers kept in its .recommend.jsonl; a rerun resumes)")
    lines += [f"note: {note}" for note in found.notes]
    choice = found.choice
    if choice is None:
        best = found.candidates[0]
        lines.append(f"no spec that fits keeps {found.quality:.0%}; the best, {best.spec}, {best.evidence()}: "
                     "give more --memory, a shorter --context or a lower --quality")  # fmt: skip
    else:
        lines += [f"use: {choice.spec} ({choice.evidence()})", found.serve_command()]
    console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
