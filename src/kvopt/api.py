"""Models and caches ready for use: the layer above the methods and the storage they act on.

Imports point one way (``tests/test_layering.py``): ``api`` -> ``methods`` -> ``cache`` -> ``models``.
What a lower layer cannot do itself is joined here: a loaded model's attention is routed through the
cache's (``models`` knows no cache), and the local text minikv calibrates on is handed to the method.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kvopt.cache import KVCache
from kvopt.cache.attention import prepare
from kvopt.guards import install_prompt_guard, validate_cache_arguments
from kvopt.local_text import real_text
from kvopt.methods import Method
from kvopt.models.loading import load_pretrained


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype | str | None = None, device=None,
    weights: str | None = None,
):  # fmt: skip
    """Load ``(model, tokenizer)`` with its attention routed through kvopt's, ready for kvopt caches.

    ``name_or_path``: None for the embedded default model, a local HF folder, or a .gguf file.
    ``dtype``: torch dtype or name (``fp32``, ``bf16``), or ``auto``: bf16 on a CPU with bf16 arithmetic, fp32 on
    other CPUs, the checkpoint's on an accelerator; default is the checkpoint's own dtype.
    ``device``: where the model runs (a name, ``auto`` for a CUDA GPU when there is one); default the CPU.
    ``weights``: ``auto`` (default: in ``dtype``), ``fp32``, ``bf16``, or ``int8``: every linear layer's weights in
    int8 with one scale per output channel, computed in ``dtype`` (default ``auto``), on a CPU
    (:mod:`kvopt.models.int8_linear`): half the bytes a decode step reads, a small loss of accuracy.

    The model comes frozen, as HF's pipelines and vLLM give one: eval mode and no parameter requiring a gradient, so
    ``model(ids, past_key_values=...)`` outside ``torch.no_grad()`` keeps no autograd state (a 3,000-token prompt
    on the default model peaked at 5.5 GB with it, 1.8 GB without). To fine-tune, call ``model.requires_grad_()``.
    """
    model, tokenizer = load_pretrained(name_or_path, dtype, device, weights)
    prepare(model)
    return model, tokenizer


def local_prose() -> str:
    """The best prose on this machine (the evaluation's real text), read only when a method calibrates."""
    return real_text()[0]


def build_cache(spec: str | list[Method], model, calibration_text: Callable[[], str] = local_prose) -> KVCache:
    """Create a cache for ``model`` following ``spec`` (e.g. ``"full"`` or ``"window:size=1024"``).

    ``calibration_text`` supplies the text methods that calibrate on ``model`` read (minikv).
    """
    methods = validate_cache_arguments(spec, model)
    cache = KVCache.for_model(methods, model)
    install_prompt_guard(model)
    for method in methods:
        method.prepare(model, calibration_text)
    return cache
