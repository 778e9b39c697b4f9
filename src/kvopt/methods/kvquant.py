"""``kvquant``: 2/3/4-bit non-uniform KV quantization with pre-RoPE keys and exact outliers.

KVQuant (Hooper et al., arXiv 2401.18079, NeurIPS'24) removes the known causes of sub-4-bit
failure: keys are quantized **per channel** and **before RoPE** (re-rotated after
dequantization); levels are **non-uniform**, fitted by Fisher-weighted k-means; the ~1%
**outliers** of each vector are stored exactly as sparse fp16 entries; the first tokens
(**attention sinks**) stay at full precision. Values are per token. Storage and attention by
blocks: :mod:`kvopt.cache.nonuniform`; calibration: :mod:`kvopt.methods.nuq_calibration`.

Calibration runs once per model when a cache is built, on the last ``calibration`` tokens of
the text the caller supplies (:func:`kvopt.api.build_cache` gives local prose; its beginning,
which streaming perplexity reads, is not calibrated on), and is stored under
``$KVOPT_CACHE/kvquant/`` keyed by the model, its config and the parameters;
``calibration_seconds`` says how long it took: a first request took 10-87 s for the default model on one
CPU thread, by the machine (a server calibrates beside its decoding step,
:meth:`kvopt.engine.LLMEngine.preparation`). Once ``residual`` tokens are held at full
precision, whole groups of ``group`` tokens (which share per-channel key ranges) are quantized.

Deviations: key ranges are per channel over each ``group`` tokens (KIVI's layout) rather than
calibrated offline, which lost retrieval (see :mod:`kvopt.cache.nonuniform`); the calibrated ranges
pick each key's outliers and give the envelope on which each group's range ends are coded in 8
bits (2 bytes per channel and group). Outliers are the ``ceil(outliers x head_dim)`` largest
normalized entries of each vector (a fixed count, so no index bookkeeping; 1 of 64 channels = 1.6%
at the default) rather than those beyond calibrated thresholds. On the default model, 2-bit keys
and values take 0.186x the fp16 bytes at 4k tokens (0.175x with ``value_outliers=0``; with fp16
range ends the value outliers would not fit 0.19x). The outer levels are pinned to the
range's ends. Q-Norm is not applied. In a left-padded batch the sink block spans the slots of the
most-padded row, so a less-padded row keeps up to that difference in extra tokens at full
precision. RoPE positions follow HF ``generate``'s numbering of left-padded rows (from the first
real token). Sliding-window layers stay at full precision.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvopt.cache.nonuniform import (
    NUQ_BITS,
    DenseBlock,
    LayerCodec,
    NonUniformKV,
    bytes_per_vector,
)
from kvopt.cache.positions import TokenIndex
from kvopt.cache.prerope import RopeError, RopeTable, rope_inv_freq
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import Method, register
from kvopt.methods.nuq_calibration import calibrate, sparse_count
from kvopt.methods.quantization import dense_bytes, position_bytes

#: Version of what calibration computes, part of the saved files' key (a change recalibrates).
CALIBRATION_FORMAT = 5
#: Fewest calibration tokens (the sinks are left out of the statistics).
MIN_CALIBRATION = 64


@register
@dataclass
class KVQuant(Method):
    """Pre-RoPE per-channel keys, per-token values, non-uniform levels, exact outliers, sinks at full precision."""

    name = "kvquant"
    summary = "KVQuant: pre-RoPE keys, non-uniform 2/3/4-bit levels (Fisher k-means), 1% outliers exact, sinks fp"
    budget_convention = "keeps every token; stores older ones in 2-4 bits"
    #: Tokens leaving the residual move out of the dense store (see :func:`kvopt.methods.spec.storage`).
    storage = "quantized"

    bits: int = field(default=2, metadata={"help": "bits per quantized element: 2, 3 or 4"})
    outliers: float = field(default=0.01, metadata={"help": "fraction of each key vector kept exactly (rounded up)"})
    value_outliers: float = field(default=0.01, metadata={"help": "fraction of each value vector kept exactly"})
    sinks: int = field(default=4, metadata={"help": "first real tokens kept at full precision"})
    residual: int = field(default=128, metadata={"help": "full-precision tokens held before quantizing"})
    group: int = field(default=32, metadata={"help": "tokens sharing per-channel key ranges (quantized at a time)"})
    calibration: int = field(default=512, metadata={"help": "tokens of text in the calibration pass"})

    def __post_init__(self) -> None:
        #: Per layer once calibrated (None for sliding layers); see :meth:`fit` and :meth:`prepare`.
        self.codecs: list[LayerCodec | None] | None = None
        self.calibration_seconds: float | None = None
        #: RoPE angle tables by frequencies, shared by the layers and caches this method serves.
        self.rope_tables: dict[tuple[float, ...], RopeTable] = {}
        super().__post_init__()

    def validate(self) -> None:
        if self.bits not in NUQ_BITS:
            raise MethodParameterError(f"{self.name}: bits={self.bits} is not supported; use one of {NUQ_BITS}")
        for name in ("outliers", "value_outliers"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise MethodParameterError(f"{self.name}: {name}={getattr(self, name)} must lie in [0, 1], e.g. 0.01")
        for name in ("sinks", "residual"):
            if getattr(self, name) < 0:
                raise MethodParameterError(f"{self.name}: {name}={getattr(self, name)} must be >= 0")
        if self.group < 1:
            raise MethodParameterError(f"{self.name}: group={self.group} must be a positive integer, e.g. 32")
        if self.calibration < MIN_CALIBRATION + self.sinks:
            raise MethodParameterError(
                f"{self.name}: calibration={self.calibration} must be at least {MIN_CALIBRATION + self.sinks} tokens"
            )

    def check_model(self, model) -> None:
        if model.head_dim % 8:
            raise MethodParameterError(
                f"{self.name}: head_dim={model.head_dim} is not a multiple of 8 (codes are packed 8 at a time)"
            )

    # -- calibration ----------------------------------------------------------------------------
    def fit(self, model, ids: torch.Tensor) -> None:
        """Calibrate on token ids ``[1, T]`` now (what :meth:`prepare` does with the caller's text)."""
        started = time.perf_counter()
        try:
            self.calibrate(model, ids[:, : self.calibration])
        except RopeError as error:
            raise MethodParameterError(f"{self.name} stores pre-RoPE keys, but {error}") from None
        self.calibration_seconds = time.perf_counter() - started

    def calibrate(self, model, ids: torch.Tensor) -> None:
        """Fit the per-model state (:attr:`codecs`) on token ids ``[1, T]``."""
        self.codecs = calibrate(model, ids, self.bits, self.outliers, self.value_outliers, self.sinks, self.group)

    def calibration_state(self) -> dict:
        """What :meth:`calibrate` learned, as plain tensors and lists (saved per model, see :func:`load_or_fit`)."""
        return {"codecs": [None if codec is None else dataclasses.asdict(codec) for codec in self.codecs]}

    def load_calibration(self, state: dict) -> None:
        self.codecs = [None if codec is None else LayerCodec(**codec) for codec in state["codecs"]]

    def prepare(self, model, calibration_text: Callable[[], str]) -> None:
        if self.codecs is None:
            load_or_fit(self, model, calibration_text)

    def model_bytes(self) -> int:
        """Bytes held once per model (levels, key ranges, RoPE angle tables), apart from the per-token bytes."""
        tables = sum(table.nbytes() for table in self.rope_tables.values())
        return tables + sum(codec.nbytes() for codec in self.codecs or [] if codec is not None)

    # -- storage --------------------------------------------------------------------------------
    def read_keys(self, layer, keys: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """Record each row's left padding at the prefill (before any method evicts), for RoPE positions."""
        key = f"{self.name}.offsets"
        if key not in layer.state and layer.seen == len(layer.store):
            layer.state[key] = None if layer.store.all_valid else (~layer.store.valid[:, 0]).sum(dim=-1)
        return keys

    def after_attention(self, layer, step) -> None:
        if layer.sliding_window is not None or any(m.owns_layer(layer.index) for m in layer.methods):
            return
        store, ready = layer.store, max(self.residual, self.group)
        held = layer.parts_of(NonUniformKV)
        if held:
            if len(store) >= ready:
                count = len(store) // self.group * self.group
                held[0].extend(self._encode(layer, step.module, 0, count, held[0]))
                store.drop_oldest(count)
            return
        sink_end = self._sink_end(store)
        if len(store) < sink_end + ready:
            return
        count = (len(store) - sink_end) // self.group * self.group
        part = self._encode(layer, step.module, sink_end, sink_end + count)
        if sink_end:
            index = TokenIndex.of(store.positions[:, :, :sink_end], store.valid[:, :, :sink_end])
            part.sinks = DenseBlock(store.keys[:, :, :sink_end].clone(), store.values[:, :, :sink_end].clone(), index)
        layer.add_part(part)
        store.drop_oldest(sink_end + count)

    def _sink_end(self, store) -> int:
        """Slots holding every row's first ``sinks`` real tokens (per KV head after eviction)."""
        if not self.sinks:
            return 0
        real_before = store.valid.cumsum(dim=-1)
        return min(int((real_before < self.sinks).sum(dim=-1).max()) + 1, len(store))

    def _encode(self, layer, module, start: int, stop: int, held: NonUniformKV | None = None) -> NonUniformKV:
        """The stored tokens ``start:stop`` quantized, to start a part or to extend ``held``."""
        store = layer.store
        self._require_calibration()
        offsets = layer.state.get(f"{self.name}.offsets")
        if offsets is None and not store.all_valid:  # replayed prefill (no read): the padding is still stored
            offsets = (~store.valid[:, 0]).sum(dim=-1)
        index = TokenIndex.of(store.positions[:, :, start:stop], store.valid[:, :, start:stop])
        keys, values = store.keys[:, :, start:stop], store.values[:, :, start:stop]
        first = len(held) if held is not None else 0
        predictor, source = self.prediction(layer, index, first, held)
        codec = self.codec(layer.index, predictor is not None)
        rope = self._rope(layer, module, keys)
        return NonUniformKV.encode(keys, values, index, codec, rope, offsets, self.group, predictor, source, first)

    def prediction(self, layer, index: TokenIndex, first: int, held: NonUniformKV | None) -> tuple:
        """``(predictor, source part)`` for new tokens at slots ``first...`` of ``layer``'s part (none here;
        see :class:`~kvopt.methods.aquakv.AquaKV`)."""
        return None, None

    def codec(self, layer: int, predicted: bool) -> LayerCodec:
        """The layer's codec (for codes that hold raw vectors, or a predictor's residuals)."""
        return self.codecs[layer]

    def _require_calibration(self) -> None:
        if self.codecs is None:
            raise CacheUsageError(
                f"{self.name} is not calibrated: build the cache with kvopt.cache(spec, model), which calibrates on "
                "local text, or call method.fit(model, ids) first"
            )

    def _rope(self, layer, module, keys: torch.Tensor) -> RopeTable:
        """The layer's RoPE angle table, from the config of its attention ``module``; layers with the same
        frequencies share one (see :meth:`model_bytes`)."""
        key = f"{self.name}.rope"
        if key not in layer.state:
            try:
                inv_freq = rope_inv_freq(getattr(module, "config", None), layer.index, keys.shape[-1])
            except RopeError as error:
                raise MethodParameterError(f"{self.name} stores pre-RoPE keys, but {error}") from None
            frequencies = tuple(inv_freq.tolist())
            if frequencies not in self.rope_tables:
                self.rope_tables[frequencies] = RopeTable(inv_freq.to(keys.device))
            layer.state[key] = self.rope_tables[frequencies]
        return layer.state[key]

    # -- theoretical size -----------------------------------------------------------------------
    def layer_bytes(self, kept_tokens: int, model, element_bytes: int, layer) -> int | None:
        """Right after a prefill of ``kept_tokens`` (no padding): sinks and the remainder at full precision,
        whole groups quantized."""
        if any(m.owns_layer(layer.index) for m in layer.methods if m is not self):
            return None
        heads, dim = model.num_kv_heads, model.head_dim
        quantized = sinks = 0
        if kept_tokens >= self.sinks + max(self.residual, self.group):
            sinks = self.sinks  # the sink block exists once quantization has started
            quantized = (kept_tokens - sinks) // self.group * self.group
        key_sparse, value_sparse = sparse_count(self.outliers, dim), sparse_count(self.value_outliers, dim)
        key_bytes, value_bytes = bytes_per_vector(dim, self.bits, key_sparse, value_sparse, self.group)
        packed = round(quantized * heads * (key_bytes + value_bytes))
        if layer.evicted:  # positions are no longer a run: stored per token (per KV head after head-wise eviction)
            packed += position_bytes(quantized + sinks, heads if layer.per_head else 1)
        full = dense_bytes(sinks, heads, dim, element_bytes)
        full += dense_bytes(kept_tokens - quantized - sinks, heads, dim, element_bytes, layer.evicted)
        return full + packed


def load_or_fit(method: KVQuant, model, calibration_text: Callable[[], str]) -> None:
    """Calibrated codecs for ``model``, from the cache folder or computed now on ``calibration_text()``."""
    from kvopt.models.loading import calibration_path, model_tokenizer

    tokenizer = model_tokenizer(
        model, f"{method.name} calibrates on real text and needs the model's tokenizer (load the model from a folder, "
        "or call method.fit(model, ids) with token ids of real text)",
    )  # fmt: skip
    settings = {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.name != "residual"}
    path = calibration_path(method.name, model, [settings], version=(CALIBRATION_FORMAT, method.name))
    if path.exists():
        saved = torch.load(path, weights_only=True, map_location=model.device)  # fitted on another device, maybe
        method.load_calibration(saved["state"])
        method.calibration_seconds = saved["seconds"]
        return
    text = calibration_text()
    # The text's end: evaluations that read its beginning (streaming perplexity) are not calibrated on.
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -method.calibration :]
    method.fit(model, ids.to(model.device))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": method.calibration_state(), "seconds": method.calibration_seconds}, path)
