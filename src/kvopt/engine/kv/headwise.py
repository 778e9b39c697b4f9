"""Compressed sequences whose layers or KV heads keep different numbers of tokens (pyramidkv, adakv).

The uniform layout of :mod:`kvopt.engine.kv.compressed` (stored token ``j`` at slot ``j`` in
every layer and head) does not fit budgets that differ by layer or by head: sized by the
largest layer or head, it would hold the very memory those methods free. Here a sequence's
blocks are cut into **head blocks**: ``block_size`` slots of one KV head in one layer's pool,
``layers x kv_heads`` of them per block. Every (layer, head) of the sequence fills head blocks
of its own, taken from any of its blocks and any layer's pool (the pool is one tensor, so one
``index_select`` gathers a layer's tokens wherever they lie). A sequence then holds its total
kept tokens' worth of blocks plus at most one partly filled head block per (layer, head),
however unevenly its methods spread the budget.

Each step, each layer's tokens are gathered into a one-sequence
:class:`~kvopt.cache.layer.KVLayer` (a ragged part for a head-wise prefix, a dense store for the
rest) that runs exactly as in ``model.generate``: it stores the step's new tokens, attends, and
lets the methods act. What changed is written back: only the new tokens, unless a method
evicted or re-packed. The gather copies the kept tokens once per layer and step, where the
uniform layout reads them in place; this is the price of budgets that differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvopt.cache import attention
from kvopt.cache.layer import KVLayer
from kvopt.engine.kv.base import table_fill
from kvopt.engine.kv.compressed import kept_after_prefill
from kvopt.cache.ragged import RaggedKV
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError


class HeadBlocks:
    """The head blocks of one sequence's blocks: which are free, taken in block-table order.

    A head block is named ``block_id * per_block + within``; ``within`` is its (pool layer, KV
    head row) pair flattened, so its first slot in the pool flattened to ``[layers * kv_heads *
    slots, dim]`` is ``within * slots + block_id * block_size``.
    """

    def __init__(self, per_block: int) -> None:
        self.per_block = per_block
        self.order: list[int] = []
        self.free: dict[int, list[int]] = {}

    def sync(self, block_table: list[int]) -> None:
        """Adopt blocks the engine added to the table (all their head blocks free)."""
        for block_id in block_table:
            if block_id not in self.free:
                self.order.append(block_id)
                self.free[block_id] = list(range(self.per_block - 1, -1, -1))

    def take(self) -> int:
        for block_id in self.order:
            free = self.free[block_id]
            if free:
                return block_id * self.per_block + free.pop()
        raise CacheUsageError("a compressed sequence ran out of head blocks in its blocks; this is a kvopt bug")

    def give(self, head_block: int) -> None:
        block_id, within = divmod(head_block, self.per_block)
        self.free[block_id].append(within)

    def release_empty(self) -> tuple[list[int], list[int]]:
        """``(blocks still holding tokens, blocks now empty)``; the empty ones are forgotten."""
        kept = [block_id for block_id in self.order if len(self.free[block_id]) < self.per_block]
        empty = [block_id for block_id in self.order if len(self.free[block_id]) == self.per_block]
        for block_id in empty:
            del self.free[block_id]
        self.order = kept
        return kept, empty


@dataclass
class HeadwiseMemo:
    """One layer of one sequence between steps: where each head's tokens are and what methods keep."""

    #: Head blocks of each KV head, in token order.
    head_blocks: list[list[int]]
    #: A head-wise prefix (``RaggedKV``'s positions and offsets; keys/values are in the pool), or None.
    prefix_positions: torch.Tensor | None = None
    prefix_offsets: torch.Tensor | None = None
    #: Pool rows of the prefix's tokens ``[prefix tokens]`` and of the dense tail's ``[kv_heads, tail]``.
    prefix_rows: torch.Tensor | None = None
    tail_rows: torch.Tensor | None = None
    #: The dense tail's store state (as :class:`~kvopt.engine.kv.compressed.LayerMemo`).
    tail_positions: torch.Tensor | None = None
    first_position: int = 0
    heads_aligned: bool = True
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, object] = field(default_factory=dict)

    def counts(self) -> list[int]:
        """Tokens held per KV head."""
        tail = 0 if self.tail_rows is None else self.tail_rows.shape[1]
        heads = len(self.head_blocks)
        if self.prefix_offsets is None:
            return [tail] * heads
        return [int(n) + tail for n in (self.prefix_offsets[1:] - self.prefix_offsets[:-1]).tolist()]


@dataclass
class HeadwiseStep:
    """One such sequence in the step (part of the per-step context)."""

    kv: HeadwiseKV
    #: Its query rows ``first:end`` of the flattened batch; tokens computed before this step.
    first: int
    end: int
    computed: int
    block_table: list[int]

    def attend(self, index: int, module, query, key, value, scaling, sliding_window, softcap) -> torch.Tensor:
        return self.kv.attend(index, module, self, query, key, value, scaling, sliding_window, softcap)


class HeadwiseKV:
    """One sequence's cache in head blocks: per-layer memos and this step's block table."""

    shares_blocks: ClassVar[bool] = False
    keeps_prompt_state: ClassVar[bool] = False  # its head blocks' layout is not a tier entry (yet)

    def __init__(self, methods: list, pool) -> None:
        self.methods = methods
        self.pool = pool
        self.num_layers, self.kv_heads = len(pool.keys), pool.keys[0].shape[0]
        self.block_size, self.slots, self.device = pool.block_size, pool.keys[0].shape[1], pool.keys[0].device
        self.reset()

    def reset(self) -> None:
        """Forget everything (the sequence is recomputed from its tokens)."""
        self.blocks = HeadBlocks(self.num_layers * self.kv_heads)
        self.memos = [HeadwiseMemo([[] for _ in range(self.kv_heads)]) for _ in range(self.num_layers)]

    # -- accounting for the scheduler --------------------------------------------------------
    def stored_tokens(self, computed: int) -> int:
        """Tokens held, averaged over (layer, head) pairs and rounded up (what the blocks' slots are filled with)."""
        total = sum(sum(memo.counts()) for memo in self.memos)
        return -(-total // (self.num_layers * self.kv_heads))

    def held_blocks(self, seq, block_size: int) -> list[int]:
        return list(seq.block_table)

    def reserve_tokens(self, tokens: int) -> int:
        """Slots to give a prompt of ``tokens``: the methods' average keep, one block for the partly
        filled head blocks and one for rounding in head-wise shares (unused ones return after the prefill)."""
        kept = kept_after_prefill(self.methods, tokens)
        return (-(-kept // self.block_size) + 2) * self.block_size

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        """Slots the block table needs for ``new_tokens`` more tokens in every (layer, head)."""
        used = growth = 0
        for memo in self.memos:
            for head_blocks, count in zip(memo.head_blocks, memo.counts()):
                used += len(head_blocks)
                growth += max(0, -(-(count + new_tokens) // self.block_size) - len(head_blocks))
        return -(-(used + growth) // self.blocks.per_block) * self.block_size

    def filled_slots(self, seq, block_size: int) -> dict[int, int]:
        return table_fill(seq.block_table, self.stored_tokens(0), block_size)

    def relocate(self, moved: dict[int, int]) -> None:
        """Follow blocks swapped back in at new ids (``moved``: old id -> new id): head block names and pool rows."""
        per_block = self.blocks.per_block
        self.blocks.order = [moved[block_id] for block_id in self.blocks.order]
        self.blocks.free = {moved[block_id]: free for block_id, free in self.blocks.free.items()}
        for memo in self.memos:
            memo.head_blocks = [[moved[hb // per_block] * per_block + hb % per_block for hb in head_blocks]
                                for head_blocks in memo.head_blocks]  # fmt: skip
            prefix = [0] * self.kv_heads if memo.prefix_offsets is None else (memo.prefix_offsets.diff()).tolist()
            tail = 0 if memo.tail_rows is None else memo.tail_rows.shape[1]
            if memo.prefix_rows is not None:
                memo.prefix_rows = torch.cat([self._rows(hbs, 0, n) for hbs, n in zip(memo.head_blocks, prefix)])
            if memo.tail_rows is not None:
                memo.tail_rows = torch.stack([self._rows(hbs, n, n + tail) for hbs, n in zip(memo.head_blocks, prefix)])

    def nbytes(self, seq, block_bytes: int) -> int:
        return len(self.blocks.order) * block_bytes

    # -- one layer of one step ------------------------------------------------------------------
    def attend(self, index, module, step: HeadwiseStep, query, key, value, scaling, sliding_window, softcap):
        """Layer ``index`` of this sequence, as ``KVLayer.attend`` runs it in ``generate``: store the new
        ``key/value [1, H, new, D]``, attend ``query``, let the methods act; returns ``[1, new, heads, D]``."""
        if index == 0:
            self.blocks.sync(step.block_table)
        memo = self.memos[index]
        layer, prefix, tail_keys = self._layer(index, memo, step.computed, key.shape[2])
        layer.update(key, value, index)
        attention.claim(key)  # the seam's update-then-attend, run here by hand
        output = layer.attend(module, query, key, value, None, scaling, sliding_window, softcap)
        self._write_back(memo, layer, prefix, tail_keys, key.shape[2])
        return output

    def _layer(self, index, memo: HeadwiseMemo, computed: int, new: int):
        """A one-sequence ``KVLayer`` over this layer's tokens gathered from the pool, with room for ``new`` more."""
        layer = KVLayer(self.methods)
        layer.index, layer.seen, layer.seen_real, layer.state = index, computed, computed, memo.state
        prefix = tail_keys = None
        flat_keys, flat_values = self.pool.flat_keys, self.pool.flat_values
        if memo.prefix_rows is not None:
            prefix = RaggedKV(flat_keys.index_select(0, memo.prefix_rows), flat_values.index_select(0, memo.prefix_rows),
                              memo.prefix_positions, memo.prefix_offsets, 1, self.kv_heads)  # fmt: skip
            layer.parts = [prefix]
        if memo.tail_rows is not None:
            heads, tail = memo.tail_rows.shape
            tail_keys = _gather_with_room(flat_keys, memo.tail_rows, new)
            tail_values = _gather_with_room(flat_values, memo.tail_rows, new)
            positions = None if memo.tail_positions is None else _with_room(memo.tail_positions, new)
            extras = {name: _with_room(tensor, new) for name, tensor in memo.extras.items()}
            layer.store = DenseKVStore.wrap(tail_keys, tail_values, positions, memo.first_position, memo.heads_aligned,
                                            extras, live=tail)  # fmt: skip
        return layer, prefix, tail_keys

    def _write_back(self, memo: HeadwiseMemo, layer: KVLayer, prefix, tail_keys, new: int) -> None:
        """Put what the methods kept into head blocks: the new tokens alone when nothing else changed."""
        store = layer.store
        unknown = [part for part in layer.parts if not isinstance(part, RaggedKV)]
        if unknown:
            raise CacheUsageError(
                f"the engine's head blocks hold full-precision tokens, but the methods made {unknown[0].kind}; "
                "serve this spec with kvopt.cache(...) and model.generate"
            )
        old_tail = 0 if memo.tail_rows is None else memo.tail_rows.shape[1]
        same_parts = [id(part) for part in layer.parts] == ([id(prefix)] if prefix is not None else [])
        same_tail = store.wraps(tail_keys) if tail_keys is not None else not old_tail
        if same_parts and same_tail and len(store) == old_tail + new:  # the new tokens were appended, nothing else
            rows = self._grow(memo, new)
            memo.tail_rows = rows if memo.tail_rows is None else torch.cat([memo.tail_rows, rows], dim=1)
            self._write(rows, store.keys[0, :, old_tail:], store.values[0, :, old_tail:])
        else:
            self._rewrite(memo, layer)
        memo.tail_positions = None if store.is_empty or store.first_position is not None else store.positions
        memo.first_position = 0 if store.is_empty else store.first_position or 0
        memo.heads_aligned = store.heads_aligned
        memo.extras = {} if store.is_empty else store.extras()

    def _grow(self, memo: HeadwiseMemo, new: int) -> torch.Tensor:
        """Pool rows ``[H, new]`` for ``new`` more tokens at the end of every head."""
        rows = []
        for head, count in enumerate(memo.counts()):
            head_blocks = memo.head_blocks[head]
            while len(head_blocks) * self.block_size < count + new:
                head_blocks.append(self.blocks.take())
            rows.append(self._rows(head_blocks, count, count + new))
        return torch.stack(rows)

    def _rewrite(self, memo: HeadwiseMemo, layer: KVLayer) -> None:
        """Write the layer's whole content anew (the prefill, or after an eviction)."""
        store = layer.store
        ragged = layer.parts[0] if layer.parts else None
        tail = 0 if store.is_empty else len(store)
        prefix_counts = ragged.counts()[0].tolist() if ragged is not None else [0] * self.kv_heads
        prefix_rows, tail_rows = [], []
        for head, prefix in enumerate(prefix_counts):
            head_blocks = memo.head_blocks[head]
            needed = -(-(prefix + tail) // self.block_size)
            while len(head_blocks) < needed:
                head_blocks.append(self.blocks.take())
            while len(head_blocks) > needed:
                self.blocks.give(head_blocks.pop())
            rows = self._rows(head_blocks, 0, prefix + tail)
            prefix_rows.append(rows[:prefix])
            tail_rows.append(rows[prefix:])
        if ragged is not None:
            memo.prefix_rows = torch.cat(prefix_rows)
            memo.prefix_positions, memo.prefix_offsets = ragged.positions, ragged.offsets
            self._write(memo.prefix_rows, ragged.keys, ragged.values)
        else:
            memo.prefix_rows = memo.prefix_positions = memo.prefix_offsets = None
        memo.tail_rows = torch.stack(tail_rows) if tail else None
        if tail:
            self._write(memo.tail_rows, store.keys[0], store.values[0])

    def _rows(self, head_blocks: list[int], first: int, end: int) -> torch.Tensor:
        """Pool rows (of the flattened pool) of tokens ``first ... end - 1`` of a head with ``head_blocks``."""
        if first == end:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        size = self.block_size
        ids = torch.tensor(head_blocks[first // size : -(-end // size)], dtype=torch.long, device=self.device)
        block_ids, within = ids // self.blocks.per_block, ids % self.blocks.per_block
        starts = within * self.slots + block_ids * size
        rows = (starts[:, None] + torch.arange(size, device=self.device)).flatten()
        offset = first - first // size * size
        return rows[offset : offset + end - first]

    def _write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys/values [..., D]`` (flattened to ``[rows, D]``) at ``rows`` of the flattened pool."""
        flat = rows.flatten()
        self.pool.flat_keys.index_copy_(0, flat, keys.reshape(-1, keys.shape[-1]))
        self.pool.flat_values.index_copy_(0, flat, values.reshape(-1, values.shape[-1]))

    def plan(self, plan, seq, row: int, count: int) -> bool:
        plan.own.append(HeadwiseStep(self, row, row + count, seq.num_computed_tokens, list(seq.block_table)))
        return True

    def commit(self, seq, drafted: int, accepted: int, block_size: int) -> list[int]:
        """Keep the blocks still holding tokens; give back those emptied."""
        kept, empty = self.blocks.release_empty()
        seq.block_table = list(kept)
        return empty


def _gather_with_room(flat: torch.Tensor, rows: torch.Tensor, room: int) -> torch.Tensor:
    """``[1, H, tail + room, D]``: the tail's tokens gathered from the flattened pool, then free room for appends."""
    heads, tail = rows.shape
    out = flat.new_empty(1, heads, tail + room, flat.shape[-1])
    out[0, :, :tail] = flat.index_select(0, rows.flatten()).view(heads, tail, -1)
    return out


def _with_room(tensor: torch.Tensor, room: int) -> torch.Tensor:
    """A per-token ``[1, H, tokens]`` tensor with ``room`` more (zeroed) tokens of space."""
    return torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], room)], dim=-1)

