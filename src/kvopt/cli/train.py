"""``kvopt train``: fit what a method learns from the model once, ahead of its first cache (Locret's heads)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvopt.cli.options import DeviceOption, ModelOption

train = typer.Typer(help="Train what a method learns from the model, once per model (cached under KVOPT_CACHE).",
                    no_args_is_help=True)  # fmt: skip
console = Console()


@train.command("locret")
def locret(
    model: ModelOption = None,
    tokens: Annotated[Optional[int], typer.Option(min=1, help="tokens of local text to train on (default 32768; "
                                                               "the text may hold fewer)")] = None,  # fmt: skip
    device: DeviceOption = "auto",
) -> None:
    """Train Locret's retaining heads on this machine's prose with facts planted in it; an interrupted run resumes."""
    from kvopt.api import load_model, local_prose
    from kvopt.methods import locret_heads

    loaded, _ = load_model(model, device=device)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("training sequences", total=None)
        trained = locret_heads.train_for_model(
            loaded, local_prose, tokens, lambda done, total: bar.update(task, completed=done, total=total)
        )
    report = trained.report
    console.print(
        f"heads: {trained.path} ({report.head_bytes:,} bytes, apart from the per-token cache)\n"
        f"trained on {report.tokens:,} tokens ({report.sequences} sequences, most with facts planted and asked back, "
        f"the last tenth held out) of {report.text_source.split(':')[0]} in {report.seconds:.1f} s\n"
        f"validation loss (SmoothL1 to the standardized importance target): {report.validation_loss:.4f}",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
