"""What a spec promises about memory, and a run that measures what a cache really holds.

The promise after a prefill of ``prompt`` tokens and ``new`` decoded ones: the theoretical
size of the prefill (:func:`kvopt.memory.estimate`, which ``kvopt memory`` prints) plus the new
tokens at full precision with explicit per-head positions (no method stores a token in more).
"""

from __future__ import annotations

import torch

from kvopt.memory import dtype_bytes, estimate
from kvopt.methods.quantization import POSITION_BYTES
from kvopt.methods.spec import evicts_while_decoding, storage
from kvopt.models.info import ModelInfo

#: Measured bytes may exceed the theoretical ones by this fraction (buffer slack, per-token positions and
#: scores the theoretical size leaves out: 8 of a token's 512 bytes per KV head at head_dim 64 in fp32).
SLACK = 0.02


def prefill_and_decode(model, cache, ids: torch.Tensor, new_tokens: int, tokenizer=None) -> None:
    """Prefill ``ids`` into ``cache`` (through :meth:`KVCache.prefill` when a method needs it), then
    decode ``new_tokens`` greedy tokens one forward at a time."""
    with torch.no_grad():
        if cache.needs_prefill_pass:
            logits = cache.prefill(model, ids, tokenizer=tokenizer).logits
        else:
            logits = model(ids, past_key_values=cache).logits
        for _ in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            logits = model(token, past_key_values=cache).logits


def held_tokens(cache) -> int:
    """Real tokens held, summed over layers and the batch."""
    return sum(layer.kept for layer in cache.stats())


def token_bound(info: ModelInfo, methods, prompt: int, new_tokens: int, batch: int = 1) -> int | None:
    """Tokens the spec keeps after the prefill (summed over layers), plus every decoded token.

    None when KV heads keep different counts (ragged storage): the count that ``stats()`` reports,
    head 0's, is then bounded only on average over the heads, which the bytes bound covers.
    """
    if any(storage(method) == "ragged" for method in methods):
        return None
    kept = estimate(info, prompt, batch, methods).tokens_per_layer
    return (sum(kept) + (new_tokens + overshoot(methods)) * info.num_layers) * batch


def overshoot(methods) -> int:
    """Tokens a decode-time eviction holds over its budget before it evicts (``compress_every`` batches evictions)."""
    decoding = [method for method in methods if evicts_while_decoding(method)]
    return max((getattr(method, "compress_every", 1) - 1 for method in decoding), default=0)


def byte_bound(info: ModelInfo, methods, prompt: int, new_tokens: int, dtype: torch.dtype, batch: int = 1) -> int:
    """The spec's theoretical bytes after the prefill, plus the decoded tokens at full precision.

    Head-wise budgets (ragged storage) are rounded per head, at most half a token each: one token more.
    """
    prefill = estimate(info, prompt, batch, methods, dtype=dtype).total_bytes
    per_token = info.num_layers * info.num_kv_heads * (2 * info.head_dim * dtype_bytes(dtype) + POSITION_BYTES)
    rounding = 1 if any(storage(method) == "ragged" for method in methods) else 0
    return int((prefill + (new_tokens + rounding + overshoot(methods)) * per_token * batch) * (1 + SLACK))
