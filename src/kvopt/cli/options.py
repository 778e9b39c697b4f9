"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOption = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="HF model folder or .gguf file; default: embedded SmolLM2-135M-Instruct"),
]

DtypeOption = Annotated[
    Optional[str],
    typer.Option(help="dtype of the weights and the KV: fp32, bf16 or auto (bf16 on a CPU with bf16 arithmetic, "
                      "avx512_bf16 or AMX; else fp32); default: the checkpoint's"),
]  # fmt: skip

WeightsOption = Annotated[
    Optional[str],
    typer.Option(help="weight format: auto (in --dtype), fp32, bf16, or int8 (every linear layer in int8 with one "
                      "scale per output channel, computed in --dtype; on a CPU: half the bytes a decode step reads)"),
]  # fmt: skip

DeviceOption = Annotated[
    str,
    typer.Option(help="where the model runs: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda, cuda:N "
                      "or mps"),
]  # fmt: skip

EngineSpeculateOption = Annotated[
    Optional[str],
    typer.Option("--speculate", help="speculative decoding of lossless sequences: prompt_lookup:k=4,ngram=3 (up to k "
                                     "tokens drafted from earlier text per step, checked in the same forward pass)"),
]  # fmt: skip

SpeculateMaxBatchOption = Annotated[
    Optional[int],
    typer.Option(min=1, help="draft only while at most this many sequences run; default: 2 on a CPU (where larger "
                             "batches are compute-bound), any number on a GPU"),
]  # fmt: skip

MaxNumBatchedTokensOption = Annotated[
    int,
    typer.Option(min=1, help="tokens one forward pass computes at most (decodes plus prompt chunks); more uses the "
                             "CPU's matrix units better, fewer keeps steps short"),
]  # fmt: skip

LongPrefillTokenThresholdOption = Annotated[
    Optional[int],
    typer.Option(min=1, help="a prompt longer than this is computed in chunks of at most this many tokens per step "
                             "(shorter steps for decoding users, more steps per prompt); default: no such cap"),
]  # fmt: skip

MaxNumPartialPrefillsOption = Annotated[
    Optional[int],
    typer.Option(min=1, help="prompts part-way through their prefill at once at most (1: one prompt's first token "
                             "sooner, the others wait); default: as many as the token budget reaches"),
]  # fmt: skip


ItlTargetOption = Annotated[
    str,
    typer.Option(help="inter-token latency to keep while sequences decode, in ms: each step's prompt tokens are sized "
                      "so that the step, predicted from the steps just measured, stays within it; auto: 3x the "
                      "decoding batch's own step (at least 3x one sequence's, timed at start-up); off: no target"),
]  # fmt: skip


def itl_target(value: str) -> str | None:
    """``--itl-target-ms`` as the engine takes it (``off``: None; a number or ``auto`` is checked by the config)."""
    return None if value.strip().lower() == "off" else value.strip()
