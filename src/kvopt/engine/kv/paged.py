"""Paged KV storage: one preallocated pool per layer, addressed by slots, read through block tables.

The pool holds ``num_blocks * block_size`` token slots per layer as ``[kv_heads, slots,
head_dim]`` tensors (PagedAttention's layout with the head axis first, so a run of slots is a
strided view ``[kv_heads, tokens, head_dim]`` that attention reads without a copy). Which
slots belong to which sequence is the engine's business: before each forward pass it sets a
:class:`PagedBatch` (the per-step context) on the :class:`PagedCache`, and every layer's
attention call writes the step's new keys/values to their slots and attends each sequence
over its own slots. Sequences of different lengths share the step as one flattened ragged
batch (no padding to the longest) and attend one by one, each over views of its runs of
consecutive slots: on a CPU this reads the keys in place, where gathering every sequence's
blocks into one padded batch copied them first (measured: 5 ms vs 35-50 ms per layer for 48
decoding sequences of 150-1,100 tokens). Parts read separately (runs, a chunk's own new
keys) are merged exactly through their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from kvopt.cache import attention_math
from kvopt.cache.seam_layer import SeamLayer
from kvopt.errors import CacheUsageError
from kvopt.models.info import ModelInfo

if TYPE_CHECKING:
    from kvopt.engine.kv.compressed import CodedTokens, CompressedStep



@dataclass(slots=True)
class SequenceSlots:
    """Where one sequence of the step sits: its query rows and the slots of its context."""

    #: Rows ``first:end`` of the flattened batch: the newest ``end - first`` tokens of the context.
    first: int
    end: int
    #: Maximal runs ``(start, stop)`` of consecutive slots holding the whole context, in sequence order.
    runs: list[tuple[int, int]]
    #: The context read from the pool (all of it for one query; for a chunk, the tokens before it):
    #: its longest run, read in place, and the slots of its other runs, gathered (None if none).
    main: tuple[int, int] = (0, 0)
    rest: torch.Tensor | None = None
    #: Quantized groups a compressed sequence also attends to (in code blocks), if any.
    codes: CodedTokens | None = None

    @classmethod
    def of(
        cls, first: int, end: int, runs: list[tuple[int, int]], device, codes: CodedTokens | None = None
    ) -> SequenceSlots:  # fmt: skip
        queries = end - first
        stored = runs if queries == 1 else _first_tokens(runs, sum(b - a for a, b in runs) - queries)
        main = max(stored, key=lambda run: run[1] - run[0], default=(0, 0))
        others = [run for run in stored if run is not main]
        rest = slots_of(others, device) if others else None
        return cls(first, end, runs, main, rest, codes)

    @property
    def fresh(self) -> bool:
        """A compressed prompt: nothing of it is in the pool, it attends only to its own new keys."""
        return not self.runs

    @property
    def context_length(self) -> int:
        return sum(stop - start for start, stop in self.runs)

    def window(self, tokens: int, device) -> SequenceSlots:
        """The same sequence restricted to its last ``tokens`` context tokens (a sliding-window layer)."""
        return SequenceSlots.of(self.first, self.end, last_tokens(self.runs, tokens), device)


@dataclass(slots=True)
class DecodeGroup:
    """The step's single-query sequences, prepared for one batched pass over their scattered tails."""

    #: Index of each into ``PagedBatch.sequences`` and its row in the flattened batch, ``[S]``.
    members: list[int]
    rows: torch.Tensor
    #: Each one's longest run, cut into ``pieces`` equal consecutive views: ``(first slot, piece length)``.
    spans: list[tuple[int, int]]
    pieces: int
    #: Slots of each one's context outside those pieces (other runs, and the run's last ``length % pieces``
    #: slots), left-aligned and padded, ``[S, longest tail]``, and which are real ``[S, 1, 1, longest tail]``;
    #: None when nothing is left over.
    rest: torch.Tensor | None
    rest_valid: torch.Tensor | None
    #: Members (positions in ``members``) that also attend over quantized groups, and those groups read together
    #: (:meth:`~kvopt.engine.kv.compressed.CodedTokens.batches`: by code format and similar length).
    coded: list[tuple[list[int], CodedTokens]] = field(default_factory=list)
    #: Instead of spans and tails, for the CPU decode kernel (:func:`~kvopt.cache.attention_math.decode_over_runs`):
    #: every member's runs of slots ``[R, 2]`` and where each member's start ``[S + 1]``.
    runs: torch.Tensor | None = None
    run_offsets: torch.Tensor | None = None
    #: With one batch of ``coded`` groups the kernel reads: every member's groups ``(blocks, records [S, G], counts
    #: [S])`` (0 for the members without), read in the same call as its slots.
    code_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, sequences: list[SequenceSlots], device, pieces: int = 1, over_runs: bool = False) -> DecodeGroup | None:
        """The step's decoding sequences, read as ``pieces`` views of each one's longest run plus a gathered tail
        (PyTorch's flash kernel), or ``over_runs`` (the CPU decode kernel reads every run in place)."""
        members = [i for i, seq in enumerate(sequences) if seq.end - seq.first == 1 and not seq.fresh]
        if not members:
            return None
        coded = []
        with_codes = [position for position, i in enumerate(members) if sequences[i].codes is not None]
        if with_codes and torch.device(device).type == "cpu":  # where the batched pass runs (cpu_flash_available)
            codes = [sequences[members[position]].codes for position in with_codes]
            batches = type(codes[0]).batches(codes)  # their class: kv/compressed.py imports this module
            coded = [([with_codes[index] for index in indices], batch) for indices, batch in batches]
        rows = torch.tensor([sequences[i].first for i in members], device=device)
        if over_runs:
            runs = [run for i in members for run in sequences[i].runs]
            offsets = [0]
            for i in members:
                offsets.append(offsets[-1] + len(sequences[i].runs))
            table = torch.tensor(runs, dtype=torch.long).view(-1, 2)  # read on the CPU, where the kernel runs
            return cls(members, rows, [], 1, None, None, coded, table, torch.tensor(offsets, dtype=torch.long),
                       _code_rows(coded, len(members)))  # fmt: skip
        spans, tails = [], []
        for i in members:
            (start, stop), tail = sequences[i].main, sequences[i].rest
            length = (stop - start) // pieces
            spans.append((start, length))
            if start + length * pieces < stop:
                left = torch.arange(start + length * pieces, stop, device=device)
                tail = left if tail is None else torch.cat([tail, left])
            tails.append(tail)
        longest = max((t.numel() for t in tails if t is not None), default=0)
        if not longest:
            return cls(members, rows, spans, pieces, None, None, coded)
        # padding reads a slot of the member's own context: masked keys weigh 0, but 0 x a stale NaN in a slot no
        # sequence owns (what padding with slot 0 read) is NaN
        own_slot = [sequences[i].main[0] if tail is None else int(tail[0]) for i, tail in zip(members, tails)]
        rest = torch.tensor(own_slot, dtype=torch.long, device=device)[:, None].repeat(1, longest)
        valid = torch.zeros(len(members), 1, 1, longest, dtype=torch.bool, device=device)
        for index, tail in enumerate(tails):
            if tail is not None:
                rest[index, : tail.numel()] = tail
                valid[index, ..., : tail.numel()] = True
        return cls(members, rows, spans, pieces, rest, valid, coded)


def _code_rows(coded: list[tuple[list[int], CodedTokens]], members: int) -> tuple[torch.Tensor, ...] | None:
    """Where every member's quantized groups lie, for one kernel call with its slots: the one batch of ``coded``
    groups scattered to the members' rows (None: no groups, groups of several formats, or a layout the kernel does
    not read)."""
    if len(coded) != 1:
        return None
    positions, codes = coded[0]
    rows = codes.group_rows()  # where the groups lie is the same in every layer
    if rows is None or positions == list(range(members)):
        return rows
    index = torch.tensor(positions)
    blocks = torch.zeros(members, rows[0].shape[1], dtype=torch.long)
    records, counts = torch.zeros_like(blocks), torch.zeros(members, dtype=torch.long)
    blocks[index], records[index], counts[index] = rows
    return blocks, records, counts


@dataclass(slots=True)
class PagedBatch:
    """What attention needs to know about one step (vLLM's attention metadata)."""

    #: Slot of every new token of the flattened batch that is stored as computed, ``[stored tokens]`` int64.
    slot_mapping: torch.Tensor
    #: Sequences attended over their slots in the pool (lossless, and compressed ones' kept tokens).
    sequences: list[SequenceSlots] = field(default_factory=list)
    decodes: DecodeGroup | None = None
    #: Rows of the flattened batch ``slot_mapping`` stores (None: all): a compressed prompt's rows go
    #: to its methods instead (see :mod:`kvopt.engine.kv.compressed`).
    stored_rows: torch.Tensor | None = None
    #: Sequences whose methods act on what attention read from the pool, after it (:class:`CompressedStep`).
    compressed: list[CompressedStep] = field(default_factory=list)
    #: Sequences that store and attend themselves: ``attend(layer, module, query, key, value, scaling,
    #: sliding_window, softcap)`` over their rows ``first:end`` (head blocks, their own caches).
    own: list = field(default_factory=list)
    #: Whether every layer's attention is one CPU-kernel call that also stores the step's keys and values: every row
    #: is one pool-attending sequence's next token, in order, and the kernel reads their runs (decided once a step).
    kernel_writes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.kernel_writes = self.only_decodes and self.decodes.runs is not None

    @property
    def only_decodes(self) -> bool:
        """Whether the step's rows are exactly its decode group's, one per sequence in order (a pure decode step
        of pool-attending sequences: attention's output needs no scattering)."""
        return (
            self.decodes is not None and len(self.decodes.members) == len(self.sequences)
            and not self.compressed and not self.own and self.stored_rows is None
        )  # fmt: skip


@dataclass
class StepPlan:
    """The step's flattened batch as its sequences' KV objects lay it out (:meth:`SequenceKV.plan`)."""

    pool: PagedKVPool
    device: torch.device
    new_slots: list[torch.Tensor] = field(default_factory=list)
    stored_rows: list[int] = field(default_factory=list)
    sequences: list[SequenceSlots] = field(default_factory=list)
    compressed: list[CompressedStep] = field(default_factory=list)
    own: list = field(default_factory=list)
    #: Sequences computing their tokens outside the batch this step (``compute() -> logits [1, vocab]``).
    alone: list = field(default_factory=list)

    def runs(self, block_table: list[int], tokens: int) -> list[tuple[int, int]]:
        """Maximal runs of consecutive slots holding a sequence's first ``tokens`` tokens, in order."""
        size, runs = self.pool.block_size, []
        for index, block in enumerate(block_table[: -(-tokens // size)]):
            stop = block * size + min(size, tokens - index * size)
            if runs and runs[-1][1] == block * size:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((block * size, stop))
        return runs

    def store_new(self, runs: list[tuple[int, int]], row: int, count: int) -> None:
        """The rows ``row ... row + count - 1`` are stored in the last ``count`` slots of ``runs``."""
        self.new_slots.append(slots_of(last_tokens(runs, count), "cpu"))  # one copy to the device in build()
        self.stored_rows.extend(range(row, row + count))

    def build(self, rows: int, pieces: int, over_runs: bool = False) -> PagedBatch:
        """The per-step context of a batch of ``rows`` tokens (decodes cut into ``pieces`` per sequence, or read
        ``over_runs`` by the CPU decode kernel)."""
        device = self.device
        empty = torch.zeros(0, dtype=torch.long, device=device)
        slot_mapping = torch.cat(self.new_slots).to(device) if self.new_slots else empty
        all_stored = len(self.stored_rows) == rows
        stored = None if all_stored else torch.tensor(self.stored_rows, dtype=torch.long, device=device)
        decodes = DecodeGroup.of(self.sequences, device, pieces, over_runs)
        return PagedBatch(slot_mapping, self.sequences, decodes, stored, self.compressed, self.own)


class PagedKVPool:
    """Keys and values of every layer for ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, info: ModelInfo, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        # One tensor for all layers, seen per layer (``keys[layer]``) and flattened to rows of one head and
        # slot (``flat_keys``), where head blocks of any layer are gathered at once (:mod:`.headwise`).
        shape = (info.num_layers, info.num_kv_heads, num_blocks * block_size, info.head_dim)
        # Keys and values in one tensor, also seen as byte *chunks* (one block of one head in one layer's key or
        # value pool, ``2 x layers x kv_heads`` of them per block), where a sequence's own cache waits between
        # steps (:mod:`.at_rest`).
        storage = torch.zeros((2, *shape), dtype=dtype, device=device)
        all_keys, all_values = storage.unbind(0)
        self.keys, self.values = list(all_keys.unbind(0)), list(all_values.unbind(0))
        self.flat_keys, self.flat_values = all_keys.view(-1, info.head_dim), all_values.view(-1, info.head_dim)
        self.chunks = storage.view(-1, block_size * info.head_dim).view(torch.uint8)
        self.chunks_per_block = 2 * info.num_layers * info.num_kv_heads

    def chunk_rows(self, block_ids: list[int], count: int) -> torch.Tensor:
        """Rows of :attr:`chunks` for the first ``count`` chunks of ``block_ids``, block by block."""
        blocks = torch.tensor(block_ids[: -(-count // self.chunks_per_block)], dtype=torch.long)
        within = torch.arange(self.chunks_per_block, dtype=torch.long) * self.num_blocks
        return (blocks[:, None] + within[None, :]).flatten()[:count].to(self.chunks.device)

    @staticmethod
    def block_bytes(info: ModelInfo, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * info.num_layers * info.num_kv_heads * block_size * info.head_dim * element

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        """Every slot of ``block_ids``, in order, ``[blocks * block_size]`` int64."""
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)).flatten()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each source block's slots into its destination block, in every layer (copy-on-write)."""
        if not pairs:
            return
        sources = self.block_slots([s for s, _ in pairs])
        destinations = self.block_slots([d for _, d in pairs])
        for tensor in (*self.keys, *self.values):
            tensor[:, destinations] = tensor[:, sources]

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The blocks' contents, copied to host memory (swap out)."""
        slots = self.block_slots(block_ids)
        return [tensor[:, slots].to("cpu") for tensor in (*self.keys, *self.values)]

    def write_blocks(self, saved: list[torch.Tensor], block_ids: list[int]) -> None:
        """Put contents read by :meth:`read_blocks` into ``block_ids`` (swap in)."""
        slots = self.block_slots(block_ids)
        for tensor, data in zip((*self.keys, *self.values), saved):
            tensor[:, slots] = data.to(tensor.device)


class PagedLayer(SeamLayer):
    """One layer's view of the pool; its attention call serves every sequence of the step."""

    def __init__(self, cache: PagedCache, index: int) -> None:
        super().__init__()  # ``seen`` stays 0: positions come per sequence with the step, not from the cache
        self.cache, self.index = cache, index

    def attend(self, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Write the step's keys/values to their slots, then attend each sequence over its context.

        ``query [1, heads, tokens, dim]`` (the flattened batch); returns ``[1, tokens, heads, dim]``.
        """
        if self.cache.batch is None or padding is not None:
            raise CacheUsageError("a paged KV cache is driven by the kvopt engine (kvopt.LLM), not called directly")
        self.take_parked(value)
        token_major = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
        return self.attend_step(module, *token_major, scaling, sliding_window, softcap)

    def attend_step(self, module, query, key, value, scaling, sliding_window, softcap) -> torch.Tensor:
        """The step's attention in this layer, from ``query [tokens, heads, dim]`` and ``key``/``value``
        ``[tokens, kv_heads, dim]`` (token-major, as the projections lay them out: the engine's lean forward
        calls this directly, :meth:`attend` once HF's seam has handed the tensors over); returns
        ``[1, tokens, heads, dim]``."""
        batch = self.cache.batch
        pool = self.cache.pool
        keys, values = pool.keys[self.index], pool.values[self.index]
        plain = softcap is None and sliding_window is None  # the batched decode path's assumptions
        if batch.kernel_writes and plain:  # the kernel stores the step's tokens and attends in one call
            return _attend_decodes(query, keys, values, batch, scaling, self.index, (key, value, batch.slot_mapping))[None]
        batched = batch.decodes is not None and plain and attention_math.cpu_flash_available(query)
        stored_keys, stored_values = key, value
        if batch.stored_rows is not None:
            stored_keys, stored_values = key.index_select(0, batch.stored_rows), value.index_select(0, batch.stored_rows)
        keys.index_copy_(1, batch.slot_mapping, stored_keys.transpose(0, 1))
        values.index_copy_(1, batch.slot_mapping, stored_values.transpose(0, 1))
        if batched and batch.only_decodes:  # every row is one sequence's next token, in order
            return _attend_decodes(query, keys, values, batch, scaling, self.index)[None]
        decoded = _attend_decodes(query, keys, values, batch, scaling, self.index) if batched else None
        # the per-sequence paths read HF's head-major layout, [1, heads, tokens, dim]
        query, key, value = (tensor.transpose(0, 1)[None] for tensor in (query, key, value))
        output = query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])
        done = set()
        if decoded is not None:
            output[0, batch.decodes.rows] = decoded
            done.update(batch.decodes.members)
        for index, seq in enumerate(batch.sequences):
            if index in done:
                continue
            rows = slice(seq.first, seq.end)
            if seq.end - seq.first == 1 and not seq.fresh:
                output[:, seq.first] = _attend_one(query[:, :, rows], keys, values, seq, scaling, sliding_window, softcap,
                                                   self.index)  # fmt: skip
            elif sliding_window is None:
                output[:, rows] = _attend_chunk(query[:, :, rows], key[:, :, rows], value[:, :, rows], keys, values,
                                                seq, scaling, softcap)  # fmt: skip
            else:
                output[:, rows] = _attend_windowed_chunk(query[:, :, rows], keys, values, seq, scaling, sliding_window,
                                                         softcap)  # fmt: skip
        for step in batch.compressed:  # a decode step's tokens are read from its slots only if a method acts
            rows = slice(step.first, step.end)
            new = (key[:, :, rows], value[:, :, rows]) if step.is_prefill else (None, None)
            step.kv.after_attention(self.index, module, pool, step, query[:, :, rows], *new, scaling)
        for step in batch.own:
            rows = slice(step.first, step.end)
            output[:, rows] = step.attend(self.index, module, query[:, :, rows], key[:, :, rows], value[:, :, rows],
                                          scaling, sliding_window, softcap)  # fmt: skip
        return output


def read_runs(pool_tensor: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``[1, kv_heads, tokens, dim]`` of the slots in ``runs``: a view when they are one run, else a copy."""
    if len(runs) == 1:
        return pool_tensor[None, :, runs[0][0] : runs[0][1]]
    return pool_tensor[None].index_select(2, slots_of(runs, pool_tensor.device))


def _attend_stored(query, keys, values, seq: SequenceSlots, scaling, softcap) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(output, lse)`` parts of ``query`` over the stored context it sees whole (no mask): the
    longest run read in place, the other runs (blocks allocated later, elsewhere) gathered."""
    start, stop = seq.main
    pieces = [(keys[None, :, start:stop], values[None, :, start:stop])] if stop > start else []
    if seq.rest is not None:
        pieces.append((keys[None].index_select(2, seq.rest), values[None].index_select(2, seq.rest)))
    return [attention_math.attention_with_lse(query, k, v, None, scaling, softcap) for k, v in pieces]


def _attend_decodes(query, keys, values, batch: PagedBatch, scaling, layer: int, written=None) -> torch.Tensor:
    """Every single-query sequence at once, compressed ones' quantized groups (layer ``layer``) included: ``[S, heads, dim]``
    from the step's token-major ``query [tokens, heads, dim]``; ``written`` (the CPU kernel's path only): the step's
    ``(keys, values, slots)`` for the kernel to store first."""
    group = batch.decodes
    heads, dim = query.shape[1], query.shape[-1]
    count, kv_heads = len(group.members), keys.shape[0]
    scale = attention_math.default_scale(query, scaling)
    # [S, heads, dim] (``query`` is token-major: a pure decode step's rows are all its members)
    stored = query if query.shape[0] == count else query.index_select(0, group.rows)
    if group.runs is not None:
        groups = None
        if group.code_rows is not None:  # the members' quantized groups in the same call
            codes = group.coded[0][1]
            groups = attention_math.GroupRecords(*codes.record_pools(layer), *group.code_rows,
                                                 codes.code_format.kernel_layout)  # fmt: skip
        output, lse = attention_math.decode_over_runs(stored, keys, values, group.runs, group.run_offsets, scale,
                                                      groups, written)  # fmt: skip
        if groups is not None or not group.coded:
            return output.to(query.dtype)
        output, lse = output[:, None], lse[:, None]
    else:
        output, lse = _flash_decode_parts(stored, keys, values, group, scale)
        if output.shape[1] == 1 and not group.coded:  # one part per sequence: nothing to merge
            return output[:, 0].to(query.dtype)
        output, lse = output.float(), lse
    if group.coded:  # one more piece: the coded members' groups, nothing for the others
        queries = stored.float()
        piece, piece_lse = output.new_zeros(count, heads, dim), lse.new_full((count, heads), float("-inf"))
        for positions, codes in group.coded:
            out, out_lse = codes.attend(layer, queries[positions, :, None], scale, None)
            piece[positions], piece_lse[positions] = out[:, :, 0], out_lse[:, :, 0]
        output = torch.cat([output, piece[:, None]], dim=1)
        lse = torch.cat([lse, piece_lse[:, None]], dim=1)
    if output.shape[1] == 1:
        return output[:, 0].to(query.dtype)
    merged, _ = attention_math.merge_pieces(output, lse, axis=1)
    return merged.to(query.dtype)


def _flash_decode_parts(stored, keys, values, group: DecodeGroup, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' attention over their pool slots through PyTorch's flash kernel, as parts to merge:
    ``[S, parts, heads, dim]`` (the model's dtype) and their log-sum-exp ``[S, parts, heads]``.

    Per sequence one flash call over its longest run, read in place and cut into
    ``group.pieces`` views that the kernel's threads share (its work units are batch x KV
    heads: 3 KV heads on 2 threads left one idle half the time; as 2 pieces the same keys
    ran ~15% faster, measured); then one call over all the tails (the blocks each allocated
    later, gathered and padded together), instead of a dozen small ops per sequence and layer.
    """
    count, heads, dim = stored.shape
    kv_heads, pieces = keys.shape[0], group.pieces
    # the flash kernel reads the pool in its own dtype (bf16 accumulates in fp32 inside): converting each
    # sequence's keys first cost more than the attention itself at a few hundred tokens (measured)
    folded = stored.to(keys.dtype).reshape(count, kv_heads, heads // kv_heads, dim)
    member_queries = folded.split(1) if pieces == 1 else [q.expand(pieces, -1, -1, -1) for q in folded.split(1)]
    nothing = None  # (output, lse) of a run too short to cut into pieces: all its slots are in the tail
    outputs, lses = [], []
    for member_query, (start, length) in zip(member_queries, group.spans):
        if not length:
            if nothing is None:
                empty_lse = stored.new_full((pieces, *folded.shape[1:3]), float("-inf"), dtype=torch.float32)
                nothing = (folded.new_zeros(pieces, *folded.shape[1:]), empty_lse)
            out, lse = nothing
        else:
            run_keys, run_values = _run_pieces(keys, start, length, pieces), _run_pieces(values, start, length, pieces)
            out, lse = attention_math.cpu_flash(member_query, run_keys, run_values, scale)
        outputs.append(out)
        lses.append(lse)
    output = torch.stack(outputs).reshape(count, pieces, heads, dim)
    lse = torch.stack(lses).reshape(count, pieces, heads)
    if group.rest is None:
        return output, lse
    tail_keys = keys.index_select(1, group.rest.flatten()).view(kv_heads, *group.rest.shape, dim).transpose(0, 1)
    tail_values = values.index_select(1, group.rest.flatten()).view(kv_heads, *group.rest.shape, dim).transpose(0, 1)
    tail, tail_lse = attention_math.attention_with_lse(stored.float()[:, :, None], tail_keys, tail_values,
                                                       group.rest_valid, scale)  # fmt: skip
    output = torch.cat([output.float(), tail[:, None, :, 0]], dim=1)
    return output, torch.cat([lse, tail_lse[:, None, :, 0]], dim=1)


def _run_pieces(pool_tensor: torch.Tensor, start: int, length: int, pieces: int) -> torch.Tensor:
    """``[pieces, kv_heads, length, dim]`` views of the ``pieces * length`` slots from ``start`` (one view op when whole:
    this runs per sequence and layer)."""
    if pieces == 1:
        return pool_tensor[None, :, start : start + length]
    return pool_tensor[:, start : start + length * pieces].unflatten(1, (pieces, length)).transpose(0, 1)


def _attend_one(query, keys, values, seq: SequenceSlots, scaling, sliding_window, softcap, layer: int) -> torch.Tensor:
    """One query over its whole context (all of it visible, but for a sliding window's limit), a compressed
    sequence's quantized groups in layer ``layer`` included: ``[1, heads, dim]``."""
    if sliding_window is not None and seq.context_length > sliding_window:
        seq = seq.window(sliding_window, keys.device)
    parts = _attend_stored(query, keys, values, seq, scaling, softcap)
    if seq.codes is not None:
        scale = attention_math.default_scale(query, scaling)
        parts.append(seq.codes.attend(layer, query, scale, softcap))
    output, _ = attention_math.merge_with_lse(parts)
    return output[:, :, 0].to(query.dtype)


def _attend_chunk(query, new_keys, new_values, keys, values, seq: SequenceSlots, scaling, softcap) -> torch.Tensor:
    """A prefill chunk: every query sees all earlier tokens (in the pool) and the chunk's own keys causally.

    The two are attended separately and merged by log-sum-exp, so neither the context is
    gathered nor a mask over it built; a chunk with no earlier context (a whole prompt; a
    compressed prompt, whose tokens go to its methods, not its slots) is one causal SDPA call,
    as HF computes it. Returns ``[1, queries, heads, dim]``.
    """
    count = query.shape[2]
    own = torch.arange(count, device=query.device)
    if seq.fresh or seq.context_length == count:
        return attention_math.attend(query, new_keys, new_values, own[None, None], None, own, scaling, None, softcap)
    parts = _attend_stored(query, keys, values, seq, scaling, softcap)
    parts.append(attention_math.causal_attention_with_lse(query, new_keys, new_values, scaling, softcap))
    output, _ = attention_math.merge_with_lse(parts)
    return output.to(query.dtype).transpose(1, 2)


def _attend_windowed_chunk(query, keys, values, seq: SequenceSlots, scaling, sliding_window, softcap) -> torch.Tensor:
    """A prefill chunk of a sliding-window layer: each query has its own window, so the context is
    gathered whole and masked by positions. Returns ``[1, queries, heads, dim]``."""
    index = slots_of(seq.runs, keys.device)
    context_keys, context_values = keys[None].index_select(2, index), values[None].index_select(2, index)
    tokens = context_keys.shape[2]
    positions = torch.arange(tokens, device=query.device)
    return attention_math.attend(
        query, context_keys, context_values, positions[None, None], None, positions[tokens - query.shape[2] :],
        scaling, sliding_window, softcap,
    )  # fmt: skip


def _first_tokens(runs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The runs holding the first ``count`` tokens."""
    kept = []
    for start, stop in runs:
        if count <= 0:
            break
        take = min(count, stop - start)
        kept.append((start, start + take))
        count -= take
    return kept


def slots_of(runs: list[tuple[int, int]], device: torch.device | str) -> torch.Tensor:
    """The slots of ``runs``, in order, ``[tokens]`` int64."""
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in runs])


def last_tokens(runs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The runs holding the last ``count`` tokens."""
    kept = []
    for start, stop in reversed(runs):
        take = min(count, stop - start)
        kept.append((stop - take, stop))
        count -= take
        if not count:
            break
    return kept[::-1]


class PagedCache(Cache):
    """The ``past_key_values`` the engine passes to the model: the pool plus the current step's batch."""

    def __init__(self, pool: PagedKVPool, info: ModelInfo) -> None:
        self.pool = pool
        self.batch: PagedBatch | None = None
        super().__init__(layers=[PagedLayer(self, index) for index in range(info.num_layers)])
