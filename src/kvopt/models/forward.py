"""Handing a cache to a model on every supported transformers release.

transformers 5.24 renamed the forward (and ``generate``) argument ``past_key_values`` to ``cache``:
the old name still works there with a FutureWarning and goes away in 5.40 (forward) and 6.0
(``generate``), while releases before 5.24 know only the old name. kvopt supports both, so its own
calls name whichever the installed model class takes.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_keyword(model_class: type) -> str:
    """``"cache"`` when ``model_class.forward`` takes it (transformers >= 5.24), else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict[str, object]:
    """Keyword arguments passing ``cache`` to ``model(...)`` or ``model.generate(...)``."""
    return {cache_keyword(type(model)): cache}
