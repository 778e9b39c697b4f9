"""XKV's layer sensitivity (arXiv 2412.05896), measured once per model on local real text and cached.

XKV's code runs a "mini-prefill" (a normal prefill, nothing evicted) and scores every prefix token in every
layer with SnapKV's score: the last ``WINDOW`` = 8 queries' fp32 softmax attention (causal inside the window)
summed over the window, average-pooled with kernel ``KERNEL`` = 7; here the GQA group is reduced by the mean,
as kvopt's SnapKV selects per KV head. Per layer, each KV head's scores are sorted in descending order and
summed by rank over the heads; over the layer's total they are the marginal gains of its 1st, 2nd, ... best
token, and their running sum is the layer's retention curve R_l(f): the share of its attention importance its
best fraction ``f`` of tokens keeps (concave, 0 at 0, 1 at 1). Curves are stored at ``POINTS + 1`` evenly
spaced fractions and read at any prompt length by linear interpolation (:func:`resample`), so one measurement
serves every prompt length and budget (:func:`kvopt.methods.budgets.xkv_budgets`).

Deviations: XKV measures on the first 10% of a task's own prompts and fixes the mean of their allocations for
the task; here the curves are averaged over ``PASSAGES`` passages of ``TOKENS`` tokens of the local prose
(:mod:`kvopt.local_text`), once per model, so the allocation needs no task data and still adapts to each
budget. Sliding-window layers are scored as full-attention layers (the recorded prefill keeps every token).
Cached under ``$KVOPT_CACHE/xkv/`` keyed by the model's path and configuration and these settings, like
kvquant's and minikv's calibrations; measuring takes 32 s for the default model on one CPU thread, beside a server's
decoding step (:meth:`kvopt.engine.LLMEngine.preparation`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from kvopt.cache.kv_cache import recorded_step
from kvopt.errors import MethodParameterError
from kvopt.methods.recording import record_prefill
from kvopt.methods.scores import attention_probs, pool, reduce_group

WINDOW = 8
KERNEL = 7
TOKENS = 2048
PASSAGES = 4
POINTS = 512
#: Bumped when the stored curves change meaning, so older files are measured again.
FORMAT = 1


def resample(curves: torch.Tensor, count: int) -> torch.Tensor:
    """``curves [..., K + 1]`` (values at fractions ``k / K``) read at the fractions ``i / count``, ``i = 0..count``,
    by linear interpolation: ``[..., count + 1]``."""
    steps = curves.shape[-1] - 1
    where = torch.arange(count + 1, dtype=torch.float64, device=curves.device) * steps / count
    low = where.floor().long().clamp(max=steps - 1)
    weight = (where - low).to(curves.dtype)
    return curves[..., low] * (1 - weight) + curves[..., low + 1] * weight


def layer_retention(scores: torch.Tensor) -> torch.Tensor:
    """The retention curve ``[tokens + 1]`` of one layer's prefix scores ``[kv_heads, tokens]``."""
    gains = scores.double().sort(dim=-1, descending=True).values.sum(dim=0)
    curve = torch.cat([gains.new_zeros(1), gains.cumsum(dim=0)])
    return curve / curve[-1].clamp_min(1e-300)


def measure(model, ids: torch.Tensor) -> torch.Tensor:
    """Retention curves ``[layers, POINTS + 1]`` (float64) averaged over the passages ``ids [passages, T]``."""
    if ids.shape[-1] <= 2 * WINDOW:
        raise MethodParameterError(f"xkv calibration needs passages longer than {2 * WINDOW} tokens, got {ids.shape[-1]}")
    curves = []
    for passage in ids:
        cache, _ = record_prefill(model, passage[None], logits_to_keep=1)
        per_layer = []
        for layer in cache.layers:
            probs = attention_probs(layer, recorded_step(layer), last=WINDOW)  # [1, H_kv, g, w, T]
            scores = pool(reduce_group(probs.sum(dim=3))[..., :-WINDOW], KERNEL, "avg")[0]
            per_layer.append(resample(layer_retention(scores), POINTS))
        curves.append(torch.stack(per_layer))
    return torch.stack(curves).mean(dim=0)


def load_or_measure(model, calibration_text: Callable[[], str]) -> torch.Tensor:
    """``model``'s retention curves, from the cache folder or measured now on ``calibration_text()``."""
    from kvopt.models.loading import calibration_path, model_tokenizer

    path = calibration_path("xkv", model, [WINDOW, KERNEL, TOKENS, PASSAGES, POINTS], version=(FORMAT,))
    if path.exists():
        return _load(path)
    tokenizer = model_tokenizer(
        model, "budgets=xkv measures the layer sensitivity on real text and needs the model's tokenizer (load the "
        "model from a folder, or set method.retention = kvopt.methods.xkv_calibration.measure(model, ids))",
    )  # fmt: skip
    length = min(TOKENS, getattr(model.config, "max_position_embeddings", None) or TOKENS)
    ids = tokenizer(calibration_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    passages = min(PASSAGES, ids.numel() // length)
    if passages == 0:
        raise MethodParameterError(f"budgets=xkv: the calibration text has {ids.numel()} tokens, fewer than {length}")
    # The text's end, as kvquant: evaluations that read its beginning (streaming perplexity) are not measured on.
    chosen = ids[ids.numel() - passages * length :].reshape(passages, length)
    retention = measure(model, chosen.to(model.device)).cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"retention": retention, "model": model.name_or_path}, path)
    return _load(path)


@functools.lru_cache(maxsize=8)
def _load(path: Path) -> torch.Tensor:
    """One tensor per file and process, so every cache built for the model shares it (and its allocations)."""
    return torch.load(path, weights_only=True)["retention"]
