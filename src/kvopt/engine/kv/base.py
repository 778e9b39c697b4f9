"""The one interface between the engine and a sequence's KV, whatever holds it.

Every sequence has a KV object (lossless ones included); the scheduler, the model runner and
the engine call only this protocol, never ask what kind it is. Kinds are picked from a table
when a request arrives (:func:`kvopt.engine.kv.storage_for`, vLLM's one manager per KV spec):

- :class:`~kvopt.engine.kv.lossless.LosslessKV`: every computed token in one slot of its blocks,
  shared through the prefix cache and the tiers, read in place by batched attention;
- :class:`~kvopt.engine.kv.compressed.CompressedKV`: what uniform-budget methods keep,
  compacted in blocks, quantized groups in code blocks;
- :class:`~kvopt.engine.kv.headwise.HeadwiseKV`: budgets per layer or head, in head blocks;
- :class:`~kvopt.engine.kv.cache_backed.CacheBackedKV`: any other spec (whole-prompt passes,
  cross-layer ranking or merging, non-uniform codes, sparse indexes, sliding-window models):
  the sequence's own :class:`~kvopt.cache.kv_cache.KVCache`, run exactly as ``generate`` runs it.

Blocks are counted the same way for all: a sequence holds ``block_table`` (and a compressed
one's ``code_table``) from the :class:`~kvopt.engine.block_manager.BlockManager`, and asks for
slots through :meth:`SequenceKV.slots_needed`, so admission, preemption and ``kv_cache_usage_perc``
see every sequence's real size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from kvopt.engine.kv.paged import PagedKVPool, StepPlan
    from kvopt.engine.sequence import Sequence


class SequenceKV(Protocol):
    """One sequence's KV as the engine drives it."""

    #: Its blocks hold computed tokens one per slot: they join the prefix cache and the tiers' block store,
    #: its prompt may be computed in chunks, and its drafts can be verified (speculative decoding).
    shares_blocks: ClassVar[bool]
    #: Its state right after the prompt can be kept in the KV tiers (:meth:`snapshot` / :meth:`install`).
    keeps_prompt_state: ClassVar[bool]

    def stored_tokens(self, computed: int) -> int:
        """Slots its blocks fill now, with ``computed`` tokens computed."""
        ...

    def reserve_tokens(self, tokens: int) -> int:
        """Slots to give a prompt of ``tokens`` at admission (the prompt's one pass included)."""
        ...

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        """Slots the block table needs once ``new_tokens`` more tokens are stored."""
        ...

    def plan(self, plan: StepPlan, seq: Sequence, row: int, count: int) -> bool:
        """Lay ``seq``'s ``count`` tokens of this step into the per-step context at rows ``row:row + count`` of the
        flattened batch; False when it computes them alone this step instead (``plan.alone``)."""
        ...

    def commit(self, seq: Sequence, drafted: int, accepted: int, block_size: int) -> list[int]:
        """After the step (``accepted`` of ``drafted`` drafts kept): update ``seq``'s tables; the blocks it gives
        back, in the order they should join the free queue."""
        ...

    def held_blocks(self, seq: Sequence, block_size: int) -> list[int]:
        """The blocks whose contents it needs (what swapping out copies)."""
        ...

    def relocate(self, moved: dict[int, int]) -> None:
        """Its blocks came back from a swap at new ids (``moved``: old id -> new id)."""
        ...

    def reset(self) -> None:
        """Forget everything: the sequence is recomputed from its tokens."""
        ...

    def nbytes(self, seq: Sequence, block_bytes: int) -> int:
        """Bytes it holds (whole blocks)."""
        ...

    def filled_slots(self, seq: Sequence, block_size: int) -> dict[int, int]:
        """Slots in use in each block it holds (what ``kv_cache_usage_perc`` reports)."""
        ...


class StoredPrompt(Protocol):
    """A sequence's state right after its prompt, as the KV tiers keep it (one entry per spec and prompt)."""

    #: fp32 logits of the prompt's last position ``[vocab]``: its first output token is sampled from them.
    logits: torch.Tensor


class KeepsPromptState(SequenceKV, Protocol):
    """A kind whose ``keeps_prompt_state`` is true: its state after the prompt leaves the pool and comes back."""

    def snapshot(self, pool: PagedKVPool, block_table: list[int], code_table: list[int], logits: torch.Tensor) -> StoredPrompt:
        """Its state now (right after its prompt), copied: the sequence goes on changing it."""
        ...

    def check_state(self, state: StoredPrompt, pool: PagedKVPool) -> None:
        """Raise (ValueError or the codec's error) unless a decoded tier entry fits this sequence."""
        ...

    def state_blocks(self, state: StoredPrompt) -> int:
        """Blocks :meth:`install` needs for a checked ``state``."""
        ...

    def install(self, state: StoredPrompt, pool: PagedKVPool, block_table: list[int]) -> tuple[list[int], list[int]]:
        """Write a checked ``state`` into ``block_table``; the sequence's ``(block table, code table)``."""
        ...


def cut_table(block_table: list[int], keep: int) -> list[int]:
    """Cut ``block_table`` after its first ``keep`` blocks; the blocks cut, newest first (the order they should
    join the free queue in)."""
    surplus = block_table[keep:]
    del block_table[keep:]
    return surplus[::-1]


def table_fill(block_table: list[int], stored: int, block_size: int) -> dict[int, int]:
    """Slots in use per block when ``stored`` tokens fill ``block_table`` in order."""
    return {block: min(block_size, max(0, stored - index * block_size)) for index, block in enumerate(block_table)}
