"""bf16 linear layers on a CPU in oneDNN's packed weight layout: the same numbers, read faster.

A decode step multiplies a few rows by every weight matrix, so it is bound by reading the weights. In
PyTorch's own layout oneDNN re-blocks them on every call; packed once (what ``torch.compile``'s CPU freezing
does), the default model's bf16 linears took 0.5-0.6x the time at 1 row, 0.75x at 16 rows, 0.93x at 64 and
0.97x at 256-1,024 rows (one thread, Zen 4 with ``avx512_bf16``; issue 36), and one engine decode step of 16
sequences 90 ms instead of 117 ms. The outputs are bit-equal to ``F.linear``'s (tested), so every claim of
equality with Hugging Face stands. The cost is a second copy of each packed weight (the dense one stays the
module's parameter, for everything that reads, saves, ties or moves it): 269 MB for the default model (its 57 MB
output projection shares the embedding's weight; the packed copy does not), beside 269 MB of parameters.

Only bf16 on a CPU with native bf16 arithmetic is packed: fp32 weights packed for MKL ran no faster
(measured), and a CPU that emulates bf16 gains nothing from a layout. ``KVOPT_PACK_LINEARS=0`` (or ``false``,
``no``, ``off``) keeps the plain layout, for a model whose second copy would not fit in memory.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvopt.models.cpu_features import native_on_cpu, onednn_runs_bf16

#: oneDNN's weight packing and packed linear (private ops, as ``torch.compile`` uses them): absent -> nothing packs.
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PACKED_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
#: ``KVOPT_PACK_LINEARS=0`` (or one of these words) keeps every linear plain.
ENV_SWITCH = "KVOPT_PACK_LINEARS"
_OFF = ("0", "false", "no", "off")
#: Rows the layout is tuned for (oneDNN takes it as a hint; any row count runs, bit-equal): a decode step's batch.
TYPICAL_ROWS = 16


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward reads a packed copy of its weight, repacked whenever the weight changes
    (assigned, loaded into, moved or cast); off a CPU or outside bf16 it is the plain linear."""

    packed: torch.Tensor | None
    packed_from: tuple[int, int] | None

    def repack(self) -> None:
        """Pack the current weight if it is bf16 on a CPU, else forget any packed copy."""
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            self.packed = _REORDER(weight.detach(), TYPICAL_ROWS)
            self.packed_from = (weight.data_ptr(), weight._version)
        else:
            self.packed, self.packed_from = None, None

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed copy out (oneDNN's tensor has no storage to copy); it is rebuilt
        on the copy's first call."""
        state = dict(super().__getstate__())
        state["packed"], state["packed_from"] = None, None
        return state

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.packed_from != (weight.data_ptr(), weight._version):
            self.repack()
        if self.packed is None or input.dtype != torch.bfloat16 or torch.is_grad_enabled() and weight.requires_grad:
            return F.linear(input, weight, self.bias)
        rows = input.reshape(-1, input.shape[-1])
        return _PACKED_LINEAR(rows, self.packed, self.bias, "none", [], "").view(*input.shape[:-1], self.out_features)


def packing_serves(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linears would be packed: bf16 weights on a CPU that computes bf16 and whose oneDNN runs
    its bf16 kernels, and not switched off (``KVOPT_PACK_LINEARS=0``)."""
    parameter = next(model.parameters(), None)
    return (
        os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF
        and parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16
        and native_on_cpu(torch.bfloat16) and onednn_runs_bf16() and _REORDER is not None and _PACKED_LINEAR is not None
    )  # fmt: skip


def pack_linears(model: torch.nn.Module) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PackedLinear` in place (the same module and parameters,
    so hooks, ties and state dicts are unchanged) when :func:`packing_serves`; returns how many were packed."""
    if not packing_serves(model):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            module.repack()
            count += 1
    return count
