"""``kivi``: asymmetric 2/4/8-bit KV quantization with a full-precision residual window.

KIVI (Liu et al., arXiv 2402.02750, ICML'24): keys have fixed outlier *channels*, so they are
quantized per channel (groups of ``group`` tokens); values feed a per-token weighted sum, so
they are quantized per token (groups of ``group`` channels). The newest ``residual`` tokens
stay in full precision; older ones are quantized in whole key groups as they leave it. Codes
are bit-packed (two 4-bit or four 2-bit codes per byte), scales and zero-points are fp16, and
attention dequantizes block by block (see :mod:`kvopt.cache.quantized`).

Deviations: keys and values leave the residual together, a key group at a time, so the
full-precision part holds ``residual`` to ``residual + group - 1`` tokens (KIVI's keys
oscillate between 0 and R tokens, its values keep exactly R). The residual stays in the
model's dtype. Sliding-window layers are left in full precision (their window bounds them).
Compose after prefill-time eviction: ``snapkv:ratio=0.75+kivi:bits=4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.cache.quant import BITS
from kvopt.errors import MethodParameterError
from kvopt.methods.base import Method, register


@register
@dataclass
class KIVI(Method):
    """Keys per channel, values per token, bit-packed; the newest ``residual`` tokens in full precision."""

    name = "kivi"
    summary = "KIVI quantization: keys per channel, values per token, 2/4/8-bit packed, fp residual window"
    budget_convention = "keeps every token; bits = 2, 4 or 8 per element"

    bits: int = field(default=4, metadata={"help": "bits per quantized element: 2, 4 or 8"})
    group: int = field(default=32, metadata={"help": "tokens per key group (channels per value group)"})
    residual: int = field(default=128, metadata={"help": "newest tokens kept in full precision"})

    #: How keys are grouped: per channel over tokens (KIVI) or per token over channels.
    key_mode = "channel"

    def validate(self) -> None:
        if self.bits not in BITS:
            raise MethodParameterError(f"{self.name}: bits={self.bits} is not supported; use one of {BITS}")
        if self.group < 8 or self.group % 8:
            raise MethodParameterError(f"{self.name}: group={self.group} must be a positive multiple of 8, e.g. 32")
        if self.residual < 0:
            raise MethodParameterError(f"{self.name}: residual={self.residual} must be >= 0")

    def check_model(self, model) -> None:
        if model.head_dim % min(self.group, model.head_dim):
            raise MethodParameterError(
                f"{self.name}: group={self.group} does not divide head_dim={model.head_dim}; use a divisor such as 32"
            )

    def layer_bytes(self, kept_tokens: int, model, element_bytes: int) -> int:
        """Residual at full precision; quantized tokens: packed codes, fp16 scale and zero per key
        group (per channel, ``group`` tokens) and per value group (per token, ``group`` channels),
        and one int32 position + validity byte per token (heads aligned); the residual's positions
        and validity bytes are counted per head, as the dense store holds them."""
        heads, dim = model.num_kv_heads, model.head_dim
        quantized = max(kept_tokens - self.residual, 0) // self.group * self.group
        residual = kept_tokens - quantized
        codes = 2 * heads * dim * self.bits // 8
        per_token_groups = dim // min(self.group, dim) * 4  # fp16 scale + zero per channel group
        key_params = dim * 4 / self.group if self.key_mode == "channel" else per_token_groups
        params = heads * (key_params + per_token_groups)
        return int(residual * heads * (2 * dim * element_bytes + 5) + quantized * (codes + params + 5))

    def after_attention(self, layer, step) -> None:
        layer.quantize_oldest(self.bits, self.group, self.residual, self.key_mode)
