"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

DeviceOption = Annotated[
    str,
    typer.Option(help="where the model runs: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda, cuda:N "
                      "or mps"),
]  # fmt: skip
