"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOption = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="HF model folder or .gguf file; default: embedded SmolLM2-135M-Instruct"),
]

DeviceOption = Annotated[
    str,
    typer.Option(help="where the model runs: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda, cuda:N "
                      "or mps"),
]  # fmt: skip
