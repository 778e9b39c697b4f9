"""Offline calibration of non-uniform quantizers (KVQuant, arXiv 2401.18079, sections 3.1 and 3.3).

One forward and backward pass of the model over a short real text gives, per layer, the
pre-RoPE keys and the values (captured at the projections by forward hooks, calibration only)
and the gradient of the language-model loss with respect to each of them. Their squares are
the diagonal Fisher information, KVQuant's sensitivity weights. Per full-attention layer:

* key ranges per KV head and channel: the ``outliers / 2`` and ``1 - outliers / 2`` quantiles over
  the tokens (the first ``sinks`` tokens, kept at full precision at run time, left out), against
  which each key vector's outliers are found;
* levels: 1-D k-means of the normalized entries (outliers excluded, clamped to ``[-1, 1]``),
  each weighted by its Fisher information, for keys and for values separately, with the range's
  ends kept as levels (see :func:`weighted_kmeans`).

AQUA-KV (:mod:`kvopt.methods.aquakv`) fits the same quantizers to the residuals its predictors leave.
"""

from __future__ import annotations

import math

import torch

from kvopt.cache.nonuniform import LayerCodec, nearest_level, normalize_keys, normalized, value_ranges
from kvopt.cache.prerope import RopeTable, rope_inv_freq, to_pairs
from kvopt.models.info import ModelInfo

KMEANS_ITERATIONS = 40


def sparse_count(outliers: float, dim: int) -> int:
    """Outlier channels kept exactly per vector: the fraction ``outliers`` of ``dim``, rounded up."""
    return min(dim, math.ceil(outliers * dim - 1e-9)) if outliers > 0 else 0


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules in layer order (those with ``k_proj``, ``v_proj`` and ``layer_idx``)."""
    found = [m for m in model.modules() if all(hasattr(m, a) for a in ("k_proj", "v_proj", "layer_idx"))]
    return sorted(found, key=lambda m: m.layer_idx)


def capture(model, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: pre-RoPE ``keys`` (in pair order, :func:`~kvopt.cache.prerope.to_pairs`) and ``values`` ``[H, T, D]``
    (fp32, keys times RoPE's attention scaling like the stored keys) with the squared loss gradients
    ``key_fisher`` / ``value_fisher`` of one sequence ``ids [1, T]``."""
    info = ModelInfo.from_config(model.config)
    leaves: dict[tuple[int, str], torch.Tensor] = {}

    def keep(layer: int, name: str):
        def hook(module, inputs, output):
            leaves[(layer, name)] = leaf = output.detach().requires_grad_()
            return leaf  # the rest of the model reads the leaf, so its gradient is the output's

        return hook

    handles = []
    for module in attention_modules(model):
        key_source = getattr(module, "k_norm", None) or module.k_proj  # pre-RoPE keys are after any key norm
        handles.append(key_source.register_forward_hook(keep(module.layer_idx, "keys")))
        handles.append(module.v_proj.register_forward_hook(keep(module.layer_idx, "values")))
    try:
        with torch.inference_mode(False), torch.enable_grad():  # caches may be built inside inference mode
            ids = ids.clone()  # a normal tensor, usable by autograd
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            names = sorted(leaves)
            grads = torch.autograd.grad(loss, [leaves[name] for name in names])
    finally:
        for handle in handles:
            handle.remove()
    scaling = next((float(m.attention_scaling) for m in model.modules() if hasattr(m, "attention_scaling")), 1.0)
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(info.num_layers)]
    as_heads = lambda t: t.detach().float().reshape(t.shape[0], t.shape[1], info.num_kv_heads, -1)[0].transpose(0, 1)
    for (layer, name), grad in zip(names, grads):
        tensor, fisher = as_heads(leaves[(layer, name)]), as_heads(grad).square()
        if name == "keys":  # in the pair order the stores keep pre-RoPE keys in
            table = RopeTable(rope_inv_freq(model.config, layer, info.head_dim))
            tensor, fisher = to_pairs(tensor * scaling, table), to_pairs(fisher, table)
        layers[layer][name], layers[layer][name.rstrip("s") + "_fisher"] = tensor, fisher
    return layers


def weighted_kmeans(samples: torch.Tensor, weights: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` sorted 1-D centroids in ``[-1, 1]`` minimizing the ``weights``-weighted squared error (Lloyd's),
    the outer two pinned at -1 and 1.

    Ranges are each group's min and max, so both ends are always real entries; fitting them too
    pulls them inward where the Fisher mass is, which cost retrieval on the default model (2-bit
    keys, passkey/niah at 1k: 23% of prompts right with free ends, 58% with uniform levels)."""
    levels = torch.linspace(-1.0, 1.0, count, device=samples.device)
    weights = weights + weights.mean() * 1e-3 + 1e-30  # every sample counts a little (zero-gradient layers)
    for _ in range(KMEANS_ITERATIONS):
        assign = nearest_level(samples, levels)
        total = torch.zeros(count, dtype=torch.float64, device=samples.device).index_add_(0, assign, weights.double())
        moment = torch.zeros(count, dtype=torch.float64, device=samples.device).index_add_(0, assign, (weights * samples).double())
        levels = torch.where(total > 0, moment / total.clamp_min(1e-300), levels.double()).float().sort().values
        levels[0], levels[-1] = -1.0, 1.0  # the range's ends are real entries of every group: keep them exact
    return levels


def fit_keys(keys: torch.Tensor, fisher: torch.Tensor, bits: int, sparse: int, outliers: float,
             group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Key levels and calibrated per-channel ranges ``(levels, center [H, D], half [H, D])`` from pre-RoPE keys
    ``[H, T, D]`` (``T`` a multiple of ``group``) and their Fisher weights."""
    quantiles = torch.tensor([outliers / 2, 1 - outliers / 2], dtype=keys.dtype, device=keys.device)
    low, high = torch.quantile(keys.transpose(1, 2), quantiles, dim=-1)  # each [H, D]
    center, half = (high + low) / 2, ((high - low) / 2).clamp_min(1e-6)
    provisional = LayerCodec(bits, sparse, 0, torch.empty(0), torch.empty(0), center, half)  # ranges only
    stored, scaled = normalize_keys(keys[None], provisional, group)
    return _levels(scaled[0], stored.sparse_index[0], fisher, bits), center, half


def fit_values(values: torch.Tensor, fisher: torch.Tensor, bits: int, sparse: int) -> torch.Tensor:
    """Value levels from values ``[H, T, D]`` and their Fisher weights."""
    index, lower, upper = value_ranges(values, sparse)
    return _levels(normalized(values, lower, upper), index, fisher, bits)


def trimmed(captured: dict[str, torch.Tensor], sinks: int, group: int) -> dict[str, torch.Tensor]:
    """The captured tensors without the first ``sinks`` tokens (kept at full precision at run time), cut to
    whole groups of ``group`` tokens."""
    tokens = (captured["keys"].shape[1] - sinks) // group * group
    return {name: tensor[:, sinks : sinks + tokens] for name, tensor in captured.items()}


def fit_layer(captured: dict[str, torch.Tensor], bits: int, sparse: int, value_sparse: int, outliers: float,
              sinks: int, group: int) -> LayerCodec:  # fmt: skip
    """One layer's :class:`LayerCodec` from its captured keys, values and Fisher weights."""
    used = trimmed(captured, sinks, group)
    key_levels, center, half = fit_keys(used["keys"], used["key_fisher"], bits, sparse, outliers, group)
    value_levels = fit_values(used["values"], used["value_fisher"], bits, value_sparse)
    return LayerCodec(bits, sparse, value_sparse, key_levels, value_levels, center, half)


def _levels(normalized: torch.Tensor, outlier_index: torch.Tensor, fisher: torch.Tensor, bits: int) -> torch.Tensor:
    """Fisher-weighted k-means levels of the entries that are not outliers."""
    outlier = torch.zeros_like(normalized, dtype=torch.bool).scatter_(-1, outlier_index.long(), True)
    return weighted_kmeans(normalized[~outlier].clamp(-1, 1), fisher[~outlier], 1 << bits)


def calibrate(model, ids: torch.Tensor, bits: int, outliers: float, value_outliers: float, sinks: int,
              group: int) -> list[LayerCodec | None]:  # fmt: skip
    """A :class:`LayerCodec` per layer (None for sliding-window layers, which stay at full precision)."""
    info = ModelInfo.from_config(model.config)
    sparse, value_sparse = sparse_count(outliers, info.head_dim), sparse_count(value_outliers, info.head_dim)
    captured = capture(model, ids)
    return [
        None if window is not None else fit_layer(captured[layer], bits, sparse, value_sparse, outliers, sinks, group)
        for layer, window in enumerate(info.sliding_windows)
    ]
