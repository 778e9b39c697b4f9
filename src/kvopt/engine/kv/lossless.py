"""Lossless sequences: every computed token in one slot of its blocks, in order (PagedAttention)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvopt.engine.kv.base import cut_table, table_fill
from kvopt.engine.kv.paged import SequenceSlots

if TYPE_CHECKING:
    from kvopt.engine.kv.paged import StepPlan
    from kvopt.engine.sequence import Sequence


class LosslessKV:
    """Nothing but the block table: token ``j`` sits at slot ``j`` of it, so blocks are shared by content
    (prefix cache, tiers) and read in place; the prompt may be computed in chunks, drafts verified."""

    shares_blocks: ClassVar[bool] = True
    keeps_prompt_state: ClassVar[bool] = False

    def stored_tokens(self, computed: int) -> int:
        return computed

    def reserve_tokens(self, tokens: int) -> int:
        return tokens

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        return computed + new_tokens

    def nbytes(self, seq: Sequence, block_bytes: int) -> int:
        return len(seq.block_table) * block_bytes

    def held_blocks(self, seq: Sequence, block_size: int) -> list[int]:
        return seq.block_table[: -(-seq.num_computed_tokens // block_size)]

    def filled_slots(self, seq, block_size: int) -> dict[int, int]:
        return table_fill(seq.block_table, seq.num_computed_tokens, block_size)

    def relocate(self, moved: dict[int, int]) -> None:
        """Block ids live only in the sequence's table: nothing to follow."""

    def reset(self) -> None:
        """Nothing is kept outside the blocks."""

    def plan(self, plan: StepPlan, seq: Sequence, row: int, count: int) -> bool:
        runs = plan.runs(seq.block_table, seq.num_computed_tokens + count)
        plan.store_new(runs, row, count)
        plan.sequences.append(SequenceSlots.of(row, row + count, runs, plan.device))
        return True

    def commit(self, seq: Sequence, drafted: int, accepted: int, block_size: int) -> list[int]:
        """Blocks past the next token's held only drafts the model rejected: give them back."""
        if not drafted:
            return []
        return cut_table(seq.block_table, -(-(seq.num_computed_tokens + accepted + 1) // block_size))
