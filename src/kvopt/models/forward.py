"""Calling a model's forward: handing it a cache on every supported transformers release, reading its
final hidden states.

transformers 5.24 renamed the forward (and ``generate``) argument ``past_key_values`` to ``cache``:
the old name still works there with a FutureWarning and goes away in 5.40 (forward) and 6.0
(``generate``), while releases before 5.24 know only the old name. kvopt supports both, so its own
calls name whichever the installed model class takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@functools.cache
def cache_keyword(model_class: type) -> str:
    """``"cache"`` when ``model_class.forward`` takes it (transformers >= 5.24), else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict[str, object]:
    """Keyword arguments passing ``cache`` to ``model(...)`` or ``model.generate(...)``."""
    return {cache_keyword(type(model)): cache}


@contextmanager
def final_states(model) -> Iterator[list]:
    """Collect the decoder's final (normed) hidden states of every forward run inside the block.

    These are what the LM head reads, so a method can score the prompt by the model's own next-token
    predictions without asking the forward for ``[tokens, vocab]`` logits (``logits_to_keep=1`` stays).
    The list stays empty when the decoder has no final ``norm`` module to hook.
    """
    captured: list = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        yield captured
        return
    handle = norm.register_forward_hook(lambda module, args, output: captured.append(output.detach()))
    try:
        yield captured
    finally:
        handle.remove()
