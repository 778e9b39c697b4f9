"""Pre-RoPE keys: un-rotate stored post-RoPE keys before quantization, rotate them back after.

Quantizers with per-channel statistics need keys *before* RoPE: the rotation mixes each
channel pair with a position-dependent angle and spreads the outlier channels (KVQuant,
arXiv 2401.18079, section 3.2; AQUA-KV, arXiv 2501.19392). kvopt's attention seam hands the
cache post-RoPE keys, so instead of copying model code or hooking the projection, the stored
keys are un-rotated with the model's own RoPE frequencies (from its config through
transformers' ``ROPE_INIT_FUNCTIONS``, so default, linear, llama3, yarn and proportional
scaling are the model's): RoPE is a rotation, ``R(p)^-1 = R(-p)``, so un-rotating and
re-rotating at the same angles is exact up to floating point. RoPE's ``attention_scaling``
(yarn) stays inside the un-rotated key, which is then that factor times the projection's
output; re-rotation restores the post-RoPE key exactly.

Angles are computed in float64 and reduced modulo 2 pi (no precision loss at long positions),
once per position (:class:`RopeTable`).
All supported families (llama, qwen2, mistral, gemma) use half-split ("rotate_half") RoPE;
partial rotary dimensions leave the other channels as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: RoPE kinds whose frequencies depend on the current sequence length: a key's angles cannot be recomputed later.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RopeError(ValueError):
    """The model's RoPE cannot be un-rotated (no RoPE config, or length-dependent frequencies)."""


def rope_inv_freq(config, layer_idx: int, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies ``[rotary_dim / 2]`` (float32) of layer ``layer_idx`` of a model ``config``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = getattr(config, "rope_parameters", None)
    if not parameters:
        raise RopeError("this model's config has no RoPE parameters (rope_parameters); pre-RoPE keys need RoPE")
    layer_type = None
    if "rope_type" not in parameters and getattr(config, "layer_types", None):  # per layer type (e.g. Gemma 3)
        layer_type = config.layer_types[layer_idx]
        parameters = parameters[layer_type]
    rope_type = parameters.get("rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise RopeError(f"{rope_type!r} RoPE changes its frequencies with the sequence length; it cannot be undone later")
    if rope_type == "default":
        partial = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * partial)
        return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float()


class RopeTable:
    """cos/sin of one layer's RoPE angles for positions ``0..N-1``, grown by doubling as positions come.

    Decoding re-rotates every stored key at every step: looking its angles up costs a fraction
    of computing them. Shared by the layers with the same frequencies; a per-model cost
    (``nbytes``), not a per-token one.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.float()
        self.cos = self.sin = torch.empty(0, inv_freq.shape[0], device=inv_freq.device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [*positions.shape, rotary / 2]`` at non-negative ``positions``."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            size = max(needed, 2 * self.cos.shape[0], 256)
            steps = torch.arange(size, device=self.inv_freq.device, dtype=torch.float64)[:, None]
            angles = torch.remainder(steps * self.inv_freq.double(), 2 * math.pi).float()
            self.cos, self.sin = angles.cos(), angles.sin()
        index = positions.long()
        return F.embedding(index, self.cos), F.embedding(index, self.sin)

    def nbytes(self) -> int:
        return 2 * self.cos.numel() * self.cos.element_size()


def rotate(
    keys: torch.Tensor, positions: torch.Tensor, table: RopeTable, inverse: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``keys [B, H, T, D]`` rotated to RoPE ``positions [B, 1 or H, T]`` (``inverse``: un-rotated), in fp32
    (written into ``out`` when given, which must not overlap ``keys``)."""
    cos, sin = table.angles(positions)
    if inverse:
        sin = -sin
    half = cos.shape[-1]
    keys = keys.float()
    first, second = keys[..., :half], keys[..., half : 2 * half]
    out = torch.empty_like(keys) if out is None else out
    torch.mul(first, cos, out=out[..., :half]).addcmul_(second, sin, value=-1.0)
    torch.mul(second, cos, out=out[..., half : 2 * half]).addcmul_(first, sin)
    if 2 * half < keys.shape[-1]:  # partial rotary: the other channels are not rotated
        out[..., 2 * half :] = keys[..., 2 * half :]
    return out


def rope_positions(positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """RoPE positions of stored tokens: sequence indices ``[B, h, T]`` minus each row's left padding ``offsets [B]``.

    HF ``generate`` numbers a left-padded row's tokens from its first real one
    (``position_ids = attention_mask.cumsum(-1) - 1``); without padding both are the same.
    """
    return positions if offsets is None else (positions - offsets.to(positions)[:, None, None]).clamp_min(0)
