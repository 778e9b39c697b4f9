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
partial rotary dimensions leave the other channels as they are. Pre-RoPE keys are held in *pair
order* (:func:`to_pairs`), where rotating is one complex multiplication; attention reads them with
the query in the same order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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
        return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float()


@dataclass(eq=False)
class RopeTable:
    """``exp(i * angle)`` of one layer's RoPE angles for positions ``0..N-1`` (complex64), grown by doubling.

    Decoding re-rotates every stored key at every step: looking its angles up costs a fraction
    of computing them. Shared by the layers with the same frequencies; a per-model cost
    (``nbytes``), not a per-token one. A saved cache stores the frequencies only (the table is
    not a field: it is rebuilt on use).
    """

    inv_freq: torch.Tensor

    def __post_init__(self) -> None:
        self.inv_freq = self.inv_freq.float()
        self.table = torch.empty(0, self.inv_freq.shape[0], dtype=torch.complex64, device=self.inv_freq.device)

    @property
    def pairs(self) -> int:
        """Rotated channel pairs (rotary dimensions / 2)."""
        return self.inv_freq.shape[0]

    def phases(self, positions: torch.Tensor) -> torch.Tensor:
        """``[*positions.shape, pairs]`` complex64 unit phases at non-negative ``positions``."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.table.shape[0]:
            size = max(needed, 2 * self.table.shape[0], 256)
            steps = torch.arange(size, device=self.inv_freq.device, dtype=torch.float64)[:, None]
            angles = torch.remainder(steps * self.inv_freq.double(), 2 * math.pi).float()
            self.table = torch.polar(torch.ones_like(angles), angles)
        as_floats = self.table.view(torch.float32)  # [N, 2 * pairs]: one embedding row per position
        return F.embedding(positions.long(), as_floats).view(torch.complex64)

    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()


@functools.lru_cache(maxsize=64)
def pair_order(dim: int, pairs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel order ``[0, r, 1, r + 1, ..., r - 1, 2r - 1, 2r, ..., dim - 1]`` (``r = pairs``) and its inverse."""
    rotary = torch.arange(2 * pairs, device=device).view(2, pairs).T.flatten()
    order = torch.cat([rotary, torch.arange(2 * pairs, dim, device=device)])
    return order, order.argsort()


def to_pairs(x: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """``x [..., D]`` in *pair order*: the channels RoPE rotates together (``i`` and ``i + D_rot / 2``, half-split
    "rotate_half" RoPE) side by side, so a rotation is one complex multiplication. Attention scores are the
    same with queries and keys both in pair order."""
    return x[..., pair_order(x.shape[-1], table.pairs, x.device)[0]]


def from_pairs(x: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Inverse of :func:`to_pairs`."""
    return x[..., pair_order(x.shape[-1], table.pairs, x.device)[1]]


def rotate(
    keys: torch.Tensor, positions: torch.Tensor, table: RopeTable, inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``keys [B, H, T, D]`` in pair order (:func:`to_pairs`) rotated to RoPE ``positions [B, 1 or H, T]``
    (``inverse``: un-rotated), in fp32 (written into ``out`` when given, which must not overlap ``keys``).

    Each pair ``(a, b)`` is the complex number ``a + ib`` times ``exp(i * angle)``: ``(a cos - b sin, b cos + a sin)``,
    RoPE's rotation, in one vectorized multiplication (7x faster on CPU than four half-width passes)."""
    phases = table.phases(positions)
    if inverse:
        phases = phases.conj()
    keys = keys.float()
    out = torch.empty_like(keys) if out is None else out
    rotary = 2 * table.pairs
    torch.mul(keys[..., :rotary].view(torch.complex64), phases, out=out[..., :rotary].view(torch.complex64))
    if rotary < keys.shape[-1]:  # partial rotary: the other channels are not rotated
        out[..., rotary:] = keys[..., rotary:]
    return out


def rope_positions(positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """RoPE positions of stored tokens: sequence indices ``[B, h, T]`` minus each row's left padding ``offsets [B]``.

    HF ``generate`` numbers a left-padded row's tokens from its first real one
    (``position_ids = attention_mask.cumsum(-1) - 1``); without padding both are the same.
    """
    return positions if offsets is None else (positions - offsets.to(positions)[:, None, None]).clamp_min(0)
