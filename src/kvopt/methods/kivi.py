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
Compose after prefill-time eviction: ``snapkv:ratio=0.75+kivi:bits=4``. After head-wise budgets
(``adakv``, ``kvzip``: heads keep different tokens) the kept rows are quantized the same way, keys
per channel over groups of each head's own kept tokens (padded to whole groups, since a head's
tokens do not line up with the other heads'); with kvzip, kivi waits for its reconstruction pass,
which needs the prompt at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.cache.ragged import RaggedKV
from kvopt.methods.base import register
from kvopt.methods.quantization import Quantization, packed_bytes, position_bytes
from kvopt.methods.spec import storage

#: A layer's kivi state: waiting for the spec's prefill pass (kvzip's), or quantizing as usual (the pass ran, or the
#: spec has none); set at the layer's first call.
WAITING, PASS_DONE = "waiting for the prefill pass", "after the prefill pass"


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
        """A speculative block ends on the token that fills the residual (see :meth:`Quantization.quantize_oldest`)."""
        if layer.sliding_window is not None or any(m.owns_layer(layer.index) for m in layer.methods):
            return None  # left in full precision
        return max(1, max(self.residual, self.group) - len(layer.store))

    waits_for_prompt_pass = True  # kvzip+kivi: kvzip scores and selects at full precision, then kivi quantizes

    def after_attention(self, layer, step) -> None:
        if self._waiting(layer):
            return
        self._quantize_held(layer)

    def idle_after_attention(self, state: dict, held: int) -> bool:
        """Nothing happens while a prompt pass is awaited or until the residual fills (:meth:`quantize_oldest`; the
        engine's layers hold no ragged rows): most decode steps."""
        return state.get(self.name) == WAITING or held < max(self.residual, self.group)

    def after_prefill(self, cache, model, input_ids, attention_mask, tokenizer) -> None:
        """After a prefill pass (kvzip's, which acts before it in the spec): quantize what the pass kept."""
        for layer in cache.layers:
            if self._waiting(layer):
                layer.state[self.name] = PASS_DONE
                self._quantize_held(layer)

    def _waiting(self, layer) -> bool:
        """While a method of the spec still has to act on the whole prompt at full precision: whether the spec has
        such a method is read once per layer, not at every step."""
        phase = layer.state.get(self.name)
        if phase is None:
            phase = layer.state[self.name] = WAITING if any(m.needs_prefill_pass for m in layer.methods) else PASS_DONE
        return phase == WAITING

    def _quantize_held(self, layer) -> None:
        """Ragged rows that head-wise budgets left (adakv, kvzip) quantized at once (keys per channel over each head's
        tokens); the dense store's oldest whole groups as KIVI schedules them."""
        if layer.sliding_window is None and not any(m.owns_layer(layer.index) for m in layer.methods):
            for part in layer.parts_of(RaggedKV):
                if isinstance(part.keys, torch.Tensor):
                    layer.parts[layer.parts.index(part)] = part.quantized(self.bits, self.group)
        self.quantize_oldest(layer, self.bits)

    def layer_bytes(self, kept_tokens: int, model, element_bytes: int, layer) -> int | None:
        """Right after the prefill; behind head-wise budgets (ragged rows) every kept token is quantized (one int32
        position each per KV head; each head's keys padded to whole groups, counted as half a group per head), else
        :meth:`Quantization.layer_bytes`."""
        if not any(storage(m) == "ragged" for m in layer.methods[: layer.methods.index(self)]):
            return super().layer_bytes(kept_tokens, model, element_bytes, layer)
        heads, dim = model.num_kv_heads, model.head_dim
        padding = heads * (self.group // 2) * dim * self.bits // 8
        return packed_bytes(kept_tokens, heads, dim, self.bits, self.group, "channel") + padding + position_bytes(
            kept_tokens, heads
        )
