"""Kernels behind the storage layer's reads: fused GPU kernels (Triton, switched here) and a CPU decode-attention
kernel (C++, :mod:`kvopt.kernels.cpu`); torch code stays the reference and the fallback.

On an accelerator a decode step of a small model is bound by launching kernels, not by the bytes it
reads (BENCHMARKS.md, "On a GPU": ``full`` kept an H200 busy 4.2 of the 26.5 ms a step took). A
quantized part read with tensor operations costs dozens of launches per layer (unpack, scale, shift,
softmax, merge); a kernel here reads the packed codes once and attends in one launch. Nothing here
imports the cache storage: the storage hands plain tensors down.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import warnings
from collections.abc import Iterator

import torch

#: ``KVOPT_FUSED_KERNELS=0`` (or ``false``, ``no``, ``off``) keeps every read on the torch path (to rule a kernel
#: out when results differ).
ENV_SWITCH = "KVOPT_FUSED_KERNELS"
_OFF = ("0", "false", "no", "off")
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvopt_fused_kernels", default=True)
#: Why the kernels cannot run on this machine, once one failed to build or launch (then reads stay on torch).
_UNAVAILABLE: list[str] = []


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA builds; the CPU build lacks it)."""
    return importlib.util.find_spec("triton") is not None


def fused_kernels_serve(device: torch.device) -> bool:
    """Whether tensors on ``device`` get the fused kernels: CUDA (or ROCm) devices with Triton installed, unless
    switched off (:func:`disabled`, or ``KVOPT_FUSED_KERNELS=0``)."""
    if _UNAVAILABLE or not _ENABLED.get() or os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF:
        return False
    return device.type == "cuda" and triton_installed()


def give_up(error: Exception) -> None:
    """A kernel cannot be built or launched here (an older GPU or Triton): warn once, and every later read takes
    the torch path (the same results, more launches)."""
    _UNAVAILABLE.append(repr(error))
    warnings.warn(
        f"kvopt's fused GPU kernels cannot run on this machine ({error}); reads take the torch path "
        f"(set {ENV_SWITCH}=0 to skip trying them)", RuntimeWarning, stacklevel=3,
    )  # fmt: skip


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, reads take the torch path on every device (benchmarks compare the two this way)."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def quantized_decode_serves(device: torch.device, group: int, bits: int) -> bool:
    """Whether :mod:`~kvopt.kernels.quantized_attention` reads codes of this group size and width on ``device``
    (power-of-two groups of whole bytes: Triton's tiles are powers of two)."""
    return fused_kernels_serve(device) and group & (group - 1) == 0 and group * bits % 8 == 0
