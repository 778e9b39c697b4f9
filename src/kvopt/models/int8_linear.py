"""Weight-only int8 linear layers on a CPU (``weights="int8"``): half the bytes a decode step reads.

A decode step of one sequence is bound by reading every weight once (issue 65): SmolLM2-135M reads 269 MB per token
in bf16, 134 MB in int8. Each output channel of every ``nn.Linear`` (the projections and the output head) is
quantized symmetrically, ``scale = max|w| / 127``, ``q = round(w / scale)``; activations keep the model's dtype, so
``y = (x @ q.T) * scale + bias`` with the products and sums in fp32. At up to 16 rows (one per decoding sequence)
kvopt's CPU kernel (:func:`kvopt.kernels.cpu.linear_rows`) streams the int8 rows once for all of them; at more (a
prompt's chunk) the int8 weights are widened to the activations' dtype (exact: an int8 fits a bf16) and the BLAS
multiplies, the scale applied to its output. Embeddings stay in the model's dtype (a lookup reads one row of them
per token).

One scale per output channel is as close to fp32 as bf16 is on the default model: perplexity 21.440 against fp32's
21.407 and bf16's 21.439 (8 x 1,024 tokens of local text). Scales per 32 weights of a row (llama.cpp's Q8_0 blocks)
were tried: their weights are closer (relative error 0.55% against 0.84%) but the perplexity was no better (21.485),
nor the answers kept (BENCHMARKS.md), and the kernel's extra multiplies cost 3-12% of a step's matmul time.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kvopt.errors import KVOptError
from kvopt.kernels.cpu import linear_rows

#: ``weights=``: ``auto`` (the model's dtype, as ``dtype`` says), ``fp32``/``bf16`` (weights and compute in that
#: dtype), ``int8`` (weight-only int8 linears, computing in ``dtype``).
WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8")
#: Rows of input up to which the few-rows kernel serves. Widening every weight for the BLAS costs a pass over all of
#: them (the default model's 211 linears: 59 ms at 1 row against the kernel's 8.4 ms, 69 against 58.5 at 16 rows),
#: while the kernel's fp32 multiply-adds grow with the rows (176 ms against 80 at 32; one thread, Zen 4).
KERNEL_ROWS = 16


class Int8Linear(torch.nn.Module):
    """``nn.Linear``'s forward over int8 weights with one fp32 scale per output channel.

    The tensors are buffers (``qweight`` int8 ``[out, in]``, ``scale`` fp32 ``[out]``, ``bias`` in the model's dtype
    or None): they are not trained, and a state dict names them apart from a float ``weight``.
    """

    #: Tensors holding one row per output channel (fusing layers side by side concatenates these).
    ROW_TENSORS = ("qweight", "scale", "bias")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Int8Linear":
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        qweight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(qweight.contiguous(), scale.contiguous(), bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these int8 values and scales stand for, ``[out, in]`` (a slow reference, for tests and checks)."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # a decode step calls ~120 of these: the buffers are read from their dict (Module.__getattr__ costs a
        # microsecond each) and a 2-D input is neither reshaped nor viewed
        buffers = self._buffers
        qweight, scale, bias = buffers["qweight"], buffers["scale"], buffers["bias"]
        rows = input if input.dim() == 2 else input.reshape(-1, self.in_features)
        kernel = linear_rows() if rows.device.type == "cpu" and rows.shape[0] <= KERNEL_ROWS else None
        if kernel is not None and rows.dtype in (torch.float32, torch.bfloat16):
            output = kernel(rows, qweight, scale, bias)
        else:
            output = F.linear(rows, qweight.to(rows.dtype)) * scale.to(rows.dtype)
            if bias is not None:
                output = output + bias.to(rows.dtype)
        return output if input.dim() == 2 else output.view(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (packed ones included) by an :class:`Int8Linear` in place; returns how
    many. The float weights are released unless something else holds them (a tied embedding keeps its own), and
    the heap they and the quantization's fp32 temporaries took is handed back to the system."""
    count = _replace_linears(model)  # its locals, the float layers among them, are gone once it returns
    _return_freed_heap()
    return count


def _replace_linears(model: torch.nn.Module) -> int:
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, torch.nn.Linear)]  # fmt: skip
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear.from_linear(child))
    return len(targets)


def _return_freed_heap() -> None:
    """glibc keeps freed heap for later allocations: after quantizing the default model 219 MB of it stayed in the
    process's RSS (685 -> 466 MB once returned). ``malloc_trim`` returns it; elsewhere (another libc) nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check_weights(
    weights: str | None, dtype: torch.dtype | str | None, device: torch.device | None = None
) -> torch.dtype | str | None:
    """``weights`` checked against ``dtype`` and ``device`` (None: the CPU); returns the dtype to load in: a float
    format names its own (``bf16`` with ``dtype=fp32`` is a contradiction, named), ``int8`` computes in ``dtype``
    (``auto`` when none is given: bf16 on a CPU with bf16 arithmetic, else fp32) and runs on a CPU only."""
    if weights is None or weights == "auto":
        return dtype
    if weights not in WEIGHT_FORMATS:
        raise KVOptError(f"unknown weights {weights!r}; use --weights {', '.join(WEIGHT_FORMATS)}")
    if weights == "int8":
        if device is not None and device.type != "cpu":
            raise KVOptError(f"weights=int8 runs on a CPU (kvopt's int8 kernels); on {device.type} use weights=auto "
                             "(or bf16)")  # fmt: skip
        return "auto" if dtype is None else dtype
    if dtype not in (None, "auto") and str(dtype).removeprefix("torch.") not in _SAME[weights]:
        raise KVOptError(f"weights={weights} contradicts dtype={dtype}; give one of them (weights in {weights} "
                         f"compute in {weights})")  # fmt: skip
    return weights


_SAME = {"fp32": ("fp32", "float32", "float"), "bf16": ("bf16", "bfloat16")}


def check_int8_serves(model: torch.nn.Module) -> None:
    """Raise a :class:`KVOptError` naming why and the nearest working option where ``weights="int8"`` cannot serve
    ``model``: no ``nn.Linear`` projection in its layers (GPT-2's are Conv1D)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not any(isinstance(module, torch.nn.Linear) for module in decoder.modules()):
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise KVOptError(f"weights=int8 quantizes nn.Linear projections and {kind}'s layers have none; use "
                         "weights=auto")  # fmt: skip
