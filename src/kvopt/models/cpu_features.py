"""Which dtype a model runs in: what this CPU computes natively, and the choice ``dtype="auto"`` makes from it.

bf16 halves the bytes of weights and KV, but it is only faster where the CPU has bf16 arithmetic
(``avx512_bf16``: Zen 4, Cooper Lake and later; AMX: Sapphire Rapids and later). Without it torch emulates
bf16, slower than fp32 throughout: on an AVX2 EPYC, one thread, the default model's 512-token prefill took 5.3x
fp32's time in bf16, one decode step 1.3x, its MLP matmuls 11-67x (1 to 512 rows). With it (Zen 4, issue 36)
bf16 matmuls of the MLP's shape took 0.39x fp32's time at 512 rows and 0.53x at 8, but 1.49x at 1 row and 1.29x
at 64: a per-op choice needs measuring there. So ``auto`` picks bf16 on a CPU with the flags and fp32 on any
other, and keeps the checkpoint's dtype on an accelerator (kvopt's behaviour there before ``auto`` existed).
Flags are torch's own reading of the CPU (``torch.cpu.get_capabilities()``, the cpuinfo library it ships: the
same answer on Linux, macOS and Windows); where torch knows none, ``auto`` is fp32. Whether oneDNN's bf16 kernels
(the packed linears) run is a separate question, asked of oneDNN itself (:func:`onednn_runs_bf16`): a CPU can
have one without the other, and a test that pretends to have the flags must not execute a kernel the CPU lacks.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kvopt.errors import KVOptError
from kvopt.models.info import parse_dtype

AUTO = "auto"
#: CPU flags that mean native arithmetic in a dtype (any one suffices), as torch (and Linux) name them.
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}
#: Dtypes a model's weights can run in (float8 is a KV storage dtype: no CPU or torch matmul runs a model in it).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as torch reads them (``avx2``, ``avx512_bf16``, ``amx_tile``, ...); empty where torch
    knows none (an older torch, an unknown architecture)."""
    probe = getattr(torch.cpu, "get_capabilities", None)
    capabilities = probe() if probe is not None else {}
    return frozenset(name for name, value in capabilities.items() if value is True)


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN's bf16 kernels run on this CPU (it asks for avx512bw/vl/dq or avx_ne_convert, not for
    ``avx512_bf16``): oneDNN's own answer, never the flags, so pretending to have the flags runs nothing it lacks."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and torch.backends.mkldnn.is_available() and probe())


def native_on_cpu(dtype: torch.dtype) -> bool:
    """True when this CPU computes ``dtype`` natively (fp32 always; bf16/fp16 only with their flags)."""
    return dtype == torch.float32 or bool(NATIVE_FLAGS.get(dtype, frozenset()) & cpu_flags())


def check_model_dtype(requested: str | torch.dtype | None) -> str | torch.dtype | None:
    """``requested`` as None, ``auto`` or a dtype a model runs in; else one line naming the fix (a server checks
    this before it takes its port)."""
    if requested is None or requested == AUTO:
        return requested
    try:
        dtype = parse_dtype(requested)
    except KVOptError:
        raise KVOptError(f"unknown dtype {requested!r}; use --dtype fp32, bf16 or auto") from None
    if dtype not in MODEL_DTYPES:
        raise KVOptError(f"a model cannot run in {_name(dtype)} (a KV storage dtype); use --dtype fp32, bf16 or auto")
    return dtype


def model_dtype(requested: str | torch.dtype | None, device: torch.device | None) -> torch.dtype | None:
    """The dtype to load weights in for ``requested`` on ``device`` (None: the CPU); None keeps the checkpoint's
    dtype (the default).

    ``auto``: bf16 on a CPU with bf16 arithmetic, else fp32; the checkpoint's dtype on an accelerator.
    A named half dtype the CPU only emulates is honoured (its numerics are what was asked for) with one warning
    naming it and the faster choice.
    """
    requested = check_model_dtype(requested)
    on_cpu = device is None or device.type == "cpu"
    if requested == AUTO:
        if not on_cpu:
            return None
        return torch.bfloat16 if native_on_cpu(torch.bfloat16) else torch.float32
    if requested is not None and on_cpu and not native_on_cpu(requested):
        wanted, name = " or ".join(sorted(NATIVE_FLAGS[requested])), _name(requested)
        warnings.warn(
            f"kvopt: running in {name} on a CPU without {name} arithmetic (no {wanted} flag): torch emulates it, "
            "slower than float32; --dtype auto picks float32 here", stacklevel=3,
        )  # fmt: skip
    return requested


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
