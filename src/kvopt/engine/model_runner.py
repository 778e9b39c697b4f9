"""Runs one scheduled step through the model: flattened inputs, the per-step context, logits.

The step's sequences become one row of ``tokens`` ids with their own positions (no padding);
their new keys/values go to the slots their block tables name, and attention reads each
sequence's context from the pool (:mod:`kvopt.engine.kv.paged`). Logits are computed only at the
rows whose next token is sampled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

from kvopt.cache import attention_math
from kvopt.engine.kv.paged import PagedCache, PagedKVPool, StepPlan
from kvopt.engine.scheduler import ScheduledBatch
from kvopt.models.forward import cache_kwargs
from kvopt.models.info import ModelInfo
from kvopt.models.lean_forward import in_row_slices, lean_forward_for


class ModelRunner:
    def __init__(self, model, info: ModelInfo, num_blocks: int, block_size: int) -> None:
        from kvopt.cache.attention import prepare

        prepare(model)
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.pool = PagedKVPool(info, num_blocks, block_size, dtype, self.device)
        self.cache = PagedCache(self.pool, info)
        self.num_kv_heads = info.num_kv_heads
        #: Decoding sequences attend through the CPU decode kernel (built here, at start, on a first run).
        self.decode_kernel = attention_math.decode_kernel_serves(self.device, dtype, info.num_heads, info.num_kv_heads,
                                                                 info.head_dim)  # fmt: skip
        self.mlp_rows = MLP_ROWS if self.device.type == "cpu" else None
        #: The llama-shaped families' forward without HF's per-op layer code (None: HF's forward serves).
        self.lean = lean_forward_for(model, self.mlp_rows)
        self.attends = [layer.attend_step for layer in self.cache.layers]
        decoder = model.get_decoder()
        self.mlps = [layer.mlp for layer in decoder.layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]

    # -- the swapper the scheduler uses in swap mode ------------------------------------------
    def swap_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        return self.pool.read_blocks(block_ids)

    def swap_in(self, saved: list[torch.Tensor], block_ids: list[int]) -> None:
        self.pool.write_blocks(saved, block_ids)

    # -- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, copies: list[tuple[int, int]]) -> torch.Tensor:
        """Compute the batch's tokens; returns fp32 logits in batch order: for each sequence that samples, one row
        per draft plus one (``[rows, vocab]``).

        Each sequence's KV object lays its tokens into the per-step context (:meth:`SequenceKV.plan`); those
        that compute theirs alone this step (a prompt run as ``generate`` runs it) do so beside the batch.
        """
        self.pool.copy_blocks(copies)
        plan = StepPlan(self.pool, self.device)
        ids, positions, logit_rows = [], [], []
        #: For each sequence that samples: its rows among the batch's logits, or its own logits.
        sampled: list[int | torch.Tensor] = []
        row = 0
        for index, (seq, count) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if not seq.kv.plan(plan, seq, row, count):
                logits = plan.alone[-1].compute()
                if batch.samples(index):
                    sampled.append(logits)
                continue
            first = seq.num_computed_tokens
            ids.extend(seq.step_token_ids(count))
            positions.extend(range(first, first + count))
            if batch.samples(index):  # the newest token's row, and each draft's (verification reads them all)
                logit_rows.extend(range(row + count - 1 - len(seq.draft_token_ids), row + count))
                sampled.append(len(seq.draft_token_ids) + 1)
            row += count
        if not ids:
            return torch.cat(sampled)
        self.cache.batch = plan.build(row, attention_math.decode_pieces(self.num_kv_heads), self.decode_kernel)
        try:
            logits = self._forward(ids, positions, logit_rows).float()
        finally:
            self.cache.batch = None
        if not plan.alone:
            return logits
        rows = iter(logits.split([n for n in sampled if isinstance(n, int)]))
        return torch.cat([next(rows) if isinstance(n, int) else n for n in sampled])

    def _forward(self, ids: list[int], positions: list[int], logit_rows: list[int]) -> torch.Tensor:
        """The model over the step's flattened tokens (the per-step context set on the cache): ``[rows, vocab]``."""
        device = self.device
        rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        if self.lean is not None:
            ids_tensor, positions_tensor = torch.tensor(ids, device=device), torch.tensor(positions, device=device)
            return self.lean(ids_tensor, positions_tensor, self.attends, rows)
        with self._mlps_in_row_slices(len(ids)):
            output = self.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                **cache_kwargs(self.model, self.cache),
                use_cache=True,
                logits_to_keep=rows,
            )
        return output.logits[0]

    @contextmanager
    def _mlps_in_row_slices(self, tokens: int) -> Iterator[None]:
        """Run every decoder layer's MLP over at most ``mlp_rows`` tokens at a time during this step.

        A step holds up to ``max_num_batched_tokens`` tokens; on a CPU the MLP's activations for
        4,096 of them (4 tensors of 25 MB at width 1,536) spill out of the caches, and the MLPs ran
        ~25% slower than over 1,024-token slices (measured, 2 threads; prefill throughput +7%).
        An MLP acts on each token alone, so slicing the rows changes where the work runs, not what
        it computes. Only inside the engine's step: ``generate`` on the same model is untouched.
        """
        if self.mlp_rows is None or tokens <= self.mlp_rows:
            yield
            return
        for mlp in self.mlps:
            mlp.forward = partial(in_row_slices, type(mlp).forward.__get__(mlp), self.mlp_rows)
        try:
            yield
        finally:
            for mlp in self.mlps:
                del mlp.forward

#: Most tokens an MLP computes at once in an engine step on a CPU (see ``ModelRunner._mlps_in_row_slices``).
MLP_ROWS = 1024
