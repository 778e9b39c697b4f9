"""The KV memory calculator: bytes per token and totals, exact integers, GQA and sliding layers aware.

Per layer and sequence a full cache holds ``2 (K and V) x kv_heads x head_dim x bytes`` per
token; a sliding-window layer holds at most ``window - 1`` past tokens plus the current one.
Methods shrink the token count through :meth:`Method.kept_tokens` and change the bytes per
token through :meth:`Method.layer_bytes` (quantization: codes, scales, zero-points and the
positions of quantized tokens, plus the full-precision residual); tokens an eviction kept at full
precision carry their int32 position per KV head (unless only the oldest were dropped, which keeps
a run). These are theoretical sizes; ``KVCache.nbytes()`` measures what a live cache really holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.errors import KVOptError
from kvopt.methods import Method
from kvopt.methods.base import LayerContext
from kvopt.methods.quantization import position_bytes
from kvopt.methods.spec import evicts
from kvopt.models.info import ModelInfo


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(info: ModelInfo, dtype: torch.dtype | None = None) -> int:
    """K+V bytes one token occupies across all layers at full precision."""
    width = dtype_bytes(dtype or info.dtype)
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * width


@dataclass(frozen=True)
class MemoryEstimate:
    seq_len: int
    batch: int
    bytes_per_token: int
    #: Tokens one sequence keeps per layer.
    tokens_per_layer: tuple[int, ...]
    total_bytes: int


def estimate(
    info: ModelInfo,
    seq_len: int,
    batch: int = 1,
    methods: list[Method] | None = None,
    dtype: torch.dtype | None = None,
) -> MemoryEstimate:
    """Theoretical KV bytes for ``batch`` sequences of ``seq_len`` tokens under ``methods``."""
    if seq_len < 0 or batch < 1:
        raise KVOptError(f"seq_len={seq_len} and batch={batch} must be >= 0 and >= 1 (a size is never negative)")
    for method in methods or []:
        method.check_model(info)  # also lets methods learn the model's layout (layer pairs, layer counts)
    per_layer_token_bytes = bytes_per_token(info, dtype) // info.num_layers
    tokens, total = [], 0
    for index, window in enumerate(info.sliding_windows):
        kept = seq_len if window is None else min(seq_len, window)
        for method in methods or []:
            kept = min(kept, method.kept_tokens(seq_len))
        tokens.append(kept)
        layer = kept * per_layer_token_bytes
        if window is None:  # sliding layers stay in full precision
            selected = kept < seq_len and any(evicts(m) and not m.evicts_oldest_only for m in methods or [])
            layer += position_bytes(kept, info.num_kv_heads) if selected else 0
            for position, method in enumerate(methods or []):
                earlier = (methods or [])[:position]
                per_head = any(m.selects_per_head for m in earlier)
                evicted = any(m.kept_tokens(seq_len) < seq_len for m in earlier)
                context = LayerContext(index, tuple(methods or []), per_head, evicted)
                stored = method.layer_bytes(kept, info, dtype_bytes(dtype or info.dtype), context)
                layer = stored if stored is not None else layer  # (a method's own size includes its positions)
        total += layer * batch
    return MemoryEstimate(seq_len, batch, bytes_per_token(info, dtype), tuple(tokens), total)


def human_bytes(count: float) -> str:
    """Decimal units (1 GB = 10^9 bytes), the convention of the published KV-cache figures."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")
