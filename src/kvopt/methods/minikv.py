"""``minikv``: layer-discriminative bit widths chosen by a calibration pass, KIVI layout.

MiniKV (Sharma et al., arXiv 2411.18077) pairs 2-bit KIVI-style storage with prefill-time
eviction whose budget differs per layer. Here the *bits* differ per layer: a calibration pass
measures how much each layer's quantization hurts (the KL divergence of the next-token
distributions on a short real text when that layer alone is stored in ``low`` bits), and the
``sensitive`` fraction of layers that hurt most keep ``high`` bits. Compose with prefill
eviction for MiniKV's full recipe: ``pyramidkv:ratio=0.75+minikv`` (pyramidal layer budgets)
or ``snapkv:ratio=0.75+minikv``.

Calibration runs once per model when a cache is built (one prefill of ``calibration`` tokens of
the text the caller supplies -- :func:`kvopt.api.build_cache` gives local prose, the evaluation's
real text -- then one pass over its last 128 tokens per layer), and is stored under
``$KVOPT_CACHE/minikv/`` keyed by the model path, its config and these parameters: 21-178 s for
the default model on one CPU thread, by the machine (a server runs it beside its decoding step,
:meth:`kvopt.engine.LLMEngine.preparation`).
Deviations: MiniKV quantizes every layer to 2 bits and varies the eviction budget by layer;
its selective flash-attention kernel is not reproduced (scores come from the eviction method).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvopt.cache import KVCache
from kvopt.errors import MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.quantization import Quantization
from kvopt.methods.recording import record_prefill
from kvopt.models.forward import cache_kwargs

#: Tokens at the end of the calibration text whose loss is measured (the rest is the quantized context).
SCORED_TOKENS = 128


@register
@dataclass
class MiniKV(Quantization):
    """Per-layer bits: the most quantization-sensitive layers in ``high`` bits, the rest in ``low``."""

    name = "minikv"
    summary = "layer-discriminative bits from a calibration pass (MiniKV-style); compose after snapkv/pyramidkv"

    low: int = field(default=2, metadata={"help": "bits of most layers"})
    high: int = field(default=4, metadata={"help": "bits of the most sensitive layers"})
    sensitive: float = field(default=0.25, metadata={"help": "fraction of layers stored in high bits"})
    calibration: int = field(default=512, metadata={"help": "tokens of text in the calibration pass"})

    def __post_init__(self) -> None:
        #: Bits per layer once calibrated (None for sliding layers, which stay in full precision).
        self.layer_bits: list[int | None] | None = None
        #: Layers in high bits; before calibration the theoretical size counts the first ones (same total).
        self.high_count = 0
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        self.check_bits("low", self.low)
        self.check_bits("high", self.high)
        if self.high <= self.low:
            raise MethodParameterError(f"minikv: high={self.high} must exceed low={self.low}")
        if not 0.0 <= self.sensitive <= 1.0:
            raise MethodParameterError(f"minikv: sensitive={self.sensitive} must lie in [0, 1]")
        if self.calibration < SCORED_TOKENS + self.group:
            raise MethodParameterError(
                f"minikv: calibration={self.calibration} must be at least {SCORED_TOKENS + self.group} tokens"
            )

    def high_layers(self, layers: int) -> int:
        return round(self.sensitive * layers)

    def bit_classes(self, quantized_tokens: int, layer: int) -> list[tuple[int, int]]:
        if self.layer_bits is not None:
            return [(self.layer_bits[layer] or self.low, quantized_tokens)]
        return [(self.high if layer < self.high_count else self.low, quantized_tokens)]

    def check_model(self, model) -> None:
        super().check_model(model)
        self.high_count = self.high_layers(model.num_layers)

    def prepare(self, model, calibration_text: Callable[[], str]) -> None:
        if self.layer_bits is None:
            self.layer_bits = load_or_calibrate(self, model, calibration_text)

    def after_attention(self, layer, step) -> None:
        bits = self.layer_bits[step.module.layer_idx] if self.layer_bits is not None else None
        if bits is not None:
            self.quantize_oldest(layer, bits)


def sensitivities(method: MiniKV, model, ids: torch.Tensor) -> list[float]:
    """Per layer: KL divergence of the next-token distributions on the last tokens of ``ids [1, n]``
    with only that layer in ``low`` bits, from those of a full cache (sliding layers: -inf).

    The context is prefilled once and replayed into each probe cache (methods act after
    attention, so this equals a prefill per probe); only the scored tokens run per layer.
    """
    context, scored = ids[:, :-SCORED_TOKENS], ids[:, -SCORED_TOKENS:]
    recorded, _ = record_prefill(model, context, logits_to_keep=1)

    def log_probs(layer_bits: list[int | None]) -> torch.Tensor:
        probe = MiniKV(low=method.low, high=method.high, group=method.group, residual=0)
        probe.layer_bits = layer_bits  # calibrated: the probe needs no set-up of its own
        cache = KVCache.for_model([probe], model)
        cache.replay_prefill(recorded)
        with torch.no_grad():
            return torch.log_softmax(model(scored, **cache_kwargs(model, cache)).logits[0].float(), dim=-1)

    layers = model.config.num_hidden_layers
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * layers
    reference = log_probs([None] * layers)
    scores = []
    for layer in range(layers):
        if kinds[layer] != "full_attention":
            scores.append(-math.inf)
            continue
        quantized = log_probs([method.low if i == layer else None for i in range(layers)])
        scores.append(torch.nn.functional.kl_div(quantized, reference, log_target=True, reduction="batchmean").item())
    return scores


def assign_bits(method: MiniKV, scores: list[float]) -> list[int | None]:
    """The ``sensitive`` fraction of layers with the largest loss rise get ``high`` bits."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    high = set(ranked[: method.high_layers(len(scores))])
    return [None if scores[i] == -math.inf else method.high if i in high else method.low for i in range(len(scores))]


def load_or_calibrate(method: MiniKV, model, calibration_text: Callable[[], str]) -> list[int | None]:
    """Calibrated bits for ``model``, from the cache folder or computed now on ``calibration_text()``."""
    from kvopt.models.loading import calibration_path, model_tokenizer

    tokenizer = model_tokenizer(
        model, "minikv calibrates on real text and needs the model's tokenizer (load the model from a folder, or set "
        "method.layer_bits = kvopt.methods.minikv.assign_bits(method, sensitivities(method, model, ids)))",
    )  # fmt: skip
    settings = [method.low, method.high, method.sensitive, method.group, method.calibration]
    path = calibration_path("minikv", model, settings, suffix=".json")
    if path.exists():
        return json.loads(path.read_text())["layer_bits"]
    text = calibration_text()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : method.calibration]
    scores = sensitivities(method, model, ids.to(model.device))
    bits = assign_bits(method, scores)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model.name_or_path, "layer_bits": bits, "kl": scores}, indent=1))
    return bits
