"""``streamingllm``: attention sinks plus a sliding window, with positions within the cache.

StreamingLLM (Xiao et al., arXiv 2309.17453, ICLR'24): window attention collapses once the
first tokens are evicted, because they act as "attention sinks". Keep the first ``sinks``
tokens and the ``budget - sinks`` most recent ones, the same tokens for every head of a layer
(scores have a head axis of 1), and evict the middle whenever the cache is over budget.

With ``rolling=always``, attention uses positions *within the cache* (the paper's setting,
needed to stream past the model's trained context): each step the stored post-RoPE
keys are re-rotated, for this read only, by RoPE composition ``R(new) R(old)^-1 = R(new - old)``:
``k' = k cos(delta theta) + rotate_half(k) sin(delta theta)``. A live key with ``d`` valid
slots after it takes position ``p - d``, ``p`` being the newest query's (absolute) position, so
key slots are contiguous and the newest key sits at ``p``. RoPE is relative, so this equals the
paper's keys at slots ``0..T-1`` and query at ``T-1``, while queries keep the absolute position
the model gave them. In a multi-token forward (a chunk) the new tokens keep their own
positions (``d`` counts the chunk's later tokens) and the older keys sit contiguously right
before the chunk; causality still follows the stored absolute positions. Padding and
masked-out slots are not counted, so a left-padded row sees the same distances as alone.

``rolling=auto`` (default) keeps absolute positions while the newest query is inside the
model's trained context and rolls only beyond it. Inside the context, absolute distances are
what the model was trained on and keep retrieval intact (on the default model, rolling from the
start lost passkeys that absolute positions kept); beyond it, in-cache distances (at most the
budget) are the only ones the model knows. ``rolling=never`` keeps absolute positions, and the
context limit then holds.

Deviations from the paper and its code:

* Keys are stored post-RoPE at their absolute positions and re-rotated at read time (the
  paper stores them un-rotated and rotates by slot); other methods composed with this one
  keep scoring against absolute positions. Rotation angles are computed in float64 and
  reduced modulo 2 pi, so long streams lose no precision. RoPE's ``attention_scaling`` is
  already inside the stored keys and is not applied again.
* Supports half-split ("rotate_half") RoPE of the default, linear, llama3, yarn and
  proportional kinds, partial rotary included; dynamic-NTK and LongRoPE change frequencies
  with the sequence length and are rejected once rolling is needed (use ``rolling=never``).
* The cache is compressed right after the prefill too (a prompt longer than the budget keeps
  its sinks and its end); the paper streams token by token. ``compress_every`` batches
  evictions, ``ratio`` fixes the budget from the prompt, kvpress-style.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvopt.cache import prerope
from kvopt.errors import MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction

ROLLING = ("auto", "always", "never")


@register
@dataclass
class StreamingLLM(Eviction):
    """Keep the first ``sinks`` tokens and the most recent ones; attend by positions in the cache."""

    name = "streamingllm"
    selects_per_head = False  # one token set for all heads of a layer
    summary = "attention sinks + recent window, layer-shared; rolls positions past the trained context (StreamingLLM)"
    schedule = "decode"
    budget_convention = (
        "budget = tokens kept (sinks included), or ratio = fraction of the prefill removed, or sinks + window"
    )

    sinks: int = field(default=4, metadata={"help": "first tokens always kept (attention sinks), in the budget"})
    rolling: str = field(
        default="auto",
        metadata={"help": "positions within the cache: auto (past the trained context only), always, never"},
    )

    @property
    def runs_in_engine(self) -> bool:  # rolled positions re-rotate keys at read time, which paged attention does not
        return self.rolling != "always"

    @property
    def extends_context(self) -> bool:  # the cache lets rolling runs go past max_position_embeddings
        return self.rolling != "never"

    def validate(self) -> None:
        if self.ratio is None and self.budget is None and self.window > 0:
            self.budget = self.sinks + self.window  # the paper's "sinks=4,window=1020" = 1024 tokens
        super().validate()
        if self.rolling not in ROLLING:
            raise MethodParameterError(
                f"streamingllm: rolling={self.rolling!r} is not one of {', '.join(ROLLING)}, e.g. streamingllm:rolling=auto"
            )
        if self.sinks < 0:
            raise MethodParameterError(f"streamingllm: sinks={self.sinks} must be >= 0")
        if self.budget is not None and self.sinks >= self.budget:
            raise MethodParameterError(
                f"streamingllm: sinks={self.sinks} must be smaller than budget={self.budget} "
                "(recent tokens fill the rest of it)"
            )

    def score(self, layer, step) -> torch.Tensor:
        store = layer.store
        valid = store.valid[:, :1] if store.heads_aligned else store.valid  # [B, 1 or H_kv, T]
        tokens = valid.shape[-1]
        recency = torch.arange(tokens, device=valid.device, dtype=torch.float32).expand(valid.shape)
        rank = valid.cumsum(dim=-1)  # 1 for the first real token of each row
        # Sinks outrank every recent token, the first sink first (should a budget hold fewer than ``sinks``).
        return torch.where(valid & (rank <= self.sinks), (tokens + self.sinks - rank).float(), recency)

    def after_attention(self, layer, step) -> None:
        if self.rolling != "never" and f"{self.name}.module" not in layer.state:
            layer.state[f"{self.name}.module"] = step.module
            if self.rolling == "always":
                self._inv_freq(layer, step.query)  # reject an unsupported RoPE at once
        super().after_attention(layer, step)

    def _inv_freq(self, layer, like: torch.Tensor) -> torch.Tensor:
        key = f"{self.name}.inv_freq"
        if key not in layer.state:
            layer.state[key] = rope_inv_freq(layer.state[f"{self.name}.module"], like.shape[-1]).to(like.device)
        return layer.state[key]

    def _rolls(self, layer, newest_position: int) -> bool:
        if self.rolling == "never" or len(layer.store) == layer.seen:
            return False  # nothing was ever dropped: slots are positions already
        if self.rolling == "always":
            return True
        config = getattr(layer.state.get(f"{self.name}.module"), "config", None)
        limit = getattr(config, "max_position_embeddings", None)
        return limit is not None and newest_position >= limit

    def read_keys(self, layer, keys: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        if not self._rolls(layer, int(query_positions[-1])):
            return keys
        store = layer.store
        valid = store.valid
        after = valid.flip(-1).cumsum(dim=-1).flip(-1) - valid.to(torch.long)  # valid slots after each slot
        delta = (query_positions[-1] - after) - store.positions  # [B, H_kv, T]
        delta = delta.masked_fill(~valid, 0)
        return rerotate(keys, delta, self._inv_freq(layer, keys))


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE ``keys [B, H, T, D]`` by ``delta [B, H, T]`` positions (half-split RoPE)."""
    rotary = 2 * inv_freq.shape[0]
    angles = delta[..., None].double() * inv_freq.double()  # [B, H, T, rotary / 2]
    angles = torch.remainder(angles, 2 * math.pi).float()
    cos, sin = angles.cos(), angles.sin()
    part = keys[..., :rotary].float()
    first, second = part[..., : rotary // 2], part[..., rotary // 2 :]
    moved = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(keys.dtype)
    return moved if rotary == keys.shape[-1] else torch.cat([moved, keys[..., rotary:]], dim=-1)


def rope_inv_freq(module, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies ``[rotary_dim / 2]`` of an attention module, from its model config."""
    try:
        return prerope.rope_inv_freq(getattr(module, "config", None), getattr(module, "layer_idx", 0), head_dim)
    except prerope.RopeError as error:
        raise MethodParameterError(
            f"streamingllm: rolling positions re-rotate cached keys, but {error}; use streamingllm:rolling=never"
        ) from None
