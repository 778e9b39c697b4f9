"""Where KV blocks go when they leave the engine's RAM pool: CPU memory, local disk, a Redis shared by replicas.

Every tier stores opaque bytes under string keys behind one small interface (:class:`KVTier`);
:class:`TierChain` walks them in order, promotes what a lower tier finds, and writes new blocks
to all of them from a background thread. Bytes come from :mod:`kvopt.codec` (versioned,
checksummed, fingerprinted), so a tier never needs to trust what it holds: a damaged or foreign
entry fails to decode and is dropped.
"""

from kvopt.tiers.base import KVTier, TierStats
from kvopt.tiers.chain import TierChain
from kvopt.tiers.disk import DiskTier
from kvopt.tiers.memory import MemoryTier
from kvopt.tiers.redis_tier import RedisTier

__all__ = ["DiskTier", "KVTier", "MemoryTier", "RedisTier", "TierChain", "TierStats"]
