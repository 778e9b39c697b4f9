"""Runs one scheduled step through the model: flattened inputs, the per-step context, logits.

The step's sequences become one row of ``tokens`` ids with their own positions (no padding);
their new keys/values go to the slots their block tables name, and attention reads each
sequence's context from the pool (:mod:`kvopt.cache.paged`). Logits are computed only at the
rows whose next token is sampled.
"""

from __future__ import annotations

import torch

from kvopt.cache.paged import DecodeGroup, PagedBatch, PagedCache, PagedKVPool, SequenceSlots, last_tokens, slots_of
from kvopt.engine.scheduler import ScheduledBatch
from kvopt.engine.sequence import Sequence
from kvopt.models.info import ModelInfo


class ModelRunner:
    def __init__(self, model, info: ModelInfo, num_blocks: int, block_size: int) -> None:
        from kvopt import prepare

        prepare(model)
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.pool = PagedKVPool(info, num_blocks, block_size, dtype, self.device)
        self.cache = PagedCache(self.pool, info)

    # -- the swapper the scheduler uses in swap mode ------------------------------------------
    def swap_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        return self.pool.read_blocks(block_ids)

    def swap_in(self, saved: list[torch.Tensor], block_ids: list[int]) -> None:
        self.pool.write_blocks(saved, block_ids)

    # -- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, copies: list[tuple[int, int]]) -> torch.Tensor:
        """Compute the batch's tokens; returns fp32 logits ``[sampling sequences, vocab]`` in batch order."""
        self.pool.copy_blocks(copies)
        ids, positions, new_slots, logit_rows, sequences = [], [], [], [], []
        row = 0
        for index, (seq, count) in enumerate(zip(batch.seqs, batch.num_tokens)):
            first = seq.num_computed_tokens
            ids.extend(seq.token_ids[first : first + count])
            positions.extend(range(first, first + count))
            runs = self._runs(seq, first + count)
            new_slots.append(slots_of(last_tokens(runs, count)))
            sequences.append(SequenceSlots.of(row, row + count, runs, self.device))
            row += count
            if batch.samples(index):
                logit_rows.append(row - 1)
        device = self.device
        self.cache.batch = PagedBatch(torch.cat(new_slots).to(device), sequences, DecodeGroup.of(sequences, device))
        try:
            output = self.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=torch.tensor(logit_rows, dtype=torch.long, device=device),
            )
        finally:
            self.cache.batch = None
        return output.logits[0].float()

    def _runs(self, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
        """Maximal runs of consecutive slots holding ``seq``'s first ``tokens`` tokens, in order."""
        size, runs = self.block_size, []
        for index, block in enumerate(seq.block_table[: -(-tokens // size)]):
            stop = block * size + min(size, tokens - index * size)
            if runs and runs[-1][1] == block * size:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((block * size, stop))
        return runs

