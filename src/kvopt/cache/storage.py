"""Dense per-layer KV storage with explicit token positions, per KV head.

Every stored token carries its *sequence index* (its column in the 2-D attention mask, i.e.
how many tokens of its row came before it, padding included) and a validity bit (False for
left padding). Attention masks are computed from these, never from slot order, so methods
may drop any tokens, head by head, and the survivors still attend correctly. While the live
tokens are a run of consecutive indices (nothing evicted out of order) the indices are
implied by the first one and no tensor holds them; likewise validity while nothing is
padding. Both become tensors the moment they carry information.

All per-token tensors share one layout, the token axis being axis 2: keys and values
``[batch, kv_heads, tokens, dim]``, positions and validity ``[batch, kv_heads, tokens]``, and
any *extras* a method keeps per token (e.g. H2O's accumulated attention), which follow the
tokens through appends, evictions and compactions.

Memory is a buffer with a ``start``/``end`` live range: dropping the oldest tokens only moves
``start``; the buffer is compacted, or regrown with a little slack, when new tokens need room.
``nbytes`` reports every buffer, slack included: the bytes actually held.
"""

from __future__ import annotations

import torch

from kvopt.cache.attention_math import attention_with_lse, visibility
from kvopt.cache.part import tensor_bytes

TOKEN_AXIS = 2


def slack_tokens(tokens: int) -> int:
    """Free slots to keep beyond ``tokens``: none below 256 tokens, then ~3% of the live size, at most 64.

    Growing by a few percent keeps reallocation copies cheap (amortised O(1) per decoded token
    relative to the attention read) while the bytes held stay within a few percent of the live
    tokens; a store under 256 tokens (a short prompt, a quantizer's residual) is copied whole
    at each growth instead, which costs less than idle slots would hold. ``nbytes`` reports
    every slot.
    """
    return 0 if tokens < 256 else min(64, tokens // 32)


class DenseKVStore:
    """Keys/values ``[batch, kv_heads, tokens, dim]`` with positions and validity ``[batch, kv_heads, tokens]``.

    A :class:`~kvopt.cache.part.KVPart`: the one that receives a layer's new tokens, read after the compact parts.
    """

    kind = "dense tokens"
    read_order = 3

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.start = 0
        self.end = 0
        #: Sequence index of the oldest live token while positions are implied (no "positions" buffer).
        self.first_position: int | None = 0
        #: True while every live token is valid (no padding); lets attention skip masks.
        self.all_valid = True
        #: True while all KV heads hold the same tokens (no per-head eviction); masks then broadcast over heads.
        self.heads_aligned = True

    @classmethod
    def wrap(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None, first_position: int = 0,
        heads_aligned: bool = True, extras: dict[str, torch.Tensor] | None = None, live: int | None = None,
        valid: torch.Tensor | None = None,
    ) -> DenseKVStore:  # fmt: skip
        """A store over existing tensors (no copy): how the serving engine shows one sequence's tokens, kept in
        its paged blocks, to the methods. ``positions [batch, kv_heads, tokens]``, or None for a run from
        ``first_position``; ``extras`` are the methods' per-token tensors by name; ``valid [batch, kv_heads,
        tokens]`` marks the slots that hold a token (heads holding different counts, padded to one length), or
        None: every token real. The first ``live`` tokens (default: all) are stored; the rest of the tensors is
        room that appends fill in place. Evicting or moving tokens installs fresh buffers."""
        store = cls()
        store._buffers = {"keys": keys, "values": values}
        if positions is not None:
            store._buffers["positions"] = positions
            store.first_position = None
        else:
            store.first_position = first_position
        for name, tensor in (extras or {}).items():
            store._buffers[f"extra:{name}"] = tensor
        if valid is not None:
            store._buffers["valid"] = valid
            store.all_valid = False
        store.end = keys.shape[TOKEN_AXIS] if live is None else live
        store.heads_aligned = heads_aligned
        return store

    def wraps(self, keys: torch.Tensor) -> bool:
        """True while the tokens are still held in the ``keys`` given to :meth:`wrap` from its start (no
        eviction or move installed fresh buffers; appends may have filled its room, the count says)."""
        return self._buffers.get("keys") is keys and self.start == 0

    def extras(self) -> dict[str, torch.Tensor]:
        """The methods' per-token tensors by name (live views)."""
        prefix = "extra:"
        return {name[len(prefix) :]: self._live(name) for name in self._buffers if name.startswith(prefix)}

    # -- views ---------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return not self._buffers

    def __len__(self) -> int:
        return self.end - self.start

    def _live(self, name: str) -> torch.Tensor:
        return self._buffers[name][:, :, self.start : self.end]

    @property
    def keys(self) -> torch.Tensor:
        return self._live("keys")

    @property
    def values(self) -> torch.Tensor:
        return self._live("values")

    @property
    def positions(self) -> torch.Tensor:
        """Sequence index of each stored token, ``[batch, kv_heads, tokens]`` (int32; read-only)."""
        if self.first_position is None:
            return self._live("positions")
        run = torch.arange(self.first_position, self.first_position + len(self), dtype=torch.int32, device=self.device)
        return run.expand(*self._token_shape(), -1)

    @property
    def valid(self) -> torch.Tensor:
        """False where a stored slot holds padding, ``[batch, kv_heads, tokens]`` (read-only)."""
        if "valid" not in self._buffers:
            return torch.ones((), dtype=torch.bool, device=self.device).expand(*self._token_shape(), len(self))
        return self._live("valid")

    @property
    def device(self) -> torch.device:
        return self._buffers["keys"].device

    def _token_shape(self) -> tuple[int, int]:
        return tuple(self._buffers["keys"].shape[:2])

    def extra(self, name: str) -> torch.Tensor:
        """A method's per-token tensor (live view, writable in place), ``[batch, kv_heads, tokens]``."""
        return self._live(f"extra:{name}")

    def has_extra(self, name: str) -> bool:
        return f"extra:{name}" in self._buffers

    def add_extra(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Start tracking a per-token tensor (zeros); it moves with the tokens from now on."""
        like = self._buffers["keys"]
        self._buffers[f"extra:{name}"] = torch.zeros(like.shape[:3], dtype=dtype, device=like.device)
        return self.extra(name)

    def drop_extra(self, name: str) -> None:
        del self._buffers[f"extra:{name}"]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts): every buffer, slack included."""
        return list(self._buffers.values())

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def valid_counts(self) -> torch.Tensor:
        """Valid (non-padding) tokens held per batch row (counted on KV head 0); no rows before the first append."""
        if self.is_empty:
            return torch.zeros(0, dtype=torch.long)
        return self.valid[:, 0].sum(dim=-1)

    def mask_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions and validity for attention masks: one row for all heads while they hold the same
        tokens (the mask broadcasts), validity None while every token is real (no mask needed)."""
        heads = slice(0, 1) if self.heads_aligned else slice(None)
        return self.positions[:, heads], None if self.all_valid else self.valid[:, heads]

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(output, lse)`` in fp32 over the stored tokens (:meth:`kvopt.cache.part.KVPart.attend`); a
        ``sliding_window`` hides keys that many positions older than a query, as :class:`~kvopt.cache.ragged.RaggedKV`
        does (not in the protocol while other parts cannot honour it)."""
        mask = visibility(*self.mask_rows(), query_positions, sliding_window)
        return attention_with_lse(query, self.keys, self.values, mask, scaling, softcap)

    def presenting(self, keys: torch.Tensor) -> DenseKVStore:
        """A view of the live tokens with ``keys [batch, kv_heads, tokens, dim]`` in place of the stored keys, sharing
        every other tensor: what attention reads when methods present the keys otherwise (re-rotated within the
        cache, :meth:`kvopt.methods.base.Method.read_keys`). For reading only: writes to its values, positions or
        validity would reach this store; methods' extras (scores they accumulate) are left out, as attention never
        reads them."""
        view = DenseKVStore()
        view.__dict__.update(self.__dict__, start=0, end=len(self))
        shown = (name for name in self._buffers if not name.startswith("extra:"))
        view._buffers = {name: keys if name == "keys" else self._live(name) for name in shown}
        return view

    # -- writes --------------------------------------------------------------------------
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, first_position: int, valid: torch.Tensor | None,
        positions: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Store new tokens at sequence indices ``first_position...``; ``valid [batch, new]`` or None (all real).

        ``positions [batch, new]`` gives the indices explicitly instead (tokens that are not a run:
        the ones FastKV propagates past its selection layer)."""
        new = keys.shape[TOKEN_AXIS]
        self._reserve(keys, values, new)
        end = self.end + new
        buffers = self._buffers
        buffers["keys"][:, :, self.end : end] = keys
        buffers["values"][:, :, self.end : end] = values
        if "positions" not in buffers:
            if not len(self) and positions is None:
                self.first_position = first_position  # a new run
            elif positions is not None or first_position != self.first_position + len(self):
                self._materialize("positions")
        if "positions" in buffers:
            if positions is None:
                positions = torch.arange(first_position, first_position + new, dtype=torch.int32, device=keys.device)
            buffers["positions"][:, :, self.end : end] = positions[..., None, :] if positions.ndim == 2 else positions
        if valid is not None and not bool(valid.all()):
            self._materialize("valid")
            self.all_valid = False
        if "valid" in buffers:
            buffers["valid"][:, :, self.end : end] = True if valid is None else valid[:, None, :]
        for name, buffer in buffers.items():
            if name.startswith("extra:"):
                buffer[:, :, self.end : end] = 0
        self.end = end

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest live slots (O(1); memory is reclaimed at the next compaction)."""
        if self.first_position is not None:
            self.first_position += min(count, len(self))
        self.start = min(self.start + count, self.end)
        if not self.all_valid:
            self.all_valid = bool(self.valid.all())
        if self.capacity > len(self) + 2 * slack_tokens(len(self)):
            self._reallocate(len(self))

    def forget_before(self, position: int) -> None:
        """Forget the tokens at sequence indices before ``position`` (what a sliding window never reads again), while
        the heads hold the same tokens (else the attention mask still applies the window)."""
        if self.heads_aligned:
            stale = int((self.positions[0, 0] < position).sum())
            if stale:
                self.drop_oldest(stale)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the slots at ``indices`` (``[batch, kv_heads or 1, kept]``, live-range offsets).

        The survivors move into a fresh, compact buffer, so the memory of evicted tokens is freed.
        Indices shared by all heads (second axis 1) keep the heads aligned.
        """
        heads = self._buffers["keys"].shape[1]
        # one row keeping the same tokens in every head: whole token rows copied (a gather over expanded indices ran
        # at ~1.4 GB/s, and a decode-time method keeps its tokens at every step of every layer)
        rows = indices[0, 0] if indices.shape[:2] == (1, 1) else None
        if indices.shape[1] != heads:
            indices = indices.expand(-1, heads, -1)
        elif heads > 1:
            self.heads_aligned = self.heads_aligned and bool((indices == indices[:, :1]).all())
        kept = indices.shape[-1]
        self._materialize("positions")  # the survivors need not be a run
        gathered = {}
        for name in self._buffers:
            live = self._live(name)
            if rows is not None:
                gathered[name] = live.index_select(TOKEN_AXIS, rows)
                continue
            index = indices if live.ndim == 3 else indices[..., None].expand(-1, -1, -1, live.shape[-1])
            gathered[name] = live.gather(TOKEN_AXIS, index)
        self._install(gathered, kept)
        self.all_valid = bool(self.valid.all())

    def truncate_after(self, length: int) -> None:
        """Forget tokens whose position is >= ``length`` (assisted-decoding rollback)."""
        if not self.heads_aligned:
            from kvopt.errors import CacheUsageError

            raise CacheUsageError("rolling back a cache after per-head eviction is not supported")
        keep = int((self.positions[0, 0] < length).sum()) if len(self) else 0
        self.end = self.start + keep

    def clone(self) -> DenseKVStore:
        """An independent copy holding the same live tokens (and flags), with the usual slack."""
        copy = DenseKVStore()
        if not self.is_empty:
            copy._install({name: self._live(name) for name in self._buffers}, len(self))
        copy.all_valid, copy.heads_aligned, copy.first_position = self.all_valid, self.heads_aligned, self.first_position
        return copy

    def live_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer's live range by name (keys, values, positions, valid, ``extra:NAME``): what a saved store holds."""
        return {name: self._live(name) for name in self._buffers}

    @classmethod
    def restore(
        cls, live: dict[str, torch.Tensor], first_position: int | None, all_valid: bool, heads_aligned: bool
    ) -> DenseKVStore:
        """A store holding ``live`` (as :meth:`live_buffers` gave them) with these flags: a loaded cache's store."""
        store = cls()
        if live:
            store._install(live, live["keys"].shape[TOKEN_AXIS])
        store.first_position, store.all_valid, store.heads_aligned = first_position, all_valid, heads_aligned
        return store

    def snapshot(self, share_buffers: bool = False) -> DenseKVStore:
        """This store exactly as it is (buffers with their slack, offsets, flags), as a restore point.

        With ``share_buffers`` the tensors are not copied: the snapshot stays valid only while this
        store is merely appended to from ``start == 0`` (appends write past the live range, or into
        fresh buffers), which is how a speculative block leaves an append-only layer.
        """
        copy = DenseKVStore()
        copy.__dict__.update(self.__dict__)
        copy._buffers = dict(self._buffers) if share_buffers else {n: t.clone() for n, t in self._buffers.items()}
        return copy

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep or repeat batch rows (beam search, batch filtering)."""
        if self.is_empty:
            return
        index = index.to(self.device)
        self._install({name: self._live(name)[index] for name in self._buffers}, len(self))

    def _materialize(self, name: str) -> None:
        """Give positions or validity a buffer (holding the values they had implicitly), from now on."""
        if name in self._buffers or self.is_empty:
            return
        dtype = torch.int32 if name == "positions" else torch.bool
        buffer = torch.empty(self._buffers["keys"].shape[:3], dtype=dtype, device=self.device)
        buffer[:, :, self.start : self.end] = getattr(self, name)
        self._buffers[name] = buffer
        if name == "positions":
            self.first_position = None

    @property
    def capacity(self) -> int:
        return self._buffers["keys"].shape[TOKEN_AXIS]

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> None:
        if self.is_empty:
            batch, heads = keys.shape[:2]
            capacity = new + slack_tokens(new)
            self._buffers = {
                "keys": keys.new_empty(batch, heads, capacity, keys.shape[-1]),
                "values": values.new_empty(batch, heads, capacity, values.shape[-1]),
            }
            return
        if self.end + new <= self.capacity:
            return
        live = len(self)
        if live + new <= self.capacity and self.start >= live:
            # Compact in place: the live range does not overlap its destination.
            for name, buffer in self._buffers.items():
                buffer[:, :, :live] = buffer[:, :, self.start : self.end]
            self.start, self.end = 0, live
            return
        self._reallocate(live + new)

    def _reallocate(self, tokens: int) -> None:
        """Move the live tokens into fresh buffers sized for ``tokens`` (plus slack)."""
        self._install({name: self._live(name) for name in self._buffers}, len(self), tokens)

    def _install(self, live: dict[str, torch.Tensor], count: int, tokens: int | None = None) -> None:
        capacity = (tokens or count) + slack_tokens(tokens or count)
        fresh = {}
        for name, tensor in live.items():
            shape = list(tensor.shape)
            shape[TOKEN_AXIS] = capacity
            fresh[name] = tensor.new_empty(shape)
            fresh[name][:, :, :count] = tensor
        self._buffers = fresh
        self.start, self.end = 0, count
