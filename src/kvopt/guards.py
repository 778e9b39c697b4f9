"""Checks at the API's entry points: a wrong argument or a misused cache is one KVOptError naming the fix.

Without them, ``kvopt.cache(spec, None)`` fails deep in attribute lookups and a compressed
cache handed a new prompt silently continues the old context (whose evicted tokens it no longer
holds). (A cache used with another model is refused by :meth:`ModelInfo.check_keys`.)
"""

from __future__ import annotations

import torch

from kvopt.cache import KVCache
from kvopt.errors import CacheUsageError
from kvopt.methods import Method, parse
from kvopt.methods.spec import check_composition

CALL = "kvopt.cache(spec, model)"
#: Set on a model once :func:`refuse_restarted_prompt` is registered on it.
GUARDED = "_kvopt_prompt_guard"


def validate_cache_arguments(spec: object, model: object) -> list[Method]:
    """The methods of ``spec`` (a spec string or a list of methods) for ``model``, checked as a composition."""
    if model is None or not callable(model) or not hasattr(getattr(model, "config", None), "num_hidden_layers"):
        raise CacheUsageError(
            f"{CALL} needs a loaded transformers causal LM as `model`, got {_describe(model)}; "
            "load one with kvopt.load_model() or transformers' AutoModelForCausalLM"
        )
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(method, Method) for method in spec):
        methods = list(spec)
        check_composition(methods)
        return methods
    return parse(spec)  # a string, or the error naming what was passed instead


def _describe(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def check_prompt_continues(cache: KVCache, position_ids: torch.Tensor | None, batch: int) -> None:
    """Refuse new tokens that restart the sequence of a cache that has already evicted some of it.

    A forward continues a cache when each row's new tokens start at the count of real tokens that
    row has seen (its RoPE position), so the rows' first positions add up to the real tokens seen.
    Handed a new prompt, ``model.generate`` feeds its tail at the new prompt's own positions, which
    start before that: HF's ``DynamicCache`` (and kvopt's lossless ``full``) then attend over the old
    context plus the new tail, and so does a cache that evicted, but it answers from a context it
    no longer holds. Such a cache refuses. (A new prompt longer than what the cache has seen
    starts at its end and cannot be told apart from a continuation.)
    """
    if position_ids is None or cache.get_seq_length() == 0:
        return
    first = position_ids[..., 0].reshape(-1)  # [batch], [1] when shared by the rows, [3 * batch] for 3-D RoPE
    started = int(first.sum()) * batch if first.numel() == 1 else int(first[:batch].sum())
    if started >= batch * cache.get_seq_length():
        return  # every row starts at or after the sequence length: nothing restarted (the common case)
    stats = cache.stats()
    if started >= stats[0].seen:
        return  # padded rows start at their own real count
    full_attention = [s for s, layer in zip(stats, cache.layers) if not getattr(layer, "is_sliding", False)]
    if all(s.kept == s.seen for s in full_attention):
        return  # nothing evicted yet: the lossless semantics of HF's DynamicCache
    raise CacheUsageError(
        f"this {cache.spec} cache has compressed a sequence of {cache.get_seq_length()} tokens, and the new "
        f"tokens start at position {int(first.max())}, before its end: a new prompt, not a continuation of "
        f"what it holds; create a new cache for each prompt with {CALL}"
    )


def install_prompt_guard(model: torch.nn.Module) -> None:
    """Register :func:`refuse_restarted_prompt` on ``model``, once however often it is called."""
    if not getattr(model, GUARDED, False):
        model.register_forward_pre_hook(refuse_restarted_prompt, with_kwargs=True)
        setattr(model, GUARDED, True)


def refuse_restarted_prompt(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook applying :func:`check_prompt_continues` to a kvopt cache passed to the model.

    transformers 5.24 renamed the forward argument ``past_key_values`` to ``cache`` (``generate`` passes
    the new name); both are read so the guard holds on every supported version.
    """
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    inputs = kwargs.get("input_ids")
    inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
    if isinstance(cache, KVCache) and inputs is not None:
        check_prompt_continues(cache, kwargs.get("position_ids"), inputs.shape[0])
