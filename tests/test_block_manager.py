"""Property tests of the block manager: random allocate / append / speculate / fork / free / preempt sequences.

A model of the pool's contents (which token each slot holds) is updated the way the runner
would write it, including copy-on-write copies, so the invariants cover correctness (every
sequence reads its own tokens, prefix hits serve the same tokens) as well as bookkeeping
(no leak, no double free, ref counts equal to the holders).
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvopt.engine.block_manager import BlockManager
from kvopt.engine.sampling_params import SamplingParams
from kvopt.engine.sequence import Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 12
#: A small alphabet, so random prompts often share prefixes (prefix-cache hits).
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=26)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, salt="test")
        self.live: list[Sequence] = []
        self.slots: dict[int, int] = {}  # slot -> token written there
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _write(self, seq: Sequence, count: int) -> None:
        """What the runner does: make the pending copies, then write the slots of the step's tokens (drafts too)."""
        for source, destination in self.manager.pending_copies:
            for offset in range(BLOCK_SIZE):
                if source * BLOCK_SIZE + offset in self.slots:
                    self.slots[destination * BLOCK_SIZE + offset] = self.slots[source * BLOCK_SIZE + offset]
        self.manager.pending_copies.clear()
        first = seq.num_computed_tokens
        for position, token in zip(range(first, first + count), seq.step_token_ids(count)):
            block = seq.block_table[position // BLOCK_SIZE]
            self.slots[block * BLOCK_SIZE + position % BLOCK_SIZE] = token

    def _compute(self, seq: Sequence, count: int) -> None:
        self._write(seq, count)
        seq.num_computed_tokens += count
        self.manager.cache_full_blocks(seq)

    def _admit(self, seq: Sequence) -> bool:
        cached = self.manager.cached_prefix(seq, self.manager.prompt_hashes(seq))
        uncomputed = len(seq) - len(cached) * BLOCK_SIZE
        if not self.manager.allocate_slots(seq, uncomputed, cached):
            assert not seq.block_table and seq.num_computed_tokens == 0  # all or nothing
            return False
        self._compute(seq, uncomputed)
        self.live.append(seq)
        return True

    @rule(prompt=tokens)
    def add(self, prompt):
        self._admit(Sequence(self._new_id(), "r", list(prompt), len(prompt), SamplingParams(), 0.0))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.manager.allocate_slots(seq, 1):
            self._compute(seq, 1)
        else:  # preempted for recompute: freed, then tried again from its cached prefix
            self.live.remove(seq)
            self.manager.free(seq)
            self._admit(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=6),
          accepted=st.integers(0, 6))  # fmt: skip
    def speculate(self, data, token, drafts, accepted):
        """A decode step with drafts (speculative decoding): the newest token and the drafts are written, the first
        ``accepted`` drafts are kept, and the blocks past the next token's (holding only rejected drafts) are given
        back, as the engine does: the next token's block stays, possibly empty."""
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        seq.draft_token_ids = drafts
        if not self.manager.allocate_slots(seq, 1 + len(drafts)):  # the scheduler then tries without drafts
            seq.token_ids.pop()
            seq.draft_token_ids = []
            return
        self._write(seq, 1 + len(drafts))
        accepted = min(accepted, len(drafts))
        seq.token_ids.extend(drafts[:accepted])
        seq.draft_token_ids = []
        seq.num_computed_tokens += 1 + accepted
        self.manager.release_surplus(seq, seq.num_computed_tokens + 1)
        self.manager.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(self._new_id(), 1)
        self.manager.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.manager.free(seq)
        assert not seq.block_table

    @invariant()
    def ref_counts_equal_holders(self):
        holders = [0] * NUM_BLOCKS
        for seq in self.live:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [block.ref_count for block in self.manager.blocks] == holders
        free = list(self.manager.free_queue)
        assert len(free) == len(set(free))
        assert set(free) == {i for i, count in enumerate(holders) if count == 0}

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.live:  # after a step with drafts, the (empty) block the next token goes into may be held
            computed = seq.num_computed_tokens
            assert len(seq.block_table) in (-(-computed // BLOCK_SIZE), -(-(computed + 1) // BLOCK_SIZE))
            for position in range(seq.num_computed_tokens):
                slot = seq.block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                assert self.slots[slot] == seq.token_ids[position]

    @invariant()
    def hashes_name_their_blocks(self):
        for digest, block_id in self.manager.hash_to_block_id.items():
            block = self.manager.blocks[block_id]
            assert block.hash == digest and len(block.token_ids) == BLOCK_SIZE

    def teardown(self):
        for seq in self.live:
            self.manager.free(seq)
        assert all(block.ref_count == 0 for block in self.manager.blocks)
        assert self.manager.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_lru_reuses_freed_blocks_until_evicted():
    manager = BlockManager(4, BLOCK_SIZE, salt="lru")
    first = Sequence(1, "a", [1] * 9, 9, SamplingParams(), 0.0)
    assert manager.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    manager.cache_full_blocks(first)
    manager.free(first)
    again = Sequence(2, "b", [1] * 9, 9, SamplingParams(), 0.0)
    assert len(manager.cached_prefix(again, manager.prompt_hashes(again))) == 2  # freed, still cached
    other = Sequence(3, "c", [2] * 16, 16, SamplingParams(), 0.0)
    assert manager.allocate_slots(other, 16)  # takes all 4 blocks: the cached ones are evicted
    assert manager.cached_prefix(again, manager.prompt_hashes(again)) == []


def test_salt_separates_caches():
    tokens_ = [5] * 9
    for salt, expected in (("model|full", 2), ("model|snapkv:ratio=0.5", 0)):
        manager = BlockManager(4, BLOCK_SIZE, salt="model|full")
        seq = Sequence(1, "a", list(tokens_), 9, SamplingParams(), 0.0)
        manager.allocate_slots(seq, 9)
        seq.num_computed_tokens = 9
        manager.cache_full_blocks(seq)
        other = BlockManager(4, BLOCK_SIZE, salt=salt)
        other.hash_to_block_id, other.blocks = manager.hash_to_block_id, manager.blocks
        probe = Sequence(2, "b", list(tokens_), 9, SamplingParams(), 0.0)
        assert len(other.cached_prefix(probe, other.prompt_hashes(probe))) == expected


def test_a_fork_shares_only_the_blocks_of_computed_tokens():
    """After a step with drafts a sequence may already hold the (empty) block its next token goes into; a fork
    must not share it, or parent and child would both write their next token into the same slot."""
    manager = BlockManager(6, BLOCK_SIZE)
    parent = Sequence(1, "a", [1] * 4, 4, SamplingParams(), 0.0)
    assert manager.allocate_slots(parent, 8)  # the newest token and 4 drafts: 2 blocks
    parent.num_computed_tokens = 4  # every draft rejected
    manager.release_surplus(parent, 4 + 1)  # the next token's block stays
    assert len(parent.block_table) == 2
    child = parent.fork(2, 1)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table[:1]
    for seq in (parent, child):
        seq.token_ids.append(seq.seq_id)
        assert manager.allocate_slots(seq, 1)
    assert parent.block_table[1] != child.block_table[1]
    assert [block.ref_count for block in manager.blocks if block.ref_count] == [2, 1, 1]
