"""Compressed sequences in the paged pool: methods run unchanged, what they keep takes fewer blocks.

A sequence served with a compressing spec (``snapkv:ratio=0.75``, ``h2o:budget=256``,
``kivi:bits=4``, ``snapkv:ratio=0.75+kivi:bits=4``, ...) keeps two tables of blocks:

- **full-precision blocks**: its stored tokens, *compacted*: stored token ``j`` sits at slot
  ``j`` of the table, and heads that kept different tokens (per-head selection) hold them at
  the same slot. Decode attention sees every stored token, so it needs no positions and reads
  these blocks exactly as it reads a lossless sequence's (in place, batched with the others).
- **code blocks**: whole quantization groups of bit-packed keys/values with their fp16
  scales and zero-points, several groups per block (:class:`CodeFormat`), dequantized by
  :class:`~kvopt.cache.quantized.QuantizedKV` at read time.

After each attention call of each layer, the engine shows the sequence's tokens to the
spec's methods as a one-sequence :class:`~kvopt.cache.layer.KVLayer` over views of the pool
(:meth:`CompressedKV.after_attention`) and the methods act exactly as they do in
``model.generate``: they evict (the survivors are written back compacted), quantize whole
groups (written into code blocks), and keep their per-token scores and per-layer state here
between steps. Blocks a step empties go back to the pool, so the pool holds as many more
sequences as the method compresses.

A prompt is computed in one pass and never stored in full: each layer's new keys/values go
from the forward pass straight to the methods, and only what they keep is written to blocks
(the prefill peak is one layer of one prompt, not the whole prompt in every layer). Every
layer and head keeps the same number of tokens here (one block table serves all layers):
specs whose layers or heads get budgets of their own (pyramidkv, adakv) are served by
:mod:`kvopt.engine.kv.headwise`; methods that rank all layers together (kvzip, lava) and
cross-layer merging are not served yet (``Method.runs_in_engine``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvopt.cache import attention_math, quant
from kvopt.cache.attention_math import GroupRecords
from kvopt.cache.layer import AttentionStep, KVLayer
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.storage import DenseKVStore
from kvopt.engine.kv.base import table_fill
from kvopt.engine.kv.paged import SequenceSlots, read_runs
from kvopt.errors import CacheUsageError
from kvopt.models.info import ModelInfo

if TYPE_CHECKING:
    from kvopt.engine.kv.paged import StepPlan

#: ``(shape after the group axis, dtype)`` of a quantized tensor's codes, scales and zero-points.
Fields = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class CodeFormat:
    """How whole quantization groups (all KV heads of one layer) are laid out in a block's bytes.

    A block holds ``block_size * head_dim`` elements of the model's dtype per KV head in the
    key pool and as many in the value pool; a group's key record (codes, scale, zero) goes to
    the key pool, its value record to the value pool, ``groups_per_block`` of each per block.
    """

    bits: int
    group: int
    key_mode: str
    dtype: torch.dtype
    block_size: int
    key_fields: Fields
    value_fields: Fields
    key_dim: int
    value_dim: int
    groups_per_block: int
    #: Bytes of one KV head in one block (``block_size * head_dim`` elements of the model's dtype).
    block_bytes: int

    @classmethod
    def probe(cls, info: ModelInfo, dtype: torch.dtype, block_size: int, bits: int, group: int, key_mode: str) -> CodeFormat:
        """The layout of ``bits``-bit groups of ``group`` tokens; raises when they cannot fill blocks."""
        heads, dim = info.num_kv_heads, info.head_dim
        zeros = torch.zeros(1, heads, group, dim, dtype=dtype, device="cpu")  # a layout, wherever the pool is
        positions = torch.arange(group, dtype=torch.int32, device="cpu").expand(1, heads, group)
        valid = torch.ones(1, heads, group, dtype=torch.bool, device="cpu")
        part = QuantizedKV.encode(zeros, zeros, positions, valid, bits, group, key_mode)
        key_fields, value_fields = _fields(part.keys), _fields(part.values)
        capacity = block_size * dim * torch.empty((), dtype=dtype).element_size()
        per_block = min(capacity // _record_bytes(key_fields), capacity // _record_bytes(value_fields))
        if group % block_size or per_block == 0:
            raise CacheUsageError(
                f"{bits}-bit groups of {group} tokens do not fit the engine's blocks of {block_size} tokens "
                f"({capacity} bytes per head); use a block_size that divides the group (e.g. block_size=16, group=32)"
            )
        return cls(bits, group, key_mode, dtype, block_size, key_fields, value_fields, part.keys.dim,
                   part.values.dim, per_block, capacity)  # fmt: skip

    def matches(self, part: QuantizedKV) -> bool:
        return (part.bits, part.group, part.key_mode) == (self.bits, self.group, self.key_mode)

    def records(self, pool: torch.Tensor, fields: Fields, word: torch.dtype = torch.uint8) -> torch.Tensor:
        """One layer's key or value pool ``[H, slots, D]`` as group records ``[H, blocks, groups_per_block, words]``
        of ``word`` (bytes by default)."""
        blocks = pool.view(torch.uint8).view(pool.shape[0], -1, self.block_bytes).view(word)
        size = _record_bytes(fields) // word.itemsize
        return blocks[:, :, : self.groups_per_block * size].unflatten(-1, (self.groups_per_block, size))

    @functools.cached_property
    def kernel_layout(self) -> list[int] | None:
        """Where the CPU decode kernel finds a group's fields in its records
        (:func:`kvopt.cache.attention_math.decode_over_codes`), or None for a layout it does not read: keys per
        channel, values per token in groups of a multiple of 16 channels, groups of a multiple of 16 tokens, fp16
        parameters."""
        rows = self.group * self.bits // 8
        dim = self.block_bytes // (self.block_size * torch.empty((), dtype=self.dtype).element_size())
        half = torch.float16
        keys = (((rows, dim), torch.uint8), ((1, dim), half), ((1, dim), half))
        if self.key_mode != "channel" or self.group % 16 or self.key_fields != keys or len(self.value_fields[0][0]) != 3:
            return None
        (_, channel_groups, channels), _ = self.value_fields[0]
        values = (((rows, channel_groups, channels), torch.uint8), ((self.group, channel_groups, 1), half),
                  ((self.group, channel_groups, 1), half))  # fmt: skip
        if self.value_fields != values or channels * channel_groups != dim or channels % 16:
            return None
        code_bytes = rows * dim
        key_scale, key_zero = code_bytes, code_bytes + 2 * dim
        value_scale = code_bytes
        value_zero = value_scale + 2 * self.group * channel_groups
        return [self.bits, self.group, channels, key_scale, key_zero, value_scale, value_zero,
                _record_bytes(self.key_fields), _record_bytes(self.value_fields), self.groups_per_block]  # fmt: skip

    def record_word(self, fields: Fields) -> torch.dtype:
        """The widest integer a record and a block split into: a gather of records moves words, not bytes (an
        int64 gather of 20 records took 66 us where the byte-wise one took 237 us, measured)."""
        return _widest_word(_record_bytes(fields), self.block_bytes)

    def blocks_for(self, groups: int) -> int:
        """Blocks that hold ``groups`` groups."""
        return -(-groups // self.groups_per_block)

    def locate(self, code_table: list[int], first: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Block and record index of groups ``first ... first + count - 1`` of a sequence with ``code_table``."""
        groups = torch.arange(first, first + count, device="cpu")  # from a Python table: one copy to the device
        blocks = torch.tensor(code_table, dtype=torch.long, device="cpu")[groups // self.groups_per_block]
        return blocks.to(device), (groups % self.groups_per_block).to(device)

    def write(self, pool, index: int, part: QuantizedKV, where: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Store ``part``'s groups (batch of one) at ``where`` in layer ``index``."""
        self.records(pool.keys[index], self.key_fields)[:, where[0], where[1]] = serialize(part.keys)
        self.records(pool.values[index], self.value_fields)[:, where[0], where[1]] = serialize(part.values)

    def read(self, pool, index: int, where: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor | None = None) -> QuantizedKV:
        """The groups at ``where`` in layer ``index`` as one quantized part: ``[G]`` indices for one sequence, or
        ``[S, G]`` for ``S`` sequences (a part of batch ``S``, ``valid [S, 1, G * group]`` False on the groups that
        pad the shorter ones). For one decoding query per sequence, which sees every group: positions say no more
        (a run from 0, or zeros beside ``valid``), so read it only for such a query."""
        blocks, records = (indices.reshape(-1, indices.shape[-1]) for indices in where)
        keys = self._gather(pool.keys[index], self.key_fields, self.key_dim, blocks, records)
        values = self._gather(pool.values[index], self.value_fields, self.value_dim, blocks, records)
        count, tokens = blocks.shape[0], blocks.shape[1] * self.group
        if valid is None:
            index_ = TokenIndex(tokens, count, blocks.device, start=0)
        else:
            positions = torch.zeros(count, 1, tokens, dtype=torch.int32, device=blocks.device)
            index_ = TokenIndex(tokens, count, blocks.device, None, positions, valid)
        return QuantizedKV(keys, values, index_, self.group, self.key_mode, self.dtype)

    def _gather(self, pool: torch.Tensor, fields: Fields, dim: int, blocks: torch.Tensor, records: torch.Tensor):
        """The records at ``blocks/records [S, G]`` of one layer's key or value pool as groups ``[S, H, G, ...]``."""
        word = self.record_word(fields)
        gathered = self.records(pool, fields, word)[:, blocks, records]  # [H, S, G, words]
        return deserialize(gathered.movedim(0, 1).view(torch.uint8), fields, self.bits, dim)  # each field copied once


@functools.cache
def _widest_word(*sizes: int) -> torch.dtype:
    """The widest integer type whose size divides every one of ``sizes`` (bytes)."""
    return next(word for word in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(size % word.itemsize == 0 for size in sizes))  # fmt: skip


def _fields(groups: quant.QuantizedGroups) -> Fields:
    return tuple((tuple(t.shape[3:]), t.dtype) for t in (groups.codes, groups.scale, groups.zero))


def _field_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _record_bytes(fields: Fields) -> int:
    return sum(_field_bytes(shape, dtype) for shape, dtype in fields)


def serialize(groups: quant.QuantizedGroups) -> torch.Tensor:
    """One sequence's groups ``[1, H, g, ...]`` as byte records ``[H, g, record bytes]`` (what a block holds;
    :func:`deserialize` reads them back with a leading sequence axis)."""
    heads, count = groups.codes.shape[1:3]
    tensors = (groups.codes, groups.scale, groups.zero)
    return torch.cat([t[0].reshape(heads, count, -1).contiguous().view(torch.uint8) for t in tensors], dim=-1)


def deserialize(records: torch.Tensor, fields: Fields, bits: int, dim: int) -> quant.QuantizedGroups:
    """Inverse of :func:`serialize` for ``S`` sequences at once: records ``[S, H, g, bytes]`` as groups ``[S, H, g, ...]``."""
    lead = records.shape[:-1]
    tensors, offset = [], 0
    for shape, dtype in fields:
        size = _field_bytes(shape, dtype)
        tensors.append(records[..., offset : offset + size].contiguous().view(dtype).reshape(*lead, *shape))
        offset += size
    return quant.QuantizedGroups(*tensors, bits, dim)


def kept_after_prefill(methods: list, tokens: int) -> int:
    """Tokens ``methods`` keep (on average over layers and heads) of a ``tokens``-token prompt, with the
    slack of decode-time methods that evict every few steps."""
    for method in methods:
        tokens = method.kept_tokens(tokens) + getattr(method, "compress_every", 1) - 1
    return tokens


@dataclass
class LayerMemo:
    """What one layer's methods keep for a sequence between steps, besides the tokens in its blocks."""

    #: Sequence index of each stored token ``[1, kv_heads, stored]``; None while they are a run from ``first_position``.
    positions: torch.Tensor | None = None
    first_position: int = 0
    heads_aligned: bool = True
    #: Per-token tensors of the methods (e.g. H2O's accumulated attention), ``[1, kv_heads, stored]``.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``KVLayer.state``: per-layer state of the methods (e.g. a budget fixed at the prefill).
    state: dict[str, object] = field(default_factory=dict)


@dataclass
class Layout:
    """Where a sequence's tokens sit after this step; decided by the first layer, followed by every other."""

    stored: int
    groups: int
    block_table: list[int]
    code_table: list[int]
    #: Blocks the sequence no longer needs (the engine returns them to the pool).
    freed: list[int]


@dataclass
class PromptState:
    """A compressed sequence right after its prompt's one-pass prefill, out of the pool (what a KV tier keeps).

    Its methods chose what to keep with the whole prompt in view (and kivi's groups of a prefix would
    be read by the rest of the prompt where a one-pass prefill reads full precision), so a part of it
    serves no other prompt: it is kept whole, with the last position's logits, and serves the same
    prompt again exactly, first token included.
    """

    stored: int
    groups: int
    #: Per layer: the kept full-precision keys and values ``[kv_heads, stored, head_dim]``.
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    #: Per layer: the quantized groups' key and value records ``[kv_heads, groups, record bytes]`` (uint8).
    key_records: list[torch.Tensor]
    value_records: list[torch.Tensor]
    memos: list[LayerMemo]
    #: fp32 logits of the prompt's last position ``[vocab]``: the first output token is sampled from them.
    logits: torch.Tensor


@dataclass
class CompressedStep:
    """One compressed sequence in the step (part of the per-step context)."""

    kv: CompressedKV
    #: Its query rows ``first:end`` of the flattened batch.
    first: int
    end: int
    #: Tokens computed before this step; whether this step is its prefill (one pass, nothing stored yet).
    computed: int
    is_prefill: bool
    #: Runs of slots holding its stored tokens, the new ones included (none at the prefill: they come
    #: straight from the forward pass).
    runs: list[tuple[int, int]]
    block_table: list[int]
    code_table: list[int]


class CompressedKV:
    """One sequence's compressed cache: counts, per-layer method state, and this step's layout."""

    shares_blocks: ClassVar[bool] = False
    keeps_prompt_state: ClassVar[bool] = True

    def __init__(self, methods: list, num_layers: int, block_size: int, code_format: CodeFormat | None) -> None:
        self.methods = methods
        self.num_layers = num_layers
        self.block_size = block_size
        self.code_format = code_format
        self.reset()

    def reset(self) -> None:
        """Forget everything (the sequence is recomputed from its tokens)."""
        self.memos = [LayerMemo() for _ in range(self.num_layers)]
        #: Full-precision tokens in the block table, and quantized groups in the code table.
        self.stored = 0
        self.groups = 0
        self.layout: Layout | None = None

    def reserve_tokens(self, tokens: int) -> int:
        """Slots (whole blocks) to give a prompt of ``tokens``: what its methods keep right after the
        prefill (an upper bound, decode-time methods' eviction slack included), quantized groups in code blocks."""
        tokens = kept_after_prefill(self.methods, tokens)
        quantizers = [method for method in self.methods if hasattr(method, "quantized_after_prefill")]
        quantized = quantizers[0].quantized_after_prefill(tokens) if quantizers else 0
        code_blocks = self._code_blocks(quantized // self.code_format.group if quantized else 0)
        return (-(-(tokens - quantized) // self.block_size) + code_blocks) * self.block_size

    def stored_tokens(self, computed: int) -> int:
        return self.stored

    def slots_needed(self, computed: int, new_tokens: int) -> int:
        """Slots the block table needs once ``new_tokens`` more tokens are stored."""
        return self.stored + new_tokens

    def held_blocks(self, seq, block_size: int) -> list[int]:
        """Its tables hold exactly its stored tokens and groups."""
        return seq.block_table + seq.code_table

    def filled_slots(self, seq, block_size: int) -> dict[int, int]:
        """Full-precision blocks by tokens; a block of quantized groups by the share of its records in use."""
        filled = table_fill(seq.block_table, self.stored, block_size)
        per_block = self.code_format.groups_per_block if self.code_format is not None else 1
        for index, block_id in enumerate(seq.code_table):
            filled[block_id] = block_size * min(per_block, self.groups - index * per_block) // per_block
        return filled

    def relocate(self, moved: dict[int, int]) -> None:
        """Blocks came back from a swap at new ids: nothing to do, block ids live only in the sequence's tables."""

    def nbytes(self, seq, block_bytes: int) -> int:
        return (-(-self.stored // self.block_size) + self._code_blocks(self.groups)) * block_bytes

    def _code_blocks(self, groups: int) -> int:
        """Blocks ``groups`` quantized groups take (a spec without a quantizer has none)."""
        return self.code_format.blocks_for(groups) if groups else 0

    # -- a prompt's state to and from a KV tier ---------------------------------------------------
    def snapshot(self, pool, block_table: list[int], code_table: list[int], logits: torch.Tensor) -> PromptState:
        """This sequence's state, copied out of the pool (right after its prefill); the memos are the live ones."""
        slots = pool.block_slots(block_table)[: self.stored]
        fmt, key_records, value_records = self.code_format, [], []
        if self.groups:
            block, record = fmt.locate(code_table, 0, self.groups, slots.device)
            key_records = [fmt.records(k, fmt.key_fields)[:, block, record] for k in pool.keys]
            value_records = [fmt.records(v, fmt.value_fields)[:, block, record] for v in pool.values]
        keys, values = [k[:, slots] for k in pool.keys], [v[:, slots] for v in pool.values]
        return PromptState(self.stored, self.groups, keys, values, key_records, value_records, self.memos, logits)

    def state_blocks(self, state: PromptState) -> int:
        """Blocks :meth:`install` needs for ``state``."""
        return -(-state.stored // self.block_size) + self._code_blocks(state.groups)

    def check_state(self, state: PromptState, pool) -> None:
        """Raise ValueError unless ``state`` fits this sequence's layers, heads and code format (a decoded
        tier entry is installed only after this)."""
        if not isinstance(state, PromptState) or state.stored < 0 or state.groups < 0:
            raise ValueError("not a prompt state")
        heads, dim, dtype, fmt = pool.keys[0].shape[0], pool.keys[0].shape[-1], pool.keys[0].dtype, self.code_format
        if {len(state.keys), len(state.values), len(state.memos)} != {self.num_layers}:
            raise ValueError(f"{len(state.keys)} layers, the model has {self.num_layers}")
        if any(t.shape != (heads, state.stored, dim) or t.dtype != dtype for t in (*state.keys, *state.values)):
            raise ValueError("keys or values of another shape or dtype")
        if state.groups and fmt is None:
            raise ValueError("quantized groups for a spec without a quantizer")
        for records, fields in ((state.key_records, fmt and fmt.key_fields), (state.value_records, fmt and fmt.value_fields)):
            layers = self.num_layers if state.groups else 0
            shape = (heads, state.groups, _record_bytes(fields)) if fields else None
            if len(records) != layers or any(t.shape != shape or t.dtype != torch.uint8 for t in records):
                raise ValueError("quantized groups of another layout")
        for memo in state.memos:
            per_token = [memo.positions] if memo.positions is not None else []
            if not isinstance(memo, LayerMemo) or any(t.shape[-1] != state.stored for t in [*per_token, *memo.extras.values()]):
                raise ValueError("method state of another length")
        if state.logits.dim() != 1:
            raise ValueError("logits of another shape")

    def install(self, state: PromptState, pool, block_table: list[int]) -> tuple[list[int], list[int]]:
        """Write a checked ``state`` into ``block_table`` (:meth:`state_blocks` blocks); returns the sequence's
        ``(block table, code table)``."""
        fp_blocks = -(-state.stored // self.block_size)
        table, codes = block_table[:fp_blocks], block_table[fp_blocks:]
        slots = pool.block_slots(table)[: state.stored]
        for index in range(self.num_layers):
            pool.keys[index].index_copy_(1, slots, state.keys[index].to(pool.keys[index].device))
            pool.values[index].index_copy_(1, slots, state.values[index].to(pool.values[index].device))
        if state.groups:
            fmt = self.code_format
            where = fmt.locate(codes, 0, state.groups, slots.device)
            for index in range(self.num_layers):
                fmt.records(pool.keys[index], fmt.key_fields)[:, where[0], where[1]] = state.key_records[index]
                fmt.records(pool.values[index], fmt.value_fields)[:, where[0], where[1]] = state.value_records[index]
        self.memos, self.stored, self.groups = state.memos, state.stored, state.groups
        return table, codes

    # -- one layer of one step ------------------------------------------------------------------
    def after_attention(self, index, module, pool, step: CompressedStep, query, keys, values, scaling) -> None:
        """Let the methods act on layer ``index``'s tokens (``keys/values [1, H, tokens, D]``, the new ones included;
        None on a decode step: read from the step's slots when a method acts), then write what they keep into the
        step's layout."""
        memo = self.memos[index]
        count = step.end - step.first
        if keys is None:
            held = self.stored + count
            if memo.positions is None and not memo.extras and all(
                method.idle_after_attention(memo.state, held) for method in self.methods
            ):  # fmt: skip
                self._layout(index, held, self.groups, step)  # the new tokens are in their slots already
                return
            keys, values = read_runs(pool.keys[index], step.runs), read_runs(pool.values[index], step.runs)
        new_positions = torch.arange(step.computed, step.computed + count, dtype=torch.int32, device=keys.device)
        extras = {name: torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], count)], -1)
                  for name, tensor in memo.extras.items()}  # fmt: skip
        positions = None
        if memo.positions is not None:
            positions = torch.cat([memo.positions, new_positions.expand(*memo.positions.shape[:2], count)], -1)
        store = DenseKVStore.wrap(keys, values, positions, memo.first_position, memo.heads_aligned, extras)
        layer = KVLayer(self.methods)
        layer.index, layer.seen, layer.state, layer.store = index, step.computed + count, memo.state, store
        layer.seen_real = layer.seen
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        attention_step = AttentionStep(module, query, new_positions, scaling, step.is_prefill)
        for method in self.methods:
            method.after_attention(layer, attention_step)
        quantized = self._quantized(layer)
        store = layer.store
        new_groups = sum(len(part) for part in quantized) // self.code_format.group if quantized else 0
        layout = self._layout(index, len(store), self.groups + new_groups, step)
        if quantized:
            where = self.code_format.locate(layout.code_table, self.groups, new_groups, keys.device)
            part = quantized[0]
            for later in quantized[1:]:
                part.extend(later)
            self.code_format.write(pool, index, part, where)
        if step.is_prefill or not store.wraps(keys) or len(store) != keys.shape[2]:
            kept_keys, kept_values = store.keys, store.values
            if kept_keys.untyped_storage().data_ptr() == pool.keys[index].untyped_storage().data_ptr():
                kept_keys, kept_values = kept_keys.clone(), kept_values.clone()  # reads the slots about to be written
            slots = pool.block_slots(layout.block_table[: -(-len(store) // self.block_size)])[: len(store)]
            pool.keys[index].index_copy_(1, slots, kept_keys[0])
            pool.values[index].index_copy_(1, slots, kept_values[0])
        memo.positions = None if store.first_position is not None else store.positions
        memo.first_position = store.first_position or 0
        memo.heads_aligned = store.heads_aligned
        memo.extras = store.extras()

    def _quantized(self, layer: KVLayer) -> list[QuantizedKV]:
        """The quantized parts the methods made this step (the only parts blocks can hold)."""
        for part in layer.parts:
            if not isinstance(part, QuantizedKV) or self.code_format is None or not self.code_format.matches(part):
                raise CacheUsageError(
                    f"the engine's blocks hold full-precision tokens and {self._format_name()}, but the methods made "
                    f"{part.kind}; serve this spec with kvopt.cache(...) and model.generate"
                )
        return list(layer.parts)

    def _format_name(self) -> str:
        fmt = self.code_format
        return "no quantized groups" if fmt is None else f"{fmt.bits}-bit groups of {fmt.group}"

    def _layout(self, index: int, stored: int, groups: int, step: CompressedStep) -> Layout:
        if self.layout is not None:
            if (self.layout.stored, self.layout.groups) != (stored, groups):
                raise CacheUsageError(
                    f"layer {index} kept {stored} tokens ({groups} quantized groups) where the first layer kept "
                    f"{self.layout.stored} ({self.layout.groups}); the engine's blocks need every layer to keep as many"
                )
            return self.layout
        fp_blocks = -(-stored // self.block_size)
        code_blocks = self._code_blocks(groups)
        spare = step.block_table[fp_blocks:]
        needed = code_blocks - len(step.code_table)
        if needed > len(spare):
            raise CacheUsageError(
                f"a compressed sequence needs {fp_blocks} + {code_blocks} blocks but holds "
                f"{len(step.block_table)} + {len(step.code_table)}; this is a kvopt bug, please report it"
            )
        taken = spare[:max(needed, 0)]
        self.layout = Layout(stored, groups, step.block_table[:fp_blocks], step.code_table + taken, spare[len(taken):])
        return self.layout

    def plan(self, plan: StepPlan, seq, row: int, count: int) -> bool:
        """The prompt's tokens go straight to the methods (nothing of it is in the pool yet); later tokens are
        stored and attended like a lossless sequence's, over the kept ones and the quantized groups."""
        first = seq.num_computed_tokens
        is_prefill = first == 0
        runs = [] if is_prefill else plan.runs(seq.block_table, self.stored + count)
        if not is_prefill:
            plan.store_new(runs, row, count)
        codes = None
        if self.groups:
            where = self.code_format.locate(seq.code_table, 0, self.groups, plan.device)
            codes = CodedTokens(plan.pool, self.code_format, where)
        plan.sequences.append(SequenceSlots.of(row, row + count, runs, plan.device, codes))
        plan.compressed.append(CompressedStep(self, row, row + count, first, is_prefill, runs, list(seq.block_table),
                                              list(seq.code_table)))  # fmt: skip
        return True

    def commit(self, seq, drafted: int, accepted: int, block_size: int) -> list[int]:
        """Follow the step's layout, once every layer followed it: the sequence's tables, and the blocks freed."""
        layout, self.layout = self.layout, None
        if layout is None:
            raise CacheUsageError("a compressed sequence's step ended before its layers ran; this is a kvopt bug")
        self.stored, self.groups = layout.stored, layout.groups
        seq.block_table, seq.code_table = layout.block_table, layout.code_table
        return layout.freed


#: Most padded groups one read of several sequences' groups holds (its records are copied ~3 times; at 4 bits, 3 KV
#: heads of 64 channels, 2,048 groups of 32 tokens are ~16 MB of keys and values).
MAX_BATCH_GROUPS = 2048
#: Longest over shortest sequence (in groups) that one read pads together.
MAX_PADDING = 1.25


@dataclass(frozen=True)
class CodedTokens:
    """The quantized groups of one decoding sequence, or of several read together, as attention reads them this step."""

    pool: object
    code_format: CodeFormat
    #: Block and record of each group: ``[G]`` (one sequence) or ``[S, G]``.
    where: tuple[torch.Tensor, torch.Tensor]
    #: ``[S, 1, G * group]``, False on the groups padding the shorter sequences; None when none is padded.
    valid: torch.Tensor | None = None

    def __len__(self) -> int:
        """Groups (of the longest sequence, when several)."""
        return self.where[0].shape[-1]

    @classmethod
    def batches(cls, codes: list[CodedTokens]) -> list[tuple[list[int], CodedTokens]]:
        """Decoding sequences' groups (one sequence each in ``codes``) as few reads as pay: one per code format (requests
        may name their own methods) and similar length (padding costs at most ``MAX_PADDING`` times the work), at most
        ``MAX_BATCH_GROUPS`` padded groups each; with the indices into ``codes`` that each read serves."""
        by_format: dict[CodeFormat, list[int]] = {}
        for index, part in enumerate(codes):
            by_format.setdefault(part.code_format, []).append(index)
        buckets: list[list[int]] = []
        for indices in by_format.values():
            bucket: list[int] = []
            for index in sorted(indices, key=lambda i: len(codes[i])):
                count = len(codes[index])
                if bucket and (count > MAX_PADDING * len(codes[bucket[0]]) or count * (len(bucket) + 1) > MAX_BATCH_GROUPS):
                    buckets.append(bucket)
                    bucket = []
                bucket.append(index)
            buckets.append(bucket)
        return [(bucket, cls.stack([codes[index] for index in bucket])) for bucket in buckets]

    @classmethod
    def stack(cls, codes: list[CodedTokens]) -> CodedTokens:
        """Several sequences' groups as one read: a layer's groups of all of them in one gather, one dequantization
        and one attention call (instead of some twenty small ops per sequence), each padded to the longest."""
        first = codes[0]
        counts = [len(part) for part in codes]
        longest = max(counts)

        def padded(indices: torch.Tensor) -> torch.Tensor:  # repeats a real group: the gather stays in bounds
            return torch.cat([indices, indices[:1].expand(longest - indices.numel())])

        where = tuple(torch.stack([padded(part.where[axis]) for part in codes]) for axis in (0, 1))
        valid = None
        if min(counts) < longest:
            tokens = torch.arange(longest * first.code_format.group, device=where[0].device)
            limits = torch.tensor(counts, device=where[0].device) * first.code_format.group
            valid = (tokens < limits[:, None])[:, None]
        return cls(first.pool, first.code_format, where, valid)

    def group_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where these groups lie, as the CPU decode kernel reads them in every layer: blocks and records ``[S, G]``
        and each sequence's real groups ``[S]``; None where the kernel does not read them (another device, a layout
        it does not read)."""
        if self.code_format.kernel_layout is None or self.where[0].device.type != "cpu":
            return None
        blocks, records = (indices.reshape(-1, indices.shape[-1]) for indices in self.where)
        counts = (torch.full((blocks.shape[0],), blocks.shape[1], dtype=torch.long) if self.valid is None
                  else self.valid[:, 0].sum(-1).div(self.code_format.group, rounding_mode="floor"))  # fmt: skip
        return blocks, records, counts

    def group_records(self, index: int) -> GroupRecords | None:
        """These groups in layer ``index`` as the CPU decode kernel reads them in place (None as :meth:`group_rows`)."""
        rows = self.group_rows()
        return None if rows is None else GroupRecords(*self.record_pools(index), *rows, self.code_format.kernel_layout)

    def record_pools(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key and value pools as the bytes of their blocks, ``[kv_heads, blocks, block bytes]``."""
        block_bytes = self.code_format.block_bytes
        return tuple(pool[index].view(torch.uint8).view(pool[index].shape[0], -1, block_bytes)
                     for pool in (self.pool.keys, self.pool.values))  # fmt: skip

    def attend(self, index: int, query: torch.Tensor, scaling: float, softcap) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, lse)`` of one query per sequence ``[S, H_q, 1, D]`` over its groups in layer ``index`` (all
        older than it): read in place by the CPU decode kernel where it serves, else gathered and dequantized."""
        keys = self.pool.keys[index]
        groups = self.group_records(index) if softcap is None else None
        if groups is not None and attention_math.codes_kernel_serves(query, keys):
            scale = attention_math.default_scale(query, scaling)
            output, lse = attention_math.decode_over_codes(query[:, :, 0], keys, self.pool.values[index], groups, scale)
            return output[:, :, None], lse[:, :, None]
        part = self.code_format.read(self.pool, index, self.where, self.valid)
        return part.attend(query, torch.zeros(1, dtype=torch.int32, device=query.device), scaling, softcap)
