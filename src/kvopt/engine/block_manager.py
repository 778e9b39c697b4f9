"""Which pool blocks hold which sequence's tokens: ref counts, an LRU free queue, prefix caching.

Bookkeeping only (no tensors): the model runner writes and reads the blocks this hands out.
A block is ``block_size`` token slots in every layer of the pool. Prefix caching follows
vLLM: each *full* block is named by a chained hash (its parent's hash, its token ids, and a
salt naming the model and the KV method, so a compressed cache never serves a lossless
request); a later sequence whose tokens hash the same reuses the block instead of computing
it. Freed blocks keep their hash and stay findable until they are actually reused for other
tokens, oldest-freed first (LRU); the free queue is an ``OrderedDict``, so taking a cached
block back out of it is O(1), unlike nano-vllm's ``deque.remove``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvopt.engine.kv.base import cut_table
from kvopt.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    #: Chained hash of the block's full contents (None until it is full and computed).
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    #: Tokens looked up in the prefix cache (prompts at their first admission) and tokens found.
    queries: int = 0
    hits: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: str = "", enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.root_hash = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self.prefix_stats = PrefixCacheStats()
        #: Copy-on-write copies ``(source block, destination block)`` the runner must make before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain_hash(self, parent: bytes, token_ids: tuple[int, ...]) -> bytes:
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
        return digest.digest()

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of ``seq``'s full blocks that a prefix hit may cover: at most ``(len(seq) - 1) //
        block_size`` of them, since the last token is always computed (its step needs logits to sample from)."""
        return self.hashes_of(seq.token_ids, (len(seq) - 1) // self.block_size)

    def hashes_of(self, token_ids: list[int], blocks: int) -> list[bytes]:
        """Chained hashes of the first ``blocks`` full blocks of ``token_ids``."""
        hashes, parent = [], self.root_hash
        for start in range(0, blocks * self.block_size, self.block_size):
            parent = self.chain_hash(parent, tuple(token_ids[start : start + self.block_size]))
            hashes.append(parent)
        return hashes

    def cached_prefix(self, seq: Sequence, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq`` (``hashes`` from :meth:`prompt_hashes`),
        verified token by token."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for index, digest in enumerate(hashes):
            block_id = self.hash_to_block_id.get(digest)
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more computed tokens (after ``cached`` prefix blocks).

        All or nothing: returns False, changing nothing, when the free blocks do not suffice.
        Writing into a block other sequences share first copies it (copy-on-write). New blocks
        continue the sequence's last one where it is free, so its tokens stay in few runs of
        consecutive slots, which attention reads in place.
        """
        cached = cached or []
        stored = seq.num_stored_tokens + len(cached) * self.block_size
        have = len(seq.block_table) + len(cached)
        fresh = max(self.blocks_needed(seq.slots_needed(num_new_tokens) + len(cached) * self.block_size) - have, 0)
        copy_on_write = self._shared_tail(seq, stored) is not None
        revived = sum(1 for block_id in cached if self.blocks[block_id].ref_count == 0)
        if fresh + copy_on_write + revived > len(self.free_queue):
            return False
        for block_id in cached:
            self._acquire(block_id)
            seq.block_table.append(block_id)
        if cached:  # only lossless sequences use the prefix cache: stored tokens are computed tokens
            seq.num_computed_tokens = stored
        if copy_on_write:
            self._copy_on_write(seq, stored)
        for _ in range(fresh):
            seq.block_table.append(self._take_free_block(seq.block_table[-1] + 1 if seq.block_table else None))
        return True

    def take_blocks(self, count: int) -> list[int] | None:
        """``count`` fresh blocks (a swapped-out sequence coming back), or None, taking none, when too few are free."""
        if count > len(self.free_queue):
            return None
        block_ids: list[int] = []
        for _ in range(count):
            block_ids.append(self._take_free_block(block_ids[-1] + 1 if block_ids else None))
        return block_ids

    def _shared_tail(self, seq: Sequence, stored: int) -> int | None:
        """Index in ``seq.block_table`` of the partly filled block the next token goes into, if shared."""
        index = stored // self.block_size
        if stored % self.block_size == 0 or index >= len(seq.block_table):
            return None
        return index if self.blocks[seq.block_table[index]].ref_count > 1 else None

    def _copy_on_write(self, seq: Sequence, stored: int) -> None:
        index = self._shared_tail(seq, stored)
        source = seq.block_table[index]
        destination = self._take_free_block()
        self.blocks[source].ref_count -= 1
        seq.block_table[index] = destination
        self.pending_copies.append((source, destination))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (its block table a copy of the parent's) shares the blocks holding ``parent``'s computed tokens;
        a block past them (room for the next token) stays the parent's, as writing into it copies nothing first."""
        assert child.block_table == parent.block_table
        del child.block_table[self.blocks_needed(parent.num_computed_tokens) :]
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; the ones no sequence holds join the free queue, newest tokens first
        (so the shareable beginnings of prompts stay cached longest)."""
        self.release(reversed(seq.block_table + seq.code_table))
        seq.block_table.clear()
        seq.code_table.clear()
        seq.num_computed_tokens = 0

    def release_surplus(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks beyond those ``num_tokens`` tokens fill (they held rejected drafts)."""
        self.release(cut_table(seq.block_table, self.blocks_needed(num_tokens)))

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; those no sequence holds join the free queue (in this order)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name every full, computed block of ``seq`` by its chained hash, so later prompts can reuse it."""
        if not self.enable_prefix_caching:
            return
        parent = self.root_hash
        for index in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                parent = block.hash
                continue
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = self.chain_hash(parent, tokens)
            block.hash, block.token_ids = parent, tokens
            self.hash_to_block_id.setdefault(parent, block.block_id)

    def restore_block(self, digest: bytes, token_ids: tuple[int, ...]) -> int:
        """A free block renamed ``digest`` (its contents come from a KV tier): cached and free, most recently
        freed, as if a finished request had just left it. The least recently freed block is given up for it."""
        block_id = self._take_free_block()
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.ref_count = digest, token_ids, 0
        self.hash_to_block_id[digest] = block_id
        self.free_queue[block_id] = None
        return block_id

    def forget_cached_blocks(self) -> None:
        """Unname every free block and zero the lookup counts: what ran so far (the engine's warm-up request) leaves
        no prefix for a later prompt to find, and no count."""
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()
        self.prefix_stats = PrefixCacheStats()

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prefix_stats.queries += prompt_tokens
        self.prefix_stats.hits += hit_tokens

    # -- internals ------------------------------------------------------------------------
    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_free_block(self, preferred: int | None = None) -> int:
        """``preferred`` if it is free and caches nothing, else the least recently freed block; its old
        contents (and hash) are forgotten."""
        if preferred in self.free_queue and self.blocks[preferred].hash is None:
            del self.free_queue[preferred]
            block_id = preferred
        else:
            block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id
