"""``aquakv``: kvquant's codes for what linear predictors from the layer below cannot explain (AQUA-KV).

AQUA-KV (Shutova et al., arXiv 2501.19392): much of a layer's KV is predictable from the
layer below (:mod:`kvopt.cache.crosslayer`), so layer ``l`` stores only the residuals

* ``K_l - f_l(K~_{l-1})`` and ``V_l - g_l([K~_l, K~_{l-1}])``,

where ``~`` marks the *reconstructed* tensors (prediction plus dequantized residual), which is
what a decoder can rebuild layer by layer. Keys are un-rotated to pre-RoPE first. Values are
predicted from the two layers' keys (the paper: ``[K~_l, V~_{l-1}]``), which explains almost as
much of them (69% vs 72% of the variance on the default model) and lets attention apply the value
predictor to attention-weighted sums instead of rebuilding every value (:mod:`kvopt.cache.crosslayer`). ``f_l`` and
``g_l`` are affine maps over all KV heads of a token, fitted by ridge-regularized least squares
in layer order on the reconstructions of a calibration text (so each layer learns from the
inputs the decoder will really have). The residuals are quantized by :mod:`kvopt.methods.kvquant`'s
machinery (pre-RoPE per-channel keys, per-token values, Fisher-weighted non-uniform levels
fitted to the residuals, exact outliers, sinks at full precision, the same schedule), so each
token takes exactly kvquant's bytes; the predictors are per model (:meth:`AquaKV.model_bytes`).

Calibration runs once per model when a cache is built, on the last ``calibration`` tokens of the
caller's text (:func:`kvopt.api.build_cache`: local prose), and is cached under
``$KVOPT_CACHE/aquakv/``: 54-115 s for the default model on one CPU thread, by the machine (a server
runs it beside its decoding step, :meth:`kvopt.engine.LLMEngine.preparation`). Reading a layer's keys
needs the keys below reconstructed, so attention
rebuilds each layer's quantized keys whole (one ``[T, S * D] x [S * D, H * D]`` product per layer and
step on top of kvquant's decoding, in bf16 where the hardware has it) and keeps them until the next
layer has read them (see :class:`~kvopt.cache.nonuniform.NonUniformKV`).

Deviations: values predicted from keys (above); the residual quantizer is kvquant's, not HIGGS (Hadamard rotation + vector
quantization on an EDEN grid). Layer 0 (and the first full-attention layer of a model with sliding
layers, whose predictors read the previous full-attention layer) is quantized directly.
Prediction needs a layer and its source layer to hold the same tokens in the same slots: after an
eviction that keeps the same tokens in every layer and KV head (``window:ratio``) it applies; after
one that chooses per layer or per head (``snapkv``, ``pyramidkv``) the layers' codes hold the
vectors themselves, as kvquant's would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvopt.cache.crosslayer import LayerPredictor, fit_affine, heads_as_features
from kvopt.cache.nonuniform import LayerCodec, NonUniformKV, decode_keys, encode_keys
from kvopt.cache.positions import TokenIndex
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.kvquant import KVQuant
from kvopt.methods.nuq_calibration import capture, fit_keys, fit_layer, fit_values, sparse_count, trimmed
from kvopt.models.info import ModelInfo


@register
@dataclass
class AquaKV(KVQuant):
    """kvquant's storage for the residuals of per-layer linear predictors from the layer below."""

    name = "aquakv"
    summary = "AQUA-KV: linear predictors from the layer below, kvquant's 2/3/4-bit codes for what they miss"

    calibration: int = field(default=2048, metadata={"help": "tokens of text the predictors and levels are fitted on"})
    ridge: float = field(default=0.01, metadata={"help": "least-squares ridge, relative to the mean input energy"})

    def __post_init__(self) -> None:
        #: Per layer once calibrated (None where a layer has no source or slides): predictors and residual codecs.
        self.predictors: list[LayerPredictor | None] | None = None
        self.residual_codecs: list[LayerCodec | None] | None = None
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if self.ridge < 0:
            raise MethodParameterError(f"{self.name}: ridge={self.ridge} must be >= 0, e.g. 0.01")

    # -- calibration ----------------------------------------------------------------------------
    def calibrate(self, model, ids: torch.Tensor) -> None:
        info = ModelInfo.from_config(model.config)
        sparse, value_sparse = (sparse_count(share, info.head_dim) for share in (self.outliers, self.value_outliers))
        chain = fit_chain(capture(model, ids), info.sliding_windows, self, sparse, value_sparse)
        self.codecs, self.residual_codecs, self.predictors = chain

    def calibration_state(self) -> dict:
        as_dicts = lambda items: [None if item is None else dataclasses.asdict(item) for item in items]  # noqa: E731
        return {**super().calibration_state(), "residual_codecs": as_dicts(self.residual_codecs),
                "predictors": as_dicts(self.predictors)}  # fmt: skip

    def load_calibration(self, state: dict) -> None:
        super().load_calibration(state)
        self.residual_codecs = [None if c is None else LayerCodec(**c) for c in state["residual_codecs"]]
        self.predictors = [None if p is None else LayerPredictor(**p) for p in state["predictors"]]

    def model_bytes(self) -> int:
        """Levels, key ranges and RoPE tables (as kvquant) plus the residual codecs and the predictors."""
        extra = [item for item in (self.residual_codecs or []) + (self.predictors or []) if item is not None]
        return super().model_bytes() + sum(item.nbytes() for item in extra)

    # -- storage --------------------------------------------------------------------------------
    def codec(self, layer: int, predicted: bool) -> LayerCodec:
        return self.residual_codecs[layer] if predicted else self.codecs[layer]

    def prediction(self, layer, index: TokenIndex, first: int, held: NonUniformKV | None) -> tuple:
        """The layer's predictor and its source layer's part, when that part holds the same tokens at slots
        ``first...`` (a part predicts all its tokens or none: its first tokens decide)."""
        if self.predictors[layer.index] is None or (held is not None and held.predictor is None):
            return None, None
        source_layer = source_of(layer)
        found = source_layer.parts_of(NonUniformKV) if source_layer is not None else []
        if found and same_tokens(found[0].index, first, index):
            return self.predictors[layer.index], found[0]
        if held is not None:
            raise CacheUsageError(
                f"{self.name}: layer {layer.index} and the layer below it stopped holding the same tokens, which "
                "their cross-layer prediction needs (were they given different tokens?)"
            )
        return None, None

    def after_attention(self, layer, step) -> None:
        """Quantize as kvquant does, then drop the reconstructions this layer has finished reading: its source
        layer's, and its own unless a later layer reads it."""
        super().after_attention(layer, step)
        source_layer = source_of(layer)
        for below in source_layer.parts_of(NonUniformKV) if source_layer is not None else []:
            below.release()
        if not any(upper.sliding_window is None for upper in layer.siblings[layer.index + 1 :]):
            for part in layer.parts_of(NonUniformKV):
                part.release()


def source_of(layer):
    """The nearest earlier full-attention layer of ``layer``'s cache (None for the first)."""
    below = [other for other in layer.siblings[: layer.index] if other.sliding_window is None]
    return below[-1] if below else None


def same_tokens(source: TokenIndex, first: int, index: TokenIndex) -> bool:
    """True when ``source``'s tokens ``first : first + len(index)`` are ``index``'s (positions and padding)."""
    if first + index.length > source.length:
        return False
    positions, valid = source.span(first, first + index.length)
    mine, my_valid = index.span(0, index.length)
    if positions.shape != mine.shape or not torch.equal(positions, mine):
        return False
    return (valid is None) == (my_valid is None) and (valid is None or torch.equal(valid, my_valid))


def fit_chain(captured: list[dict[str, torch.Tensor]], windows: list[int | None], method: AquaKV, sparse: int,
              value_sparse: int) -> tuple[list, list, list]:  # fmt: skip
    """Per layer, in order: kvquant's codec for the raw vectors, and (for layers with a source) the predictor
    and the codec of its residuals, each fitted on the reconstructed keys of the layers below."""
    bits, sinks, group = method.bits, method.sinks, method.group
    plain, residual, predictors = [], [], []
    below: torch.Tensor | None = None  # the source layer's reconstructed keys
    for layer, window in enumerate(windows):
        raw = codec = predictor = None  # sliding layers stay at full precision
        if window is None:
            raw = fit_layer(captured[layer], bits, sparse, value_sparse, method.outliers, sinks, group)
            used = trimmed(captured[layer], sinks, group)
            if below is None:
                below = decode_keys(encode_keys(used["keys"][None], raw, group), raw)[0]
            else:
                codec, predictor, below = fit_layer_predictor(used, below, method, sparse, value_sparse)
        plain.append(raw)
        residual.append(codec)
        predictors.append(predictor)
    return plain, residual, predictors


def fit_layer_predictor(used: dict[str, torch.Tensor], source_keys: torch.Tensor, method: AquaKV, sparse: int,
                        value_sparse: int) -> tuple[LayerCodec, LayerPredictor, torch.Tensor]:  # fmt: skip
    """One layer's predictor and residual codec from its captured tensors ``used`` and the source layer's
    reconstructed keys ``[S, T, D]``, and this layer's reconstructed keys (what the next layer predicts from)."""
    bits, group = method.bits, method.group
    keys, values = used["keys"], used["values"]
    predictor = LayerPredictor(fit_affine(heads_as_features(source_keys), heads_as_features(keys), method.ridge),
                               torch.empty(0))  # fmt: skip
    predicted = predictor.keys(source_keys[None])[0]
    levels, center, half = fit_keys(keys - predicted, used["key_fisher"], bits, sparse, method.outliers, group)
    codec = LayerCodec(bits, sparse, value_sparse, levels, levels, center, half)  # value levels come below
    keys = predicted + decode_keys(encode_keys((keys - predicted)[None], codec, group), codec)[0]
    inputs = torch.cat([heads_as_features(keys), heads_as_features(source_keys)], dim=1)
    predictor.value_weight = fit_affine(inputs, heads_as_features(values), method.ridge)
    predicted = predictor.values(keys[None], source_keys[None])[0]
    codec.value_levels = fit_values(values - predicted, used["value_fisher"], bits, value_sparse)
    return codec, predictor, keys
