"""A prompt assembled from reused chunk KV and new text, with selective recompute (CacheBlend, EPIC).

The prompt is pieces in order: new text (token ids, computed normally) and :class:`~kvopt.chunks.store.Chunk` s,
whose stored KV is moved to their position in the prompt by a RoPE rotation. Reused chunks never saw
the text before them, so some of their tokens are recomputed, and which ones is the strategy:

- ``cacheblend`` (Yao et al., arXiv 2405.16444; ALGORITHMS.md §25): layers ``0..check_layer`` run on the
  whole prompt; at ``check_layer`` each chunk token's deviation is ``sum((V_new - V_reused)^2)`` over KV heads
  and channels (the prototype's value deviation, one check layer as both codebases), and the top
  ``blend_ratio`` share of chunk tokens, with every new-text token, are the only ones computed in the later
  layers, whose KV replaces the reused one at their positions; the others keep the reused KV.
  ``blend_ratio=0`` is plain concatenation (only new text is computed, in every layer), ``1`` a full prefill.
- ``epic`` (LegoLink, arXiv 2410.15332; §26): the first ``epic_tokens`` tokens of every chunk not placed right
  after its preamble (its spurious attention sinks) and the new text are recomputed through all layers.

A chunk placed right after the text it was computed after (its preamble, see :mod:`kvopt.chunks.store`: the
first document after the system prompt, or a system prompt opening the prompt) saw exactly what it sees here:
its reused KV is what a prefill computes, so no strategy recomputes it and CacheBlend's share counts only the others.

Recomputed tokens attend causally to everything before them, reused and recomputed alike: the
model's own decoder layers run on them alone (the hooks and :class:`~kvopt.methods.fastkv.Propagated` FastKV
uses), over a layer storage holding the reused tokens as one more part at their global positions.
The result is an ordinary :class:`~kvopt.cache.kv_cache.KVCache` holding every prompt token but the last:
``model.generate(result.input_ids, past_key_values=result.cache)`` computes the last one and continues.
A compressed spec acts once blending is done, by replaying the blended prefill
(:meth:`KVCache.replay_prefill`) with the queries of the trailing new text (the question), which is
what query-aware selection (SnapKV's window) reads; methods needing the whole prompt's queries see only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvopt.api import build_cache
from kvopt.cache.kv_cache import RECORDED_PREFILL, KVCache
from kvopt.cache.layer import AttentionStep
from kvopt.cache.storage import DenseKVStore
from kvopt.chunks.store import Chunk, ChunkError, ChunkStore
from kvopt.methods.base import Method
from kvopt.methods.fastkv import Propagated, install
from kvopt.models.forward import cache_kwargs

STRATEGIES = ("cacheblend", "epic")


@dataclass
class Blended:
    """A blended prompt: ``cache`` holds ``input_ids``' tokens but the last (pass both to ``generate``)."""

    cache: KVCache
    input_ids: torch.Tensor
    #: Chunk tokens (of those cached) whose KV was reused, and how many of them were recomputed past the check.
    chunk_tokens: int
    recomputed: int


@dataclass
class _Plan:
    """What the blend forward needs, for ``width`` cached tokens."""

    width: int
    #: Reused keys (at their prompt positions) and values per layer ``[1, kv_heads, width, dim]`` (zeros on new text).
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    #: ``[width]`` True where a token is new text (always computed).
    fresh: torch.Tensor
    #: ``[width]`` True where a token is a reused chunk's that saw other text before it here (one CacheBlend may pick).
    moved: torch.Tensor
    #: ``[width]`` True where a token is recomputed from layer 0 on (EPIC, plain concatenation); None: CacheBlend.
    chosen: torch.Tensor | None
    ratio: float
    check_layer: int
    #: Trailing new-text tokens whose queries the replayed step carries.
    trailing: int
    recomputed: int = 0
    steps: dict[int, AttentionStep] = field(default_factory=dict)


@dataclass
class _Blender(Method):
    """Unregistered: selects the recomputed tokens at the check layer and records the trailing queries."""

    plan: _Plan | None = None

    def after_attention(self, layer, step: AttentionStep) -> None:
        plan = self.plan
        if plan.trailing:
            query = step.query[:, :, -plan.trailing :]
            plan.steps[layer.index] = AttentionStep(
                step.module, query, step.query_positions[..., -plan.trailing :], step.scaling, True
            )
        if plan.chosen is None and layer.index == plan.check_layer:
            deviation = (layer.store.values.float() - plan.values[layer.index].float()).square().sum(dim=(0, 1, 3))
            count = round(plan.ratio * int(plan.moved.sum()))
            picked = deviation.masked_fill(~plan.moved, float("-inf")).topk(count).indices if count else deviation[:0].long()
            chosen = plan.fresh.clone()
            chosen[picked] = True
            plan.recomputed = count
            propagate(layer.siblings[layer.index + 1 :], plan, chosen)


def propagate(layers, plan: _Plan, chosen: torch.Tensor) -> None:
    """Let only the ``chosen [width]`` tokens reach ``layers``, which hold the others' reused KV as a part."""
    if bool(chosen.all()):
        return  # every token computed: a full prefill from here on
    columns = chosen.nonzero()[:, 0]
    kept = (~chosen).nonzero()[:, 0]
    for layer in layers:
        reused = DenseKVStore.wrap(
            plan.keys[layer.index][:, :, kept], plan.values[layer.index][:, :, kept],
            positions=kept.to(torch.int32).view(1, 1, -1),
        )  # fmt: skip
        layer.add_part(reused)
    Propagated(columns[None], plan.width, plan.width, layers[0].index).hand_to(layers)


def blend(
    model, pieces: Sequence[Chunk | Sequence[int]], store: ChunkStore, blend_ratio: float = 0.15,
    strategy: str = "cacheblend", epic_tokens: int = 16, check_layer: int | None = None,
) -> Blended:  # fmt: skip
    """``pieces`` (new text as token ids, reused :class:`Chunk` s) as a cache for ``store.method``, see the module."""
    layers = store.info.num_layers
    check_settings(blend_ratio, strategy, epic_tokens, check_layer, layers)
    check = min(1, layers - 2) if check_layer is None else check_layer
    ids, fresh, placed = _layout(pieces)
    limit = store.info.max_positions
    if limit is not None and len(ids) > limit:
        raise ChunkError(f"the prompt's chunks and text take {len(ids)} tokens, over the model's {limit} positions; "
                         "pass fewer or shorter chunks")  # fmt: skip
    device = next(model.parameters()).device
    width = len(ids) - 1
    plan = _plan(store, ids, placed, fresh[:width], width, device)
    plan.check_layer, plan.ratio = check, blend_ratio
    if strategy == "epic":
        plan.chosen = plan.fresh.clone()
        for start, chunk in placed:
            if not _exact(ids, start, chunk):
                plan.chosen[start : min(start + epic_tokens, width)] = True
    elif blend_ratio == 0.0 or not (plan.fresh.any() or round(blend_ratio * int(plan.moved.sum()))):
        plan.chosen = plan.fresh.clone()  # concatenation (also CacheBlend with no token to compute past its check)
    if store.method != "full" and not plan.trailing:
        raise ChunkError(f"{store.method} acts after blending with the queries of the text after the last chunk; "
                         "end the prompt with new text (the question)")  # fmt: skip
    cache = _blend_forward(model, torch.tensor([ids], device=device), plan)
    target = build_cache(store.method, model)
    if width:
        target.replay_prefill(cache)
    chunk_tokens = int((~plan.fresh).sum())
    recomputed = int((plan.chosen & ~plan.fresh).sum()) if plan.chosen is not None else plan.recomputed
    return Blended(target, torch.tensor([ids], device=device), chunk_tokens, recomputed)


def check_settings(blend_ratio: float, strategy: str, epic_tokens: int = 16, check_layer: int | None = None,
                   layers: int | None = None) -> None:  # fmt: skip
    """One :class:`ChunkError` line for a blend setting out of range (``check_layer`` against a model's ``layers``)."""
    if strategy not in STRATEGIES:
        raise ChunkError(f"unknown blend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not 0.0 <= blend_ratio <= 1.0:
        raise ChunkError(f"blend_ratio={blend_ratio} is outside [0, 1]: the share of chunk tokens recomputed "
                         "(0 = plain concatenation, 1 = full prefill), e.g. 0.15")  # fmt: skip
    if epic_tokens < 0:
        raise ChunkError(f"epic_tokens={epic_tokens} must be >= 0 (tokens recomputed at each chunk's start), e.g. 16")
    if check_layer is not None and layers is not None and not 0 <= check_layer <= layers - 2:
        raise ChunkError(f"check_layer={check_layer} leaves no later layer to recompute selectively (the model has "
                         f"{layers} layers); choose 0..{layers - 2}")  # fmt: skip


def _layout(pieces: Sequence[Chunk | Sequence[int]]) -> tuple[list[int], torch.Tensor, list[tuple[int, Chunk]]]:
    """The prompt's ids, which are new text, and each chunk's start."""
    ids: list[int] = []
    flags: list[bool] = []
    placed: list[tuple[int, Chunk]] = []
    for piece in pieces:
        if isinstance(piece, Chunk):
            placed.append((len(ids), piece))
            ids.extend(piece.tokens)
            flags.extend([False] * len(piece.tokens))
        else:
            ids.extend(int(token) for token in piece)
            flags.extend([True] * len(piece))
    if not ids:
        raise ChunkError("the prompt is empty; pass at least one chunk or some text")
    return ids, torch.tensor(flags, dtype=torch.bool), placed


def _exact(ids: list[int], start: int, chunk: Chunk) -> bool:
    """Whether the prompt puts exactly the chunk's preamble before it (its stored KV is then a prefill's)."""
    return start == len(chunk.preamble) and tuple(ids[:start]) == chunk.preamble


def _plan(store: ChunkStore, ids: list[int], placed, fresh: torch.Tensor, width: int, device) -> _Plan:
    """Reused KV of the first ``width`` tokens, each chunk's keys moved to its start."""
    fresh = fresh.to(device)
    trailing = int(fresh.flip(0).cumprod(0).sum()) if width else 0
    found = [(start, store.get(chunk)) for start, chunk in placed if start < width]
    keys, values = [], []
    for layer in range(store.info.num_layers):
        like = found[0][1].values[layer] if found else None
        shape = (1, store.info.num_kv_heads, width, store.info.head_dim)
        dtype = like.dtype if like is not None else next(store.model.parameters()).dtype
        layer_keys = torch.zeros(shape, dtype=dtype, device=device)
        layer_values = torch.zeros(shape, dtype=dtype, device=device)
        for start, kv in found:
            end = min(start + len(kv.tokens), width)
            layer_keys[:, :, start:end] = store.shifted_keys(kv, layer, start)[:, :, : end - start]
            layer_values[:, :, start:end] = kv.values[layer][:, :, : end - start]
        keys.append(layer_keys)
        values.append(layer_values)
    moved = ~fresh
    for start, chunk in placed:
        if _exact(ids, start, chunk):
            moved[start : start + len(chunk.tokens)] = False
    return _Plan(width, keys, values, fresh, moved, None, 0.0, 0, trailing)


def _blend_forward(model, ids: torch.Tensor, plan: _Plan) -> KVCache:
    """Run the first ``plan.width`` tokens through the model, recomputing what the plan says; one dense store per
    layer afterwards (reused and recomputed tokens in position order), with the trailing queries recorded."""
    blender = _Blender(plan)
    cache = KVCache.for_model([blender], model)
    if not plan.width:
        return cache
    # Nothing to recompute (chunks only before the last token, blended by concatenation or EPIC): no forward at all.
    computes = plan.chosen is None or bool(plan.chosen.any())
    if computes:
        install(model)
        if plan.chosen is not None:
            propagate(cache.layers, plan, plan.chosen)
        with torch.no_grad():
            model(input_ids=ids[:, : plan.width], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        keys, values = plan.keys[layer.index].clone(), plan.values[layer.index].clone()
        if computes:
            columns = layer.store.positions[0, 0].long()
            keys[:, :, columns] = layer.store.keys
            values[:, :, columns] = layer.store.values
        else:  # the layer saw no forward: it holds the reused tokens as if it had
            columns = torch.zeros(0, dtype=torch.long, device=keys.device)
            layer.lazy_initialization(keys, values)
            layer.seen = plan.width
        layer.store, layer.parts = DenseKVStore.wrap(keys, values), []
        layer.state[RECORDED_PREFILL] = plan.steps.get(
            layer.index, AttentionStep(None, keys[:, :0], columns[:0], None, True)
        )
    return cache
