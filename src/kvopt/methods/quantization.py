"""The shared part of quantization methods: group, residual window, validation and sizes.

A quantization method keeps the newest tokens of each layer in full precision until
``residual`` of them are held, then moves all whole groups of ``group`` tokens into packed
storage (:mod:`kvopt.cache.quantized`), KIVI's schedule for keys. Subclasses decide the bits of each token (KIVI: one width;
mixed precision: by importance) and describe them in :meth:`Quantization.bit_classes`, from
which the theoretical size follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.cache.quant import BITS
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods.base import Method

#: int32 position stored per token once eviction leaves the positions irregular (per KV head for the
#: dense store and after head-wise eviction); a run of consecutive positions is held as its start.
POSITION_BYTES = 4


@dataclass
class Quantization(Method):
    group: int = field(default=32, metadata={"help": "tokens per key group (channels per value group)"})
    residual: int = field(default=128, metadata={"help": "full-precision tokens held before whole groups are quantized"})

    budget_convention = "keeps every token; stores older ones in fewer bits"
    #: Tokens leaving the residual move out of the dense store (see :func:`kvopt.methods.spec.storage`).
    storage = "quantized"
    #: How keys are grouped: per channel over tokens (KIVI) or per token over channels.
    key_mode = "channel"
    #: Whether all KV heads quantize the same tokens (one position row for all heads).
    heads_aligned = True

    def validate(self) -> None:
        if self.group < 8 or self.group % 8:
            raise MethodParameterError(f"{self.name}: group={self.group} must be a positive multiple of 8, e.g. 32")
        if self.residual < 0:
            raise MethodParameterError(f"{self.name}: residual={self.residual} must be >= 0")

    def check_bits(self, name: str, value: int) -> None:
        if value not in BITS:
            raise MethodParameterError(f"{self.name}: {name}={value} is not supported; use one of {BITS}")

    def check_model(self, model) -> None:
        if model.head_dim % min(self.group, model.head_dim):
            raise MethodParameterError(
                f"{self.name}: group={self.group} does not divide head_dim={model.head_dim}; use a divisor such as 32"
            )

    def quantize_oldest(self, layer, bits: int) -> None:
        """Once ``residual`` full-precision tokens are held, quantize all whole groups of ``group`` (the oldest),
        leaving fewer than ``group`` in full precision (KIVI's key schedule, so the full-precision part stays below
        ``residual`` tokens). Sliding layers stay in full precision: their window already bounds them; so do layers
        a cross-layer method owns (MiniCache quantizes their merged directions itself)."""
        owned = any(method.owns_layer(layer.index) for method in layer.methods)
        held = len(layer.store)
        if layer.sliding_window is None and not owned and held >= max(self.residual, self.group):
            QuantizedKV.move_oldest(layer, held // self.group * self.group, bits, self.group, self.key_mode)

    def bit_classes(self, quantized_tokens: int, layer: int) -> list[tuple[int, int]]:
        """``(bits, tokens)`` of the quantized tokens of one sequence in layer ``layer``."""
        raise NotImplementedError

    def quantized_after_prefill(self, kept_tokens: int) -> int:
        """Tokens quantized right after a prefill of ``kept_tokens`` (whole groups, once the residual is full)."""
        return kept_tokens // self.group * self.group if kept_tokens >= max(self.residual, self.group) else 0

    def layer_bytes(self, kept_tokens: int, model, element_bytes: int, layer) -> int | None:
        """Size right after a prefill of ``kept_tokens``: whole groups packed (:func:`packed_bytes`),
        the remainder at full precision (:func:`dense_bytes`)."""
        if any(m.stores_quantized(self, kept_tokens, model, layer) for m in layer.methods if m is not self):
            return None  # another method stores these tokens quantized its own way (and counts them)
        heads, dim = model.num_kv_heads, model.head_dim
        quantized = self.quantized_after_prefill(kept_tokens)
        aligned = self.heads_aligned and not layer.per_head
        classes = self.bit_classes(quantized, layer.index)
        # Positions are a run unless earlier eviction made them irregular or classes split the run.
        irregular = layer.evicted or len(classes) > 1 or not self.heads_aligned
        packed = sum(
            packed_bytes(tokens, heads, dim, bits, self.group, self.key_mode)
            + (position_bytes(tokens, 1 if aligned else heads) if irregular else 0)
            for bits, tokens in classes
        )
        return dense_bytes(kept_tokens - quantized, heads, dim, element_bytes, layer.evicted) + packed


def position_bytes(tokens: int, rows: int) -> int:
    """Explicit int32 positions of ``tokens`` tokens, ``rows`` rows (1 for aligned heads, else one per head)."""
    return tokens * rows * POSITION_BYTES


def dense_bytes(tokens: int, heads: int, dim: int, element_bytes: int, evicted: bool = False) -> int:
    """Full-precision keys and values of ``tokens`` tokens (with per-head positions after eviction)."""
    return tokens * heads * 2 * dim * element_bytes + (position_bytes(tokens, heads) if evicted else 0)


def packed_bytes(tokens: int, heads: int, dim: int, bits: int, group: int, key_mode: str) -> int:
    """Quantized keys and values of ``tokens`` tokens: packed codes, fp16 scale and zero per key group
    (per channel over ``group`` tokens, or per token) and per value group (per token, ``group``
    channels)."""
    per_token_groups = dim // min(group, dim) * 4
    key_params = dim * 4 / group if key_mode == "channel" else per_token_groups
    codes = 2 * heads * dim * bits // 8
    return int(tokens * (codes + heads * (key_params + per_token_groups)))
