"""``tova``: Token Omission Via Attention, a constant-size cache updated at every step.

TOVA (Oren et al., arXiv 2401.06104): when the cache exceeds its budget, drop the tokens the
*newest* query attends to least, the attention averaged over all heads of the layer, so one
index set serves the whole layer. Applied after the prefill too (where the last prompt query
decides). No sink or window is forced; ``window`` can protect recent tokens if wanted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction
from kvopt.methods.scores import attention_probs


@register
@dataclass
class TOVA(Eviction):
    """Keep the tokens the last query attends to most, averaged over all heads (layer-shared)."""

    name = "tova"
    selects_per_head = False  # one token set for all heads of a layer
    summary = "last-query attention averaged over heads; constant-size cache at every step (TOVA)"
    schedule = "decode"

    def score(self, layer, step) -> torch.Tensor:
        probs = attention_probs(layer, step, last=1)  # [B, H_kv, g, 1, T]
        return probs.mean(dim=(1, 2, 3))[:, None, :]  # [B, 1, T]: all heads share one selection
