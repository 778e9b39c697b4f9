"""Float linear layers over a decode step's few rows through kvopt's CPU kernel (:func:`kvopt.kernels.cpu.linear_rows`).

At one row per sequence a linear layer is bound by reading its weights, and PyTorch's CPU linear reads them slowly
there: the default model's 211 fp32 linears took 43 ms at 1 row and 71 ms at 4 against the kernel's 23 and 34 (it
streams each weight row once for every input row); at 16 rows both took 100 ms. bf16 linears packed for oneDNN
(:mod:`kvopt.models.packed_linear`) took 17.7 ms at 1 row against the kernel's 15.5, and win from 8 rows on (one
thread, Zen 4). Larger inputs (a prompt's chunks) keep PyTorch's linear. The sums run in another order than a
BLAS's: fp32 results agree within rounding (the engine's fp32 tokens equal HF's, tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvopt.kernels.cpu import linear_rows

#: Rows up to which the kernel serves, by weight dtype (measured above).
FEW_ROWS = {torch.float32: 8, torch.bfloat16: 4}


def few_rows_forward(linear: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``linear``'s forward over 2-D rows, through the kernel when they are few (an ``nn.Linear``'s fp32 or bf16
    weights on a CPU where the kernel is built); otherwise its own forward."""
    weight = getattr(linear, "weight", None)
    kernel = linear_rows() if isinstance(linear, torch.nn.Linear) and weight.device.type == "cpu" else None
    most = FEW_ROWS.get(weight.dtype) if kernel is not None else None
    if most is None:
        return linear.forward
    parameters, own = linear._parameters, linear.forward

    def forward(rows: torch.Tensor) -> torch.Tensor:
        weight = parameters["weight"]  # read per call: a weight replaced or loaded into stays in force
        if rows.shape[0] > most or rows.dtype != weight.dtype or torch.is_grad_enabled() and weight.requires_grad:
            return own(rows)
        return kernel(rows, weight, None, parameters["bias"])

    return forward
