"""The HF cache-layer protocol shared by kvopt's layers: ``update`` parks, kvopt attention stores.

Both the per-sequence :class:`~kvopt.cache.layer.KVLayer` and the engine's
:class:`~kvopt.engine.kv.paged.PagedLayer` store nothing in ``update``: they hand the new
keys/values back to the model and wait for kvopt's attention call on them
(:mod:`kvopt.cache.attention`), which knows the padding bits and the queries.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvopt.cache import attention
from kvopt.errors import CacheUsageError


class SeamLayer(CacheLayerMixin):
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        #: Sequence indices consumed so far (what HF expects from ``get_seq_length``).
        self.seen = 0
        self._parked: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._parked is not None:
            raise CacheUsageError(
                "a kvopt cache was updated twice without kvopt attention running in between; "
                "the model must use attn_implementation='kvopt': call kvopt.prepare(model)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._parked = value_states
        attention.park(self, key_states)
        return key_states, value_states

    def take_parked(self, value: torch.Tensor) -> None:
        """Called by the attention: ``value`` must be what this layer handed out in ``update``."""
        if value is not self._parked:
            raise CacheUsageError("kvopt attention received values that this cache layer did not hand out")
        self._parked = None

    def drop_parked(self) -> None:
        """Forget keys parked by an ``update`` whose attention call never came (a forward that failed)."""
        self._parked = None

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        query_length = args[0] if args and isinstance(args[0], int) else kwargs.get("query_length", 0)
        if isinstance(query_length, torch.Tensor):  # transformers < 5.x passed cache_position
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.3
        return -1

    def reset(self) -> None:
        self.seen = 0
        self._parked = None
