"""``kivi``: asymmetric 2/4/8-bit KV quantization with a full-precision residual window.

KIVI (Liu et al., arXiv 2402.02750, ICML'24): keys have fixed outlier *channels*, so they are
quantized per channel (groups of ``group`` tokens); values feed a per-token weighted sum, so
they are quantized per token (groups of ``group`` channels). New tokens stay in full
precision until ``residual`` of them are held; then every whole group is quantized at once
(KIVI's key schedule: the full-precision part oscillates between 0 and ``residual`` tokens,
the same as HF's ``QuantizedCache``). Codes are bit-packed (two 4-bit or four 2-bit codes per
byte), scales and zero-points are fp16, and attention dequantizes block by block (see
:mod:`kvopt.cache.quantized`).

Deviations: values follow the keys' schedule (KIVI keeps exactly the last R values in full
precision and quantizes one token per step). The full-precision part stays in the model's
dtype. Sliding-window layers are left in full precision (their window bounds them).
Compose after prefill-time eviction: ``snapkv:ratio=0.75+kivi:bits=4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.methods.base import register
from kvopt.methods.quantization import Quantization


@register
@dataclass
class KIVI(Quantization):
    """Keys per channel, values per token, bit-packed; the newest ``residual`` tokens in full precision."""

    name = "kivi"
    summary = "KIVI quantization: keys per channel, values per token, 2/4/8-bit bit-packed, recent tokens in fp"

    runs_in_engine = True

    bits: int = field(default=4, metadata={"help": "bits per quantized element: 2, 4 or 8"})

    def validate(self) -> None:
        super().validate()
        self.check_bits("bits", self.bits)

    def bit_classes(self, quantized_tokens: int, layer: int) -> list[tuple[int, int]]:
        return [(self.bits, quantized_tokens)]

    verifies_at_once = True  # quantization reads the stored tokens only

    def speculation_limit(self, layer) -> int | None:
        """A speculative block ends on the token that fills the residual (see :meth:`KVLayer.quantize_oldest`)."""
        if layer.sliding_window is not None or any(m.owns_layer(layer.index) for m in layer.methods):
            return None  # left in full precision
        return max(1, max(self.residual, self.group) - len(layer.store))

    def after_attention(self, layer, step) -> None:
        layer.quantize_oldest(self.bits, self.group, self.residual, self.key_mode)
