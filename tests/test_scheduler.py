"""The scheduler without a model: steps are simulated (computed tokens advance, sampled tokens appended)."""

from kvopt.engine.block_manager import BlockManager
from kvopt.engine.config import EngineConfig
from kvopt.engine.sampling_params import SamplingParams
from kvopt.engine.scheduler import Scheduler
from kvopt.engine.sequence import Sequence, SequenceStatus


class Simulation:
    def __init__(self, num_blocks: int, **options) -> None:
        self.config = EngineConfig(block_size=4, **options)
        self.manager = BlockManager(num_blocks, 4, "sim")
        self.scheduler = Scheduler(self.config, self.manager)
        self.clock = 0.0

    def add(self, name: str, tokens: range, max_tokens: int, priority: int = 0) -> Sequence:
        self.clock += 1.0
        seq = Sequence(int(self.clock), name, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens),
                       self.clock, priority=priority)  # fmt: skip
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[str]:
        batch = self.scheduler.schedule()
        for index, (seq, count) in enumerate(zip(batch.seqs, batch.num_tokens)):
            samples = batch.samples(index)
            seq.num_computed_tokens += count
            if samples:
                seq.token_ids.append(1)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.finish(seq, "length")
        self.manager.pending_copies.clear()
        return [seq.request_id for seq in batch.seqs]


def test_a_preempted_sequence_queues_by_priority():
    sim = Simulation(7, policy="priority", max_num_batched_tokens=64)
    sim.add("urgent", range(3, 10), max_tokens=12, priority=0)
    background = sim.add("background", range(20, 27), max_tokens=12, priority=9)
    sim.step()
    sim.add("important", range(40, 52), max_tokens=2, priority=1)
    orders = []
    for step in range(14):
        sim.step()
        if step == 4:
            sim.add("late", range(60, 63), max_tokens=2, priority=5)
        orders.append([(seq.request_id, seq.priority) for seq in sim.scheduler.waiting])
    assert sim.scheduler.num_preemptions > 0
    for waiting in orders:  # always in priority order, the preempted background sequence included
        assert [priority for _, priority in waiting] == sorted(priority for _, priority in waiting)
    assert any(("late", 5) in waiting and ("background", 9) in waiting for waiting in orders)
    assert background.status is SequenceStatus.FINISHED or background in sim.scheduler.running
