"""kvopt's attention function, registered through ``transformers.AttentionInterface``.

The seam: HF models call ``past_key_values.update(k, v, layer_idx)`` and then the configured
attention function. A :class:`~kvopt.cache.kv_cache.KVCache` does not store in ``update``; it
parks the new tensors and returns them. :func:`kvopt_attention` recognises them (by identity),
stores them with their padding bits taken from the mask, attends over what the layer's storage
holds (so storage may be evicted, quantized or paged), then lets the methods act with the
queries in hand. Any other cache, or no cache, gets plain attention over the tensors given.

Masks: for ``"kvopt"`` HF's mask builders call :func:`kvopt_mask`, which returns the 2-D
padding mask itself (``[batch, seen + new]``, True = real token); causality and sliding
windows are computed from stored token positions, which stay right after eviction
(:func:`~kvopt.cache.attention_math.visibility`; the math itself lives in :mod:`kvopt.cache.attention_math`).
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass

import torch

# The math lives in attention_math; these names stay importable from here for the seam's callers.
from kvopt.cache.attention_math import (  # noqa: F401
    attend,
    attention_with_lse,
    attention_with_shared_sums,
    cpu_flash,
    cpu_flash_available,
    decode_pieces,
    merge_pieces,
    merge_with_lse,
    visibility,
)

ATTENTION_NAME = "kvopt"


@dataclass
class PendingUpdate:
    """New key/value tensors a cache layer handed to the model, awaiting the attention call."""

    layer: weakref.ReferenceType
    keys: torch.Tensor


_PENDING: contextvars.ContextVar[PendingUpdate | None] = contextvars.ContextVar("kvopt_pending", default=None)


def park(layer, keys: torch.Tensor) -> None:
    """Called by a cache layer's ``update``: the next attention call on ``keys`` belongs to ``layer``."""
    _PENDING.set(PendingUpdate(weakref.ref(layer), keys))


def claim(keys: torch.Tensor):
    """The cache layer that parked ``keys``, or None when the tensors came from elsewhere."""
    pending = _PENDING.get()
    if pending is None or pending.keys is not keys:
        return None
    _PENDING.set(None)
    return pending.layer()


def kvopt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over kvopt storage (or plain tensors); returns ``[batch, q_len, heads, head_dim]``."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvopt attention does not support attention sinks (s_aux) yet")
    if dropout and module.training:
        raise NotImplementedError("kvopt attention is for inference; disable dropout (model.eval())")
    padding = _padding_mask(attention_mask, key.shape[0])
    layer = claim(key)
    if layer is None:
        return _plain_attention(query, key, value, attention_mask, padding, scaling, sliding_window, softcap), None
    return layer.attend(module, query, key, value, padding, scaling, sliding_window, softcap), None


def _padding_mask(attention_mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise NotImplementedError(
            "kvopt attention received a prepared 4-D mask; pass a 2-D padding mask (the usual `attention_mask`)"
        )
    return attention_mask.to(torch.bool).expand(batch, -1)


def _plain_attention(query, key, value, attention_mask, padding, scaling, sliding_window, softcap):
    """No kvopt cache: the keys are the most recent ``kv_len`` tokens of each row (HF layout)."""
    kv_len, q_len = key.shape[-2], query.shape[-2]
    seen = padding.shape[-1] if padding is not None else kv_len
    key_positions = torch.arange(seen - kv_len, seen, device=key.device).expand(key.shape[0], 1, -1)
    key_valid = padding[:, None, seen - kv_len :] if padding is not None else None
    query_positions = torch.arange(seen - q_len, seen, device=key.device)
    return attend(query, key, value, key_positions, key_valid, query_positions, scaling, sliding_window, softcap)


def kvopt_mask(*, attention_mask: torch.Tensor | None = None, **_: object) -> torch.Tensor | None:
    """HF mask-interface hook: hand the 2-D padding mask through untouched (None if no padding)."""
    if attention_mask is None or attention_mask.ndim != 2 or bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> None:
    """Register the attention and mask functions under ``"kvopt"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvopt_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvopt_mask)


def prepare(model) -> None:
    """Make ``model`` run its attention through kvopt (registered, not monkeypatched)."""
    register()
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
