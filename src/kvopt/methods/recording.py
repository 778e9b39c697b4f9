"""Recording one lossless prefill that other caches replay (:meth:`KVCache.replay_prefill`).

Methods act after attention, so a prefill's outputs never depend on them: one recorded forward
pass serves every method compared on a prompt (the evaluation grid, minikv's calibration).
The recorder is a method that keeps each layer's prefill step (its queries), unregistered: it
is no compression a spec can name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.cache.kv_cache import RECORDED_PREFILL, KVCache
from kvopt.methods.base import Method
from kvopt.models.forward import cache_kwargs, final_states


@dataclass
class _RecordPrefill(Method):
    """Keeps each layer's prefill step (its queries) so other caches can replay the prefill."""

    def after_attention(self, layer, step) -> None:
        if step.is_prefill:
            layer.state[RECORDED_PREFILL] = step


def record_prefill(model, input_ids, attention_mask=None, **forward_kwargs) -> tuple[KVCache, object]:
    """Prefill a lossless cache in one forward pass, recording what methods need to replay it.

    Returns ``(cache, model output)``; pass the cache to :meth:`KVCache.replay_prefill`.
    ``forward_kwargs`` go to the forward call (e.g. ``position_ids``, ``logits_to_keep``).
    Recording keeps every layer's queries (as large as the keys held) and the prompt's final hidden
    states (``cache.prompt_states``, for methods that read the model's predictions of the prompt).
    """
    cache = KVCache.for_model([_RecordPrefill()], model)
    for layer in cache.layers:
        # Keep what a sliding layer would forget: a direct prefill runs its methods before
        # forgetting, and so does the replay. (The model still masks by the window.)
        layer.sliding_window = None
    with torch.no_grad(), final_states(model) as states:
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(model, cache), use_cache=True, **forward_kwargs
        )
    cache.prompt_states = states[-1] if states else None
    return cache, output
