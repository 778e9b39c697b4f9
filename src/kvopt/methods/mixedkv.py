"""``mixedkv``: mixed precision by token importance -- salient tokens in more bits (ZipCache-style).

ZipCache (He et al., arXiv 2405.14256): a token's saliency is its *normalized* attention, the
attention it receives summed over probe queries divided by how many of them could attend to it
(plain column sums favour early tokens, which more queries can see under the causal mask).
The most salient ``salient`` fraction of each KV head's tokens is stored in ``high`` bits, the
rest in ``low`` bits, with KIVI's layout (keys per channel, values per token, bit-packed; see
:mod:`kvopt.methods.kivi`). Saliency keeps accumulating while tokens wait in full
precision, and is decided when they are quantized (whenever ``residual`` tokens are held, as
:mod:`kvopt.methods.kivi`): the periodic re-evaluation of ZipCache's streaming mode.

Deviations: probes are the last ``probe`` fraction of the prompt's queries plus every decode
query (ZipCache adds 5% random earlier queries); attention is normalized over the
full-precision tokens only (quantized ones are not re-scored); classes are rounded to whole
key groups. Heads choose their own tokens, so positions are stored per KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods.base import register, require_ratio
from kvopt.methods.quantization import Quantization
from kvopt.methods.scores import accumulate_attention

SCORE, COUNT = "mixedkv.attention", "mixedkv.queries"


@register
@dataclass
class MixedKV(Quantization):
    """Per KV head, the most attended tokens in ``high`` bits and the others in ``low`` bits."""

    name = "mixedkv"
    summary = "mixed precision by normalized attention: salient tokens in high bits, the rest in low (ZipCache)"
    heads_aligned = False

    high: int = field(default=4, metadata={"help": "bits of salient tokens"})
    low: int = field(default=2, metadata={"help": "bits of the other tokens"})
    salient: float = field(default=0.6, metadata={"help": "fraction of quantized tokens stored in high bits"})
    probe: float = field(default=0.1, metadata={"help": "fraction of the prompt's last queries used as probes"})

    def validate(self) -> None:
        super().validate()
        self.check_bits("high", self.high)
        self.check_bits("low", self.low)
        if self.high <= self.low:
            raise MethodParameterError(
                f"mixedkv: high={self.high} must exceed low={self.low}; for one width use kivi:bits={self.high}"
            )
        if not 0.0 <= self.salient <= 1.0:
            raise MethodParameterError(f"mixedkv: salient={self.salient} must lie in [0, 1]")
        require_ratio(self, "probe")

    def salient_tokens(self, tokens: int) -> int:
        """High-precision tokens among ``tokens`` quantized at once, in whole groups."""
        return round(self.salient * tokens / self.group) * self.group

    def bit_classes(self, quantized_tokens: int, layer: int) -> list[tuple[int, int]]:
        high = self.salient_tokens(quantized_tokens)
        return [(self.high, high), (self.low, quantized_tokens - high)]

    def after_attention(self, layer, step) -> None:
        if layer.sliding_window is not None:
            return  # sliding layers stay in full precision (their window bounds them)
        probes = max(1, math.ceil(self.probe * step.query.shape[-2])) if step.is_prefill else None
        accumulate_attention(layer, step, SCORE, last=probes)
        self._count_queries(layer, step.query_positions[-probes:] if probes else step.query_positions)
        if len(layer.store) >= max(self.residual, self.group):
            self._quantize(layer, len(layer.store) // self.group * self.group)

    @staticmethod
    def _count_queries(layer, query_positions: torch.Tensor) -> None:
        """Per stored token, add how many of these queries can attend to it (the normalizer)."""
        store = layer.store
        if not store.has_extra(COUNT):
            store.add_extra(COUNT)
        earlier = torch.searchsorted(query_positions.contiguous(), store.positions.long().contiguous())
        store.extra(COUNT).add_(query_positions.numel() - earlier)

    def _quantize(self, layer, count: int) -> None:
        """Split the oldest ``count`` tokens per head by normalized attention and quantize both classes."""
        store = layer.store
        saliency = store.extra(SCORE)[..., :count] / store.extra(COUNT)[..., :count].clamp(min=1)
        saliency = saliency.masked_fill(~store.valid[..., :count], float("-inf"))  # padding is never salient
        high = self.salient_tokens(count)
        is_high = torch.zeros_like(saliency, dtype=torch.bool)
        if high:
            is_high.scatter_(-1, saliency.topk(high, dim=-1).indices, True)
        order = torch.sort(is_high.to(torch.int8), dim=-1, stable=True).indices  # low ones first, each in slot order
        for bits, index in ((self.low, order[..., : count - high]), (self.high, order[..., count - high :])):
            if index.shape[-1] == 0:
                continue
            expand = index[..., None].expand(-1, -1, -1, store.keys.shape[-1])
            QuantizedKV.encode(
                store.keys.gather(2, expand), store.values.gather(2, expand), store.positions.gather(2, index),
                store.valid.gather(2, index), bits, self.group, self.key_mode,
            ).add_to(layer)  # fmt: skip
        store.drop_oldest(count)
