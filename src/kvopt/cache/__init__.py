"""Cache storage, the attention seam and the user-facing :class:`KVCache`."""

from kvopt.cache.kv_cache import KVCache, LayerStats

__all__ = ["KVCache", "LayerStats"]
