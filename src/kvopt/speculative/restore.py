"""Speculative blocks on a kvopt cache: tokens fed inside are provisional until the block commits.

A block puts each chosen layer in a provisional mode (:class:`ProvisionalTokens`, set as the
layer's :attr:`~kvopt.cache.layer.KVLayer.mode`) holding the layer's restore point. Committing
``n`` sends the layer back to it and stores the first ``n`` tokens again, the methods acting after
each as plain decoding would: the cache then holds exactly what plain decoding of the kept tokens
holds, whatever scores, quantized groups or merges the rejected ones caused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvopt.cache.kv_cache import KVCache
from kvopt.cache.layer import AttentionStep, KVLayer
from kvopt.cache.part import KVPart
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError


def record_fields(obj: object, records: list[tuple[object, dict]], seen: set[int]) -> None:
    """Append to ``records`` the field values of the dataclass objects making up a part (``obj`` and those
    it holds), unless ``seen`` has them.

    Parts never write into their tensors once built (they grow by concatenation into new ones), so
    setting these fields back restores a part, in place: a part shared by two layers (MiniCache)
    stays shared, whichever of them is restored.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type) or id(obj) in seen:
        return
    seen.add(id(obj))
    values = {item.name: getattr(obj, item.name) for item in dataclasses.fields(obj)}
    records.append((obj, values))
    for value in values.values():
        record_fields(value, records, seen)


@dataclass
class ProvisionalTokens:
    """A layer's restore point while a speculative block is open, and how the block's tokens are attended.

    Every query of a block must see exactly the cache a plain decoding step would. When the methods
    act on stored tokens only, and at most after a block's last token (``full``, prefill-time
    eviction, ``kivi``, ``minicache``: :attr:`Method.verifies_at_once` within
    :meth:`Method.speculation_limit`), a block is attended in one call and the methods act once.
    Otherwise (decode-time eviction scores queries; sliding layers forget as they go) its tokens
    are attended one at a time, the methods acting after each.
    """

    seen: int
    seen_real: int
    store: DenseKVStore
    parts: list[KVPart]
    #: Field values of the parts' objects (see :func:`record_fields`).
    fields: list[tuple[object, dict]]
    state: dict[str, object]
    #: True when the methods allow a block to be attended in one call.
    at_once: bool
    #: Most tokens the block may hold for that (None: any); a longer block is attended one token at a time.
    limit: int | None
    #: Attention inputs of each provisional token: ``(module, query, key, value, scaling, window, softcap)``.
    steps: list[tuple] = field(default_factory=list)
    purpose: ClassVar[str] = "a speculative block (commit it)"
    forgets_tokens: ClassVar[bool] = False  # a rejected draft is rolled back, an accepted one stays

    @classmethod
    def open(cls, layer: KVLayer, seen: set[int]) -> ProvisionalTokens:
        """The restore point of ``layer``. It shares the dense store's buffers while the methods never act (a
        block only appends to them), else copies them; the parts' fields are recorded (``seen`` holds the parts
        other layers of the block recorded already: a part shared by two layers is restored once)."""
        at_once = layer.sliding_window is None and all(m.verifies_at_once for m in layer.methods)
        limits = [limit for m in layer.methods if (limit := m.speculation_limit(layer)) is not None]
        fields: list[tuple[object, dict]] = []
        for part in layer.parts:
            record_fields(part, fields, seen)
        limit = min(limits, default=None)  # None: the methods never act while decoding
        store = layer.store.snapshot(share_buffers=at_once and limit is None and layer.store.start == 0)
        return cls(layer.seen, layer.seen_real, store, list(layer.parts), fields, dict(layer.state), at_once, limit)

    def attend(self, layer: KVLayer, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Attend the block's new tokens, recording them for :meth:`commit`."""
        if key.shape[0] != 1 or (padding is not None and not bool(padding.all())):
            raise CacheUsageError("speculative decoding runs one sequence without padding (batch of 1)")
        steps = [
            (module, *(t[:, :, i : i + 1] for t in (query, key, value)), scaling, sliding_window, softcap)
            for i in range(key.shape[-2])
        ]
        self.steps.extend(steps)
        if self.at_once and (self.limit is None or len(self.steps) <= self.limit):
            return layer.store_and_attend(module, query, key, value, None, scaling, sliding_window, softcap)
        outputs = [layer.store_and_attend(m, q, k, v, None, sc, sw, cap) for m, q, k, v, sc, sw, cap in steps]
        return torch.cat(outputs, dim=1)

    def commit(self, layer: KVLayer, accepted: int) -> None:
        """Keep the first ``accepted`` provisional tokens and forget the rest, with every trace they left.

        The layer goes back to its restore point and the accepted tokens are stored again one at a time, the
        methods acting after each. Methods that read queries need the attention redone (a block of them wholly
        accepted is already in that state); the others need none.
        """
        layer.mode = None
        layer.drop_parked()
        if not self.at_once and accepted == len(self.steps):
            return
        layer.seen, layer.seen_real = self.seen, self.seen_real
        layer.store, layer.parts, layer.state = self.store, self.parts, self.state
        for part, values in self.fields:
            for name, value in values.items():
                setattr(part, name, value)
        for module, query, key, value, scaling, sliding_window, softcap in self.steps[:accepted]:
            if self.at_once:
                positions, _ = layer.store_tokens(key, value, None)
                layer.act(AttentionStep(module, query, positions, scaling, False))
            else:
                layer.store_and_attend(module, query, key, value, None, scaling, sliding_window, softcap)


class SpeculativeBlock:
    """An open block over some layers of a cache: :meth:`commit` keeps the first tokens and closes it."""

    def __init__(self, layers: list[KVLayer]) -> None:
        self.layers: list[KVLayer] | None = layers

    def commit(self, accepted: int) -> None:
        """Keep the first ``accepted`` tokens of the block; close it (a wrong count leaves it open)."""
        if self.layers is None:
            raise CacheUsageError("commit() needs an open speculative block: use `with speculate(cache) as block:`")
        held = len(self.layers[0].mode.steps)
        if not 0 <= accepted <= held:
            raise CacheUsageError(f"commit({accepted}): the block holds {held} provisional tokens")
        layers, self.layers = self.layers, None
        for layer in layers:
            layer.mode.commit(layer, accepted)


@contextmanager
def speculate(cache: KVCache, layers: int | None = None) -> Iterator[SpeculativeBlock]:
    """Open a speculative block: tokens fed inside are provisional until ``block.commit(n)``.

    Inside, a forward over several tokens is verified exactly as plain decoding would process them
    one by one; ``commit(n)`` keeps the first ``n`` and forgets the others along with every score,
    quantization or merge they caused. Leaving the block without committing (or on an error) keeps
    none. ``layers`` limits the block to the first layers (a self-speculative draft runs only those).

        with speculate(cache) as block:
            logits = model(ids, **cache_kwargs(model, cache)).logits
            block.commit(accepted)
    """
    if layers is not None and not 1 <= layers <= len(cache.layers):
        raise CacheUsageError(f"speculate(layers={layers}): the cache has {len(cache.layers)} layers")
    chosen = cache.layers[:layers]
    busy = next((layer.mode for layer in chosen if layer.mode is not None), None)
    if isinstance(busy, ProvisionalTokens):
        raise CacheUsageError("a speculative block is already open on this cache; commit it first")
    if busy is not None:
        raise CacheUsageError(f"a speculative block cannot open during {busy.purpose}")
    seen: set[int] = set()
    for layer in chosen:
        layer.mode = ProvisionalTokens.open(layer, seen)
    block = SpeculativeBlock(chosen)
    try:
        yield block
    finally:
        if block.layers is not None:
            block.commit(0)


def block_limit(cache: KVCache) -> int | None:
    """Most tokens the next speculative block may hold for its methods to act as in plain decoding (a
    cross-layer merge must fall on the block's last token); None when unbounded."""
    limits = [m.speculation_limit(layer) for layer in cache.layers for m in cache.methods]
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None
