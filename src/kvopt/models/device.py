"""Which device a model runs on: a name a user typed, checked against what this machine has."""

from __future__ import annotations

import torch

from kvopt.errors import DeviceError

#: ``--device auto``: CUDA where torch sees it, else the CPU. Apple's MPS is used only when named: kvopt's methods
#: were checked on a CUDA GPU (tests/test_device.py), not on MPS.
AUTO = "auto"


def available_accelerator() -> str | None:
    """``cuda`` or ``mps`` where torch can use one, else None."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


def resolve_device(name: str | torch.device | None) -> torch.device | None:
    """``name`` as a device this machine has (``auto``: CUDA if there is one, else the CPU); None stays None
    (the model stays where it was loaded). An unknown name or a missing device fails here, naming what exists,
    rather than at the first tensor moved there."""
    if name is None or isinstance(name, torch.device):
        return name
    if name == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use cpu, cuda, cuda:N, mps or auto") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        found = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise DeviceError(f"device {name!r} is not on this machine ({found}); use the device cpu or auto")
    if device.type == "mps" and available_accelerator() != "mps":
        raise DeviceError(f"device {name!r} is not on this machine (no Apple MPS device); use the device cpu or auto")
    if device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"device {name!r} is not supported by kvopt; use cpu, cuda, cuda:N, mps or auto")
    return device
