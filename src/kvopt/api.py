"""Building caches from spec strings: the layer above the methods and the storage they act on.

Imports point one way: ``api`` -> ``methods`` -> ``cache``. What a method needs from above
(the local text minikv calibrates on) is handed down here, never imported by the method.
"""

from __future__ import annotations

from collections.abc import Callable

from kvopt.cache import KVCache
from kvopt.guards import install_prompt_guard, validate_cache_arguments
from kvopt.methods import Method


def local_prose() -> str:
    """The best prose on this machine (the evaluation's real text), read only when a method calibrates."""
    from kvopt.eval.tasks.text import real_text

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
