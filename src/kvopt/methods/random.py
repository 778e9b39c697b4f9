"""``random``: uniformly random eviction per KV head at prefill, a control for scored methods.

As kvpress ``RandomPress``: every stored token gets a uniform random score, so the kept set
is a uniform sample of the prompt (plus the protected ``window``, 0 by default). The draw is
seeded and reproducible: the generator is seeded from ``seed`` and the layer index, so every
layer draws its own sample, independent of the order layers run in.

This module shadows nothing: inside the package it is ``kvopt.methods.random``, and it imports
only ``torch`` (never the standard library's ``random``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction

#: Multiplier separating the seeds of successive layers (a prime, so seeds rarely collide).
_LAYER_STRIDE = 1_000_003


@register
@dataclass
class Random(Eviction):
    """Keep a seeded uniformly random subset of tokens per KV head."""

    name = "random"
    summary = "uniformly random tokens per KV head, seeded, at prefill (a control)"

    seed: int = field(default=0, metadata={"help": "random seed (same seed, same selection)"})

    def score(self, layer, step) -> torch.Tensor:
        index = getattr(step.module, "layer_idx", 0) or 0
        generator = torch.Generator().manual_seed(self.seed + _LAYER_STRIDE * index)
        shape = layer.store.keys.shape[:-1]  # [B, H_kv, T]
        return torch.rand(shape, generator=generator, device="cpu").to(layer.store.keys.device)  # one draw on every device
