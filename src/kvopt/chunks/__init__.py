"""Position-independent chunk caching: a document's KV computed once, reused wherever it appears in a prompt.

:class:`ChunkStore` keeps chunk KV by content (memory and the KV tiers); :func:`blend` assembles a prompt from
reused chunks and new text with selective recompute (CacheBlend, or EPIC's recompute of each chunk's first
tokens) into an ordinary kvopt cache that ``model.generate`` continues from.
"""

from kvopt.chunks.blend import STRATEGIES, Blended, blend, check_settings
from kvopt.chunks.store import Chunk, ChunkError, ChunkKV, ChunkStore

__all__ = ["STRATEGIES", "Blended", "Chunk", "ChunkError", "ChunkKV", "ChunkStore", "blend", "check_settings"]
