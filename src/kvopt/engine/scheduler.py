"""Which sequences run in the next forward pass, and with how many tokens each.

One flattened batch per step mixes decodes (one token each) with prefill chunks, up to
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences (vLLM v1's unified
scheduling). Running sequences go first; when the pool cannot give one of them a block, the
lowest-priority running sequence is preempted: its blocks are freed and it is recomputed
later (its prefix is often still in the prefix cache), or, in ``swap`` mode, its blocks are
copied to host memory and copied back when room returns. Waiting sequences are admitted
only in steps that preempted nothing, first come first served or by priority; one whose next
uncached block another sequence computes in this very step waits a step and then finds it in
the prefix cache (requests sharing a system prompt that arrive together compute it once).
A compressed sequence (:mod:`kvopt.engine.kv.compressed`) computes its prompt in one pass, so
that its methods see the whole prompt as in ``generate`` (one such prompt per step may exceed the
token budget), and gets blocks only for what its methods keep; one whose prompt's state is found in
the KV tiers gets blocks for that state and computes nothing (its first token is sampled from the
stored logits). With ``speculate``, a decoding lossless sequence carries the tokens its proposer drafts
after its newest one, computed in the same step: drafts take only the token budget and the free blocks that
every scheduled sequence left, so they never delay a sequence or cause a preemption.

Every step is stall-free (:mod:`kvopt.engine.step_budget`): each decoding sequence's token is counted before any
prompt's, so a long prompt ahead of it in rank never takes its turn; prompts' chunks then share what is left, at
most ``long_prefill_token_threshold`` tokens each, at most ``max_num_partial_prefills`` prompts part-way through,
and with ``itl_target_ms`` no more than the target leaves room for while sequences decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvopt.engine.block_manager import BlockManager
from kvopt.engine.config import EngineConfig
from kvopt.engine.kv.base import StoredPrompt
from kvopt.engine.offload import KVOffload
from kvopt.engine.sequence import Sequence, SequenceStatus
from kvopt.engine.step_budget import MIN_PREFILL_CHUNK, StepBudget, StepClock
from kvopt.speculative.control import DraftPace
from kvopt.speculative.lookup import PromptLookup


class Swapper(Protocol):
    """Moves blocks' contents out of the pool and back (the model runner)."""

    def swap_out(self, block_ids: list[int]) -> object: ...

    def swap_in(self, saved: object, block_ids: list[int]) -> None: ...


@dataclass(slots=True)
class ScheduledBatch:
    """Sequences of one step and the tokens each computes (its first uncomputed ones)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    #: Compressed prompts admitted with their state from the KV tiers, with their stored logits ``[vocab]``.
    restored: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def samples(self, index: int) -> bool:
        """Whether sequence ``index`` reaches its newest token (and its drafts) this step, so a token is sampled."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_tokens[index] == len(seq) + len(seq.draft_token_ids)


@dataclass(slots=True)
class SwappedBlocks:
    """A swapped-out sequence's blocks: their contents in host memory and the ids they had."""

    contents: object
    block_ids: list[int]
    #: How many of ``block_ids`` were its block table (the rest: a compressed sequence's code table).
    num_table_blocks: int


@dataclass(frozen=True, slots=True)
class Drafting:
    """Speculative decoding as the scheduler runs it: the proposer, the most running sequences that still draft
    (None: any number; beyond it a step's extra tokens cost more than they save on a compute-bound device), and
    the longest a sequence may grow."""

    proposer: PromptLookup
    max_batch: int | None
    max_model_len: int

    def drafts(self, seq: Sequence, budget: int, running: int) -> list[int]:
        """Tokens drafted after ``seq``'s newest one, no more than its ``budget`` (counting the newest token),
        ``max_tokens`` and the context could still take: only for a lossless sequence that decodes among at most
        ``max_batch`` running ones. Not before a parallel-sampling request forks (its siblings share its blocks
        from its prompt's logits), nor for a seeded sampled request (whether it drafts depends on the batch, and
        drafting changes which random numbers it draws: its samples would too)."""
        params = seq.params
        if not seq.kv.shares_blocks or seq.num_uncomputed_tokens != 1 or seq.width > 1:
            return []
        if running > (self.max_batch or running) or (params.seed is not None and not params.greedy):
            return []
        room = min(budget, params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
        if room < 1:
            return []
        if seq.draft_pace is None:
            seq.draft_pace = DraftPace(self.proposer.k)
        length = min(room, seq.draft_pace.next_length())
        return self.proposer.propose(seq.token_ids, length)[0] if length > 0 else []

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Let ``seq``'s drafting follow what the model accepted (:class:`~kvopt.speculative.control.DraftPace`)."""
        seq.draft_pace.after_verification(self.proposer.k, drafted, accepted)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swapper: Swapper | None = None,
                 offload: KVOffload | None = None, drafting: Drafting | None = None,
                 clock: StepClock | None = None) -> None:  # fmt: skip
        self.config = config
        #: Step times and the latency target the prompt budget is sized for.
        self.clock = clock or StepClock()
        #: The budget of the step :meth:`schedule` made last (the engine reports its measured time against it).
        self.budget: StepBudget | None = None
        #: Speculative decoding (None: one token per step).
        self.drafting = drafting
        self.block_manager = block_manager
        self.swapper = swapper
        #: The KV tiers beyond the pool, if any: finished requests' blocks go there, prompts look there too.
        self.offload = offload
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[tuple[Sequence, SwappedBlocks]] = deque()
        self.num_preemptions = 0

    def _rank(self, seq: Sequence) -> tuple:
        """Sort key: smaller runs first (FCFS: arrival; priority: lower value first, then arrival)."""
        if self.config.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` in rank order (a preempted sequence goes back ahead of the later arrivals)."""
        seq.status = SequenceStatus.WAITING
        position = len(self.waiting)
        while position and self._rank(self.waiting[position - 1]) > self._rank(seq):
            position -= 1
        self.waiting.insert(position, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        cap = self.config.max_num_batched_tokens
        # Decodes are counted before any prompt's chunk: a decode never waits behind a prompt.
        budget = self.clock.budget(cap, self.config.long_prefill_token_threshold,
                                   [seq.num_stored_tokens for seq in decoding])  # fmt: skip
        counted = {seq.seq_id for seq in decoding[:cap]}
        budget.opening_room = budget.room(0, MIN_PREFILL_CHUNK)
        self.budget = budget
        # Under a latency target a waiting prompt goes before the next chunk of a prompt part-way through: a chat
        # user's question does not queue behind a long document's chunks (each still gets its minimum).
        deferred = budget.decoding and budget.target is not None
        preempted = self._schedule_running(batch, budget, counted, deferred)
        if not preempted:
            self._swap_in()
            if not self.swapped:  # swapped sequences return before new ones take the blocks they wait for
                self._admit_waiting(batch, budget)
        if deferred:
            self._continue_prompts(batch, budget)
        if self.drafting is not None:
            self._add_drafts(batch, budget, preempted)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: StepBudget, preempted: bool) -> None:
        """Speculative decoding: drafts for the batch's decoding sequences, from the token budget and the free
        blocks that every scheduled token has left (a draft never takes a sequence's turn or blocks from it); none
        in a step that preempted (the blocks a victim freed are for the sequences it made way for). A verify step
        counts its drafts at their cost, so a latency target holds with them too."""
        for index, seq in enumerate(batch.seqs):
            seq.draft_token_ids = []
            room = 0 if preempted else budget.room(len(seq))
            if room < 1:
                continue
            drafts = self.drafting.drafts(seq, room + 1, len(self.running))
            if drafts and self.block_manager.allocate_slots(seq, batch.num_tokens[index] + len(drafts)):
                seq.draft_token_ids = drafts
                batch.num_tokens[index] += len(drafts)
                budget.take(seq.num_stored_tokens, len(drafts), prompt=False)

    def _schedule_running(self, batch: ScheduledBatch, budget: StepBudget, counted: set[int], defer: bool) -> bool:
        """Give running sequences their next tokens (a decode the token the budget ``counted`` for it, a prompt
        part-way the chunk the budget grants, unless ``defer``-red to :meth:`_continue_prompts`), preempting from
        the back when blocks run out."""
        self.running.sort(key=self._rank)
        preempted, index = False, 0
        while index < len(self.running) and len(batch.seqs) < self.config.max_num_seqs:
            seq = self.running[index]
            if seq.num_uncomputed_tokens == 1:
                num_tokens = 1 if seq.seq_id in counted else 0  # beyond the token cap: the next step
            elif defer:
                num_tokens = 0
            else:
                floor = 0 if budget.prompt_tokens else MIN_PREFILL_CHUNK
                num_tokens = budget.grant_prompt(seq.num_computed_tokens, seq.num_uncomputed_tokens, floor)
            if num_tokens == 0:
                index += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.add(seq, num_tokens)
                index += 1
        return preempted

    def _continue_prompts(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        """The next chunks of the prompts part-way through, in rank order, after the waiting prompts were admitted;
        the first gets at least the minimum chunk, so a long prompt always progresses. Their blocks were taken at
        admission (a chunk that finds none waits for the next step rather than preempting)."""
        scheduled = {seq.seq_id for seq in batch.seqs}
        first = True
        for seq in [seq for seq in self.running if seq.num_uncomputed_tokens > 1 and seq.seq_id not in scheduled]:
            if len(batch.seqs) >= self.config.max_num_seqs:
                return
            floor = MIN_PREFILL_CHUNK if first else 0
            num_tokens = budget.grant_prompt(seq.num_computed_tokens, seq.num_uncomputed_tokens, floor)
            first = False
            if num_tokens and self.block_manager.allocate_slots(seq, num_tokens):
                batch.add(seq, num_tokens)

    def _admit_waiting(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        manager, limit = self.block_manager, self.config.max_num_partial_prefills
        computing: set[bytes] = set()  # hashes of the full prompt blocks this step computes
        occupied = sum(seq.width for seq in self.running)  # a parallel-sampling request will run as n
        prefilling = sum(1 for seq in self.running if seq.num_uncomputed_tokens > 1)
        admitted = False
        while self.waiting and budget.spare_tokens > 0:
            seq = self.waiting[0]
            if occupied and occupied + seq.width > self.config.max_num_seqs:
                break  # (a request wider than max_num_seqs runs alone)
            if self._stored_state(seq) is not None:  # a compressed prompt seen before: nothing to compute
                if not self._admit_state(seq, batch):
                    break
                occupied += seq.width
                continue
            if limit is not None and prefilling >= limit:
                break  # as many prompts part-way through as allowed: the next waits for one to finish
            whole = not seq.kv.shares_blocks  # neither uses nor fills the prefix cache; its prompt runs in one pass
            hashes = manager.prompt_hashes(seq) if manager.enable_prefix_caching and not whole else []
            cached = manager.cached_prefix(seq, hashes)
            if self.offload is not None and len(cached) < len(hashes):
                cached += self.offload.restore(seq, hashes, len(cached))
            if len(cached) < len(hashes) and hashes[len(cached)] in computing:
                break  # cached after this step: admitted next step, computing only what is its own
            position = len(cached) * manager.block_size
            uncomputed = len(seq) - position
            room = budget.room(position, 0 if admitted else MIN_PREFILL_CHUNK)
            if whole and uncomputed > room and admitted:
                break  # a compressed prompt runs in one pass (its methods see it whole), one beyond the budget per step
            num_tokens = uncomputed if whole else min(uncomputed, room)
            if num_tokens < 1:
                break
            # Blocks for the whole prompt at once, even when it is computed in chunks: consecutive blocks,
            # not interleaved with the chunks of the sequences admitted beside it. A compressed prompt
            # gets blocks for what its methods keep (its own tokens never reach its slots).
            if not manager.allocate_slots(seq, min(uncomputed, seq.kv.reserve_tokens(uncomputed)), cached):
                break
            if not seq.prefix_looked_up:
                seq.prefix_looked_up = True
                seq.num_cached_tokens = len(cached) * manager.block_size
                manager.record_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            occupied += seq.width
            prefilling += num_tokens < uncomputed
            admitted = True
            batch.add(seq, num_tokens)
            budget.take(position, num_tokens)
            computing.update(hashes[len(cached) : (seq.num_computed_tokens + num_tokens) // manager.block_size])

    def _stored_state(self, seq: Sequence) -> StoredPrompt | None:
        """A compressed prompt's state from the KV tiers (looked up once, at its first admission), or None."""
        if seq.kv.keeps_prompt_state and self.offload is not None and not seq.prefix_looked_up:
            seq.prefix_looked_up = True
            seq.prompt_state = self.offload.restore_state(seq)
            seq.num_cached_tokens = seq.num_prompt_tokens if seq.prompt_state is not None else 0
            self.block_manager.record_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
        return seq.prompt_state

    def _admit_state(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Admit ``seq`` with its stored prompt state written into blocks of its own (False, changing nothing,
        when too few blocks are free): the whole prompt counts as computed, its first token is sampled from the
        stored logits in this step."""
        manager, state = self.block_manager, seq.prompt_state
        if not manager.allocate_slots(seq, seq.kv.state_blocks(state) * manager.block_size):
            return False
        seq.block_table, seq.code_table = seq.kv.install(state, self.offload.pool, seq.block_table)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.prompt_state = None
        batch.restored.append((seq, state.logits))
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq, saved = self.swapped[0]
            block_ids = self.block_manager.take_blocks(len(saved.block_ids))
            if block_ids is None:
                return
            seq.block_table, seq.code_table = block_ids[: saved.num_table_blocks], block_ids[saved.num_table_blocks :]
            seq.kv.relocate(dict(zip(saved.block_ids, block_ids)))
            self.swapper.swap_in(saved.contents, block_ids)
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks: swapped to host memory in ``swap`` mode (exact: it continues as if never
        preempted), else recomputed later (a compressed sequence's methods then compress prompt and output anew)."""
        self.num_preemptions += 1
        swap = self.config.preemption_mode == "swap" and self.swapper is not None
        if swap and seq.num_computed_tokens:
            held = seq.kv.held_blocks(seq, self.block_manager.block_size)
            saved = SwappedBlocks(self.swapper.swap_out(held), held, min(len(held), len(seq.block_table)))
            computed = seq.num_computed_tokens
            self.block_manager.free(seq)
            seq.num_computed_tokens = computed
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append((seq, saved))
            return
        self.block_manager.free(seq)
        seq.kv.reset()
        self.add(seq)

    # -- after the step -------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop ``seq`` (finished or aborted) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped = deque(item for item in self.swapped if item[0] is not seq)
        if seq.block_table:
            if seq.kv.shares_blocks:  # blocks its last step filled (accepted drafts) are named before they are freed
                self.block_manager.cache_full_blocks(seq)
                if self.offload is not None:
                    self.offload.save(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

