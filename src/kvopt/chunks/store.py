"""Chunk KV computed once and found again by content, wherever the chunk appears in a prompt.

A retrieved document comes back in other prompts at other positions, so its KV is computed once, without
the other documents, and stored post-RoPE. Moving it to position ``s`` is one RoPE rotation by the
position delta (rotations compose, ``R(p + s) = R(s) R(p)``; :mod:`kvopt.cache.prerope` has the model's
own frequencies), so one stored copy serves every position (CacheBlend, arXiv 2405.16444, §25; EPIC,
arXiv 2410.15332, §26).

A chunk is computed after its ``preamble``: the text every prompt puts before its documents (a system
prompt, the chat template's head), or nothing. Only the chunk's own KV is stored, at positions
``len(preamble)..``. A chunk computed from position 0 sees no text before it, so every one of its tokens
takes the attention sink role of a prompt's first token. After the preamble, its KV is what the document
sees in the prompt it will serve, less the other documents: measured on the retrieval task, plain
concatenation then keeps about twice as many of a full prefill's answers (BENCHMARKS.md). The preamble's
own KV is a chunk too (from position 0), so it is computed once and extended for each document.

A chunk's key hashes the model fingerprint (:func:`~kvopt.codec.fingerprint.model_fingerprint`), the KV
method spec the blended cache is built for, the entry encoding, the preamble's and the chunk's token ids,
so entries never collide across models, methods or preambles. Entries live in memory (decoded, LRU by bytes) and in the tiers
(:mod:`kvopt.tiers`: CPU, disk, Redis) as :func:`~kvopt.codec.blocks.encode_block` bytes, whose checksums and
fingerprint reject a damaged or foreign entry: it is dropped from every tier and the chunk recomputed.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvopt.api import build_cache
from kvopt.cache.prerope import RopeError, RopeTable, from_pairs, rope_inv_freq, rotate, to_pairs
from kvopt.codec.blocks import decode_block, encode_block
from kvopt.codec.errors import CacheFileError
from kvopt.codec.fingerprint import model_fingerprint
from kvopt.errors import KVOptError
from kvopt.methods.spec import parse, spec_text
from kvopt.models.forward import cache_kwargs
from kvopt.models.info import ModelInfo
from kvopt.tiers.base import TierStats
from kvopt.tiers.chain import TierChain

#: Bumped when what an entry holds changes (positions, encoding), so old entries are never read as new ones.
ENTRY_FORMAT = 2
ENCODING = "raw"


class ChunkError(KVOptError):
    """A chunk, a blend setting or a method that chunk reuse cannot serve."""


@dataclass(frozen=True)
class Chunk:
    """Token ids of a reusable piece of a prompt (a retrieved document): its KV is computed once and reused."""

    tokens: tuple[int, ...]
    #: What the chunk is computed after (the prompt's text before its documents), see the module.
    preamble: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ChunkError("a chunk has no tokens; drop empty documents before building the prompt")


@dataclass
class ChunkKV:
    """One chunk's KV per layer, ``keys/values [1, kv_heads, tokens, head_dim]``, keys post-RoPE at
    ``start..start+T-1`` (``start``: its preamble's length)."""

    tokens: tuple[int, ...]
    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def check_reusable(model, spec: str) -> str:
    """The canonical form of ``spec`` when a blended prompt can feed its cache; one :class:`ChunkError` line if not."""
    methods = parse(spec)
    for method in methods:
        reason = (
            "changes the prefill itself" if method.shapes_prefill
            else "reads the prompt's final hidden states, which reused tokens never produce" if method.reads_prompt_states
            else "needs a reconstruction pass over the prompt, not wired to blending" if method.needs_prefill_pass
            else None
        )  # fmt: skip
        if reason:
            raise ChunkError(f"chunk reuse cannot serve {method.name}: it {reason}; use full or a method such as "
                             "snapkv or kivi after blending")  # fmt: skip
    info = ModelInfo.from_config(model.config)
    if any(window is not None for window in info.sliding_windows):
        raise ChunkError(f"chunk reuse needs full-attention layers; {type(model).__name__} has sliding-window layers "
                         "(use prefix caching for it)")  # fmt: skip
    return spec_text(methods)


class ChunkStore:
    """Chunk KV by content for one model and KV method, in memory and in ``tiers`` (shared by store instances)."""

    def __init__(self, model, method: str = "full", tiers: TierChain | None = None,
                 max_memory_bytes: int = 256 << 20) -> None:  # fmt: skip
        self.model, self.tiers, self.max_memory_bytes = model, tiers, max_memory_bytes
        self.method = check_reusable(model, method)
        self.fingerprint = model_fingerprint(model)
        self.info = ModelInfo.from_config(model.config)
        #: The in-memory level's counters: ``hits`` / ``misses`` there, ``stores`` chunks computed, ``corrupt``
        #: damaged tier entries dropped (the tiers count their own hits).
        self.stats = TierStats()
        self._salt = json.dumps(
            {"model": self.fingerprint, "method": self.method, "encoding": ENCODING, "format": ENTRY_FORMAT},
            sort_keys=True,
        ).encode()
        self._memory: OrderedDict[str, ChunkKV] = OrderedDict()
        try:
            frequencies = [rope_inv_freq(model.config, layer, self.info.head_dim) for layer in range(self.info.num_layers)]
        except RopeError as error:
            raise ChunkError(f"chunk reuse moves keys by RoPE rotations: {error}") from None
        device = next(model.parameters()).device
        shared: dict[tuple, RopeTable] = {}
        self.tables = [shared.setdefault(tuple(f.tolist()), RopeTable(f.to(device))) for f in frequencies]

    def key(self, chunk: Chunk) -> str:
        """The entry's name: a hash of (model fingerprint, method, encoding, preamble and chunk token ids)."""
        hasher = hashlib.blake2b(self._salt, digest_size=20)
        for ids in (chunk.preamble, chunk.tokens):  # each length-prefixed: no two splits of one id run collide
            hasher.update(torch.tensor([len(ids), *ids], dtype=torch.int64).numpy().tobytes())
        return f"chunk{hasher.hexdigest()}"

    def get(self, chunk: Chunk) -> ChunkKV:
        """The chunk's KV: from memory, else the tiers (damaged entries dropped), else computed and stored."""
        key = self.key(chunk)
        held = self._memory.get(key)
        if held is not None:
            self._memory.move_to_end(key)
            self.stats.hits += 1
            return held
        self.stats.misses += 1
        found = self._from_tiers(key, chunk)
        if found is None:
            found = self.compute(chunk)
            self.stats.stores += 1
            if self.tiers is not None:
                keys, values = [k.clone() for k in found.keys], [v.clone() for v in found.values]
                meta = {"tokens": list(chunk.tokens), "preamble": list(chunk.preamble), "method": self.method}
                self.tiers.put_later(key, lambda: encode_block(list(zip(keys, values)), self.fingerprint, ENCODING, meta))
        self._remember(key, found)
        return found

    def _from_tiers(self, key: str, chunk: Chunk) -> ChunkKV | None:
        if self.tiers is None:
            return None
        entry = self.tiers.get(key)
        if entry is None:
            return None
        device = next(self.model.parameters()).device
        try:
            layers, meta = decode_block(entry[0], self.fingerprint, device, source=f"chunk entry {key}")
            held = (tuple(meta.get("tokens", ())), tuple(meta.get("preamble", ())), meta.get("method"))
            if held != (chunk.tokens, chunk.preamble, self.method):
                raise CacheFileError(f"chunk entry {key} holds other tokens, another preamble or another method")
            if len(layers) != self.info.num_layers or any(k.shape[-2] != len(chunk.tokens) for k, _ in layers):
                raise CacheFileError(f"chunk entry {key} holds the wrong number of layers or tokens")
        except CacheFileError:
            self.tiers.drop(key)
            self.stats.corrupt += 1
            return None
        return ChunkKV(chunk.tokens, len(chunk.preamble), [k for k, _ in layers], [v for _, v in layers])

    def compute(self, chunk: Chunk) -> ChunkKV:
        """The chunk's KV computed after its preamble (a lossless prefill continuing the preamble's stored KV)."""
        total = len(chunk.preamble) + len(chunk.tokens)
        if total > (self.info.max_positions or total):
            raise ChunkError(f"a chunk of {len(chunk.tokens)} tokens after a preamble of {len(chunk.preamble)} exceeds "
                             f"the model's {self.info.max_positions} positions; split the document into smaller chunks")  # fmt: skip
        cache = build_cache("full", self.model)
        if chunk.preamble:
            preamble = self.get(Chunk(chunk.preamble))
            for layer, keys, values in zip(cache.layers, preamble.keys, preamble.values):
                layer.lazy_initialization(keys, values)
                layer.store_tokens(keys, values, None)
        ids = torch.tensor([list(chunk.tokens)], device=next(self.model.parameters()).device)
        with torch.no_grad():
            self.model(input_ids=ids, **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        start = len(chunk.preamble)
        keys = [layer.store.keys[:, :, start:].clone() for layer in cache.layers]
        values = [layer.store.values[:, :, start:].clone() for layer in cache.layers]
        return ChunkKV(chunk.tokens, start, keys, values)

    def _remember(self, key: str, chunk: ChunkKV) -> None:
        size = chunk.nbytes()
        if size > self.max_memory_bytes:
            return
        self._memory[key] = chunk
        self.stats.bytes_stored += size
        while self.stats.bytes_stored > self.max_memory_bytes:
            _, old = self._memory.popitem(last=False)
            self.stats.bytes_stored -= old.nbytes()
            self.stats.evictions += 1

    def shifted_keys(self, chunk: ChunkKV, layer: int, start: int) -> torch.Tensor:
        """Layer ``layer``'s keys of ``chunk`` moved to positions ``start..start+T-1`` (one RoPE rotation by the
        delta from where they were computed, backwards when the chunk moves earlier)."""
        keys = chunk.keys[layer]
        if start == chunk.start:
            return keys
        table = self.tables[layer]
        delta = torch.full((1, 1, keys.shape[-2]), abs(start - chunk.start), dtype=torch.long, device=keys.device)
        return from_pairs(rotate(to_pairs(keys, table), delta, table, inverse=start < chunk.start), table).to(keys.dtype)

    def flush(self) -> None:
        """Wait for the tiers' pending writes (another store then finds this one's chunks)."""
        if self.tiers is not None:
            self.tiers.flush()

