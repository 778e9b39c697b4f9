"""``epicache``: a long conversation clustered into episodes, the question answered from its episode's cache.

EpiCache (arXiv 2509.17396, apple/ml-epicache; ALGORITHMS.md section 23). A single eviction pass over a long
history keeps what the *last* question needs and loses what a later question about an old topic needs. EpiCache
cuts the history into segments of ``utterances`` lines, clusters them into ``episodes`` topics, compresses one
cache per episode, scoring tokens by the attention a *patched prompt* (that episode's ``medoids`` most central
segments, in order, after a fixed instruction) pays them, and answers each question from the episode whose
centroid it matches. With the question in the prompt (one ``generate`` call: history + question), the question
is routed first and only its episode's cache is built and kept: the others would be built the same way and
never read (building one is what a per-episode cache costs; the question's KV stays, counted in the budget).

How this implementation chooses where the paper leaves a choice:

- **Segments** are lines (a token whose text holds a line break ends one; lines of at most 4 tokens, such as
  chat headers or blank lines, join the next; a line over 256 tokens is cut into blocks of 256, which is the
  fixed-block fallback for text without line breaks), ``utterances`` lines per segment (the paper's
  ``conv_window`` = 4). The *question* is the prompt from the first line start within its last ``window``
  tokens (the whole window when none is), so a chat question and its answer prefix form the query.
- **Embeddings** are the paper's free choice; ``embedding=`` picks one of :mod:`kvopt.methods.segment_spaces`:
  ``tfidf`` (default), the segments' token TF-IDF over the history, or ``states``, the model's mean-pooled
  middle-layer states. On the long-conversation task the first routes 21-22 of 24 questions to their fact's
  episode on both measured models, the second at chance (section "Long conversations" of BENCHMARKS.md).
- **Clustering** is k-means as sklearn's defaults run it for the paper (k-means++ seeding, 10 starts, seed 42),
  written in torch; the question goes to argmax <q, c_e> (centroids not re-normalised, as in the paper).
- **Scoring** is KVzip's (the paper builds on it): the max over the patched prompt's queries and the GQA group
  of their softmax attention (:func:`kvopt.methods.kvzip.score_reconstruction`); the patched prompt sits at the
  positions after the block, is attended over the retained tokens and the block, then forgotten.
- **Block-wise prefill eviction** walks the history in blocks of ``block`` tokens: the retained tokens plus
  the block are re-scored whenever they exceed the budget and the best stay. ``level`` says among what they
  are ranked: ``global`` (the default here, as KVzip's) ranks every layer's KV heads together, so layers and
  heads keep different numbers of tokens (ragged storage, ``budget`` per head on average); ``pair`` (the paper's
  default) ranks each layer's heads together; ``pair-uniform`` keeps ``budget`` in every head. Deviation from the
  paper's default, measured: on Qwen's long conversations ``global`` kept far more of ``full``'s answers than
  ``pair``, which kept fewer than ``pair-uniform`` (section "Long conversations" of BENCHMARKS.md). Another
  deviation: each block's keys and values come from the one lossless prefill every kvopt method runs
  (``cache.prefill``), so they were computed with the whole past in view where the paper computes them over the
  compressed past; peak memory while it runs is the full prompt's, as KVzip's. The patched prompt is at most ``patch`` tokens (its segments
  nearest the centroid first, the last one cut); the paper sets no cap. The first measured version had
  ``level=pair-uniform,patch=1024``: a patch cut at 1,024 tokens left most of an episode of ~400-token segments
  unscored, and ranking each head alone (or each layer's heads) lost facts that one ranking over every layer kept
  (measured on Qwen's long-conversation misses: section "Long conversations" of BENCHMARKS.md names both specs).
- **Budgets**: ``budget`` (or ``ratio``) is the prompt's share per layer and KV head, question included, as
  for SnapKV, so equal specs hold equal bytes (a question longer than the budget keeps its last tokens only).
  The layers share it by ``budgets=`` (:mod:`kvopt.methods.budgets`): ``uniform``, ``pyramid`` or ``xkv``, a
  measured layer sensitivity as the paper's section 4 asks for, though XKV's (attention retention) rather than
  the paper's own (key similarity under a block mask); the same total in every case.

Limits: one sequence per cache (each conversation routes its own question); no sliding-window layers. The
question must be in the prompt: ``kvopt eval --mode query_aware`` (a query-agnostic run compresses the context
before the question exists, and the last ``window`` tokens of the context would be routed instead). A cache keeps
one episode, its question's; a conversation that goes on keeps them all with :mod:`kvopt.episodes` (what
``kvopt chat --session NAME --method epicache:...`` does): every question routed to its own episode's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvopt.cache.ragged import RaggedKV
from kvopt.cache.storage import DenseKVStore
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.budgets import LayerBudgets
from kvopt.methods.eviction import Eviction
from kvopt.methods.kvzip import EXTRA, RECONSTRUCTION
from kvopt.methods.segment_spaces import SPACES, SegmentSpace
from kvopt.models.forward import cache_kwargs

#: The paper's instruction before the patched prompt (``prefill_memory_constrained``).
INSTRUCTION = "\n\nExtract essential information from this conversation segment:\n"
#: Lines this short (chat headers, blank lines) join the line after them.
SHORT_LINE = 4
#: A longer line is cut into blocks of this many tokens (text without line breaks: fixed blocks).
LONG_LINE = 256
#: How the budget is shared, KVzip's global ranking and the paper's two ``level``s: ``global`` ranks every layer's KV
#: heads together (KVzip's ``budgets=global``), ``pair`` a layer's heads (Ada-KV's variable-length heads),
#: ``pair-uniform`` keeps the budget in every head.
LEVELS = ("global", "pair", "pair-uniform")
#: sklearn's KMeans defaults as the paper calls it: starts and seed.
KMEANS_STARTS, KMEANS_SEED = 10, 42


@register
@dataclass
class EpiCache(LayerBudgets):
    """Cluster the history into episodes; keep the question's episode, compressed by its patched prompt's attention."""

    name = "epicache"
    summary = "episodic caches: history clustered into topics, question routed to its episode's cache (EpiCache)"
    needs_prefill_pass = True
    needs_tokenizer = True
    runs_in_engine = False  # the whole prompt and the tokenizer are needed before anything is kept

    episodes: int = field(default=4, metadata={"help": "topics the history is clustered into"})
    utterances: int = field(default=4, metadata={"help": "lines per segment (the unit clustered)"})
    medoids: int = field(default=8, metadata={"help": "segments nearest the centroid forming the patched prompt"})
    block: int = field(default=2048, metadata={"help": "history tokens per prefill block (eviction after each)"})
    patch: int = field(default=4096, metadata={"help": "most tokens of the patched prompt (nearest segments first)"})
    window: int = field(default=64, metadata={"help": "last prompt tokens searched for the question, kept"})
    embedding: str = field(default="tfidf", metadata={"help": "segment vectors: tfidf (token weights) or states (the model's)"})
    level: str = field(
        default="global", metadata={"help": "global: all layers' KV heads share the budget; pair: each layer's (the paper's); pair-uniform: none"}
    )

    def validate(self) -> None:
        super().validate()
        for name in ("episodes", "utterances", "medoids", "window"):
            if getattr(self, name) < 1:
                raise MethodParameterError(f"epicache: {name}={getattr(self, name)} must be >= 1, e.g. epicache:{name}=4")
        for name in ("block", "patch"):
            if getattr(self, name) < 16:
                raise MethodParameterError(
                    f"epicache: {name}={getattr(self, name)} must be >= 16 tokens, e.g. epicache:{name}=1024"
                )
        if self.level not in LEVELS:
            raise MethodParameterError(f"epicache: level={self.level!r} is not a budget level; use one of "
                                       f"{', '.join(LEVELS)}, e.g. epicache:level=pair")  # fmt: skip
        if self.level == "global" and self.budgets != "uniform":
            raise MethodParameterError(f"epicache: level=global (the default) ranks every layer's tokens together, so "
                                       f"budgets={self.budgets} has no layer shares to set; use level=pair with "
                                       f"budgets={self.budgets}, or leave budgets out")  # fmt: skip
        if self.embedding not in SPACES:
            raise MethodParameterError(f"epicache: embedding={self.embedding!r} is not a segment space; use one of "
                                       f"{', '.join(SPACES)}, e.g. epicache:embedding=tfidf")  # fmt: skip

    @property
    def storage(self) -> str | None:
        """Heads sharing a budget (``global``, ``pair``) hold different counts: ragged storage
        (:func:`kvopt.methods.spec.storage`)."""
        return None if self.level == "pair-uniform" else "ragged"

    def check_model(self, model) -> None:
        super().check_model(model)
        if any(window is not None for window in model.sliding_windows):
            raise MethodParameterError(
                "epicache: this model has sliding-window layers, which epicache cannot rebuild yet; use snapkv or kvzip"
            )

    def after_attention(self, layer, step) -> None:
        """Nothing during the prefill: segments, episodes and the question need the whole prompt."""

    def after_prefill(self, cache, model, input_ids, attention_mask, tokenizer) -> None:
        if tokenizer is None:
            raise CacheUsageError("epicache needs the tokenizer: call cache.prefill(model, ids, tokenizer=tokenizer)")
        if input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
            raise CacheUsageError("epicache routes one conversation per cache: pass one unpadded prompt (batch size 1)")
        ids = input_ids[0].tolist()
        plan = plan_conversation(ids, tokenizer, self.utterances, self.window)
        layers = cache.layers
        targets = self.layer_targets(layers, len(ids))
        question = max(plan.question_start, len(ids) - min(targets))  # a question over the budget keeps its end
        budgets = [target - (len(ids) - question) for target in targets]
        if question <= min(budgets):
            return  # the whole history fits
        prompt = []
        if any(budgets):
            space, points, labels, centroids = self.cluster(model, [ids[start:stop] for start, stop in plan.segments])
            episode = route(space.points(model, [ids[question:]])[0], centroids)
            patched = patched_prompt(ids, plan.segments, points, labels, centroids, episode, self.medoids, self.patch)
            prompt = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"] + patched
        compress_blockwise(cache, model, ids, question, budgets, prompt, self.block, self.level)

    def cluster(self, model, segments: list[list[int]]) -> tuple[SegmentSpace, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(space, points, labels, centroids)``: the ``embedding=`` space fitted on the history's ``segments``,
        their points in it, and their k-means into at most ``episodes`` episodes."""
        space, points = SPACES[self.embedding].fit(model, segments)
        return space, points, *kmeans(points, min(self.episodes, len(segments)))

    def layer_targets(self, layers, tokens: int) -> list[int]:
        """Prompt tokens each layer keeps (question included), shared by ``budgets=``; each layer records its equal
        share (later tokens add on top of it)."""
        shares = [int(Eviction.targets(self, layer, None)[0]) for layer in layers]
        if self.budgets == "uniform":
            return shares
        return [self.layer_budget(share, tokens, index, len(layers)) for index, share in enumerate(shares)]


@dataclass(frozen=True)
class Conversation:
    """Where a prompt's history segments lie and where its question starts."""

    #: ``(start, stop)`` token ranges of the history's segments, in order, covering ``[0, question_start)``.
    segments: list[tuple[int, int]]
    question_start: int


def plan_conversation(ids: list[int], tokenizer, utterances: int, window: int) -> Conversation:
    """Cut ``ids`` into lines and the lines into segments of ``utterances``; the question is the tail from the
    first line start within the last ``window`` tokens (see the module docstring)."""
    breaks = line_breaks(tokenizer, ids)
    starts = [0] + [i + 1 for i, token in enumerate(ids[:-1]) if token in breaks]
    tail = max(len(ids) - window, 1)
    question_start = next((start for start in starts if start >= tail), tail)
    lines, pending = [], 0
    for start, stop in zip(starts, [*starts[1:], len(ids)]):
        stop = min(stop, question_start)
        if start >= stop:
            break
        if stop - pending <= SHORT_LINE and stop < question_start:
            continue  # joins the next line
        lines += [(cut, min(cut + LONG_LINE, stop)) for cut in range(pending, stop, LONG_LINE)]
        pending = stop
    segments = [(lines[i][0], lines[min(i + utterances, len(lines)) - 1][1]) for i in range(0, len(lines), utterances)]
    return Conversation(segments, question_start)


def line_breaks(tokenizer, ids: list[int]) -> set[int]:
    """The ids among ``ids`` whose text holds a line break."""
    unique = sorted(set(ids))
    texts = tokenizer.batch_decode([[token] for token in unique])
    return {token for token, text in zip(unique, texts) if "\n" in text}


def kmeans(points: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels [n], centroids [k, dim])``: Lloyd's k-means from k-means++ seeds, the best of 10 starts by inertia
    (run on the CPU in fp64, as sklearn does; returned on the points' device)."""
    generator = torch.Generator().manual_seed(KMEANS_SEED)
    device, points = points.device, points.double().cpu()
    best = None
    for _ in range(KMEANS_STARTS):
        centroids = seed_centroids(points, k, generator)
        for _ in range(300):
            labels = torch.cdist(points, centroids).argmin(dim=1)
            moved = torch.stack([points[labels == j].mean(dim=0) if (labels == j).any() else centroids[j] for j in range(k)])
            if torch.equal(moved, centroids):
                break
            centroids = moved
        labels = torch.cdist(points, centroids).argmin(dim=1)
        inertia = float(((points - centroids[labels]) ** 2).sum())
        if best is None or inertia < best[0]:
            best = inertia, labels, centroids
    return best[1].to(device), best[2].float().to(device)


def seed_centroids(points: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++: the first centre uniformly, each next one with probability proportional to its squared distance."""
    chosen = [int(torch.randint(len(points), (1,), generator=generator))]
    for _ in range(1, k):
        distance = torch.cdist(points, points[chosen]).amin(dim=1) ** 2
        if float(distance.sum()) == 0.0:
            chosen.append(chosen[-1])
            continue
        chosen.append(int(torch.multinomial(distance, 1, generator=generator)))
    return points[chosen].clone()


def route(query: torch.Tensor, centroids: torch.Tensor) -> int:
    """The episode whose centroid has the largest dot product with the question's embedding."""
    return int((centroids @ query.to(centroids)).argmax())


def patched_prompt(
    ids: list[int], segments: list[tuple[int, int]], points: torch.Tensor, labels: torch.Tensor,
    centroids: torch.Tensor, episode: int, medoids: int, limit: int,
) -> list[int]:  # fmt: skip
    """The episode's ``medoids`` segments nearest its centroid (cosine), in chronological order, at most ``limit``
    tokens (nearest first; the one that overflows is cut)."""
    members = torch.nonzero(labels == episode).squeeze(-1)
    closeness = points[members].float() @ centroids[episode]  # points are unit vectors: cosine up to |c|
    nearest = members[closeness.argsort(descending=True)][:medoids].tolist()
    chosen, room = [], limit
    for index in nearest:
        if room <= 0:
            break
        start, stop = segments[index]
        chosen.append((index, start, min(stop, start + room)))
        room -= stop - start
    return [token for _, start, stop in sorted(chosen) for token in ids[start:stop]]


def compress_blockwise(
    cache, model, ids: list[int], history: int, budgets: list[int], prompt: list[int], block: int, level: str
) -> None:  # fmt: skip
    """Walk ``ids[:history]`` in blocks; whenever the retained tokens plus the block exceed the budget, keep the
    ``budgets[layer]`` tokens per KV head the patched ``prompt`` attends to most (ranked within each head, each
    layer or the whole cache by ``level``: :func:`sharing`); then hold them and the question."""
    layers = cache.layers
    full = [(layer.store.keys, layer.store.values) for layer in layers]
    heads, device = full[0][0].shape[1], full[0][0].device
    nothing = torch.empty(0, dtype=torch.long, device=device)
    row_budgets = [budget for budget in budgets for _ in range(heads)]  # rows: (layer, KV head), layer-major
    groups = sharing(level, len(layers), heads)
    kept = [nothing] * len(row_budgets)
    for start in range(0, history, block):
        stop = min(start + block, history)
        fresh = torch.arange(start, stop, device=device)
        kept = [torch.cat([held, fresh]) if budget else nothing for held, budget in zip(kept, row_budgets)]
        if all(fits(kept, row_budgets, group) for group in groups):
            continue
        install(layers, full, by_layer(kept, heads), stop, scoring=True)
        fed = torch.as_tensor([prompt[: max(1, (cache.info.max_positions or len(ids)) - stop)]], device=device)
        try:
            with torch.no_grad():
                model(input_ids=fed, attention_mask=torch.ones(1, stop + fed.shape[1], dtype=torch.long, device=device),
                      **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)  # fmt: skip
        finally:
            for layer in layers:
                layer.mode = None
        scores = [row for layer in layers for row in layer.store.extra(EXTRA)[0].float()]
        for group in groups:
            if not fits(kept, row_budgets, group):
                for row, positions in zip(group, best([scores[r] for r in group], [kept[r] for r in group],
                                                      sum(row_budgets[r] for r in group))):  # fmt: skip
                    kept[row] = positions
    question = torch.arange(history, len(ids), device=device)
    held = [torch.cat([positions, question]) for positions in kept]
    install(layers, full, by_layer(held, heads), len(ids), scoring=False, ragged=level != "pair-uniform")


def sharing(level: str, layers: int, heads: int) -> list[list[int]]:
    """The groups of rows ``layer * heads + head`` that share their budgets at ``level``: each row alone
    (``pair-uniform``), each layer's heads (``pair``) or every row (``global``)."""
    rows = list(range(layers * heads))
    if level == "pair-uniform":
        return [[row] for row in rows]
    if level == "pair":
        return [rows[layer * heads : (layer + 1) * heads] for layer in range(layers)]
    return [rows]


def by_layer(rows: list[torch.Tensor], heads: int) -> list[list[torch.Tensor]]:
    return [rows[start : start + heads] for start in range(0, len(rows), heads)]


def fits(kept: list[torch.Tensor], budgets: list[int], group: list[int]) -> bool:
    """Whether the ``group``'s rows hold no more positions than their budgets together."""
    return sum(len(kept[row]) for row in group) <= sum(budgets[row] for row in group)


def best(scores: list[torch.Tensor], held: list[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """Of the positions ``held[row]`` (scored in order by ``scores[row]``, which may run past them), the ``budget``
    best of all the rows together, each row's in order."""
    slots = max(len(positions) for positions in held)
    pooled = torch.full((len(held), slots), float("-inf"), device=scores[0].device)
    for row, (score, positions) in enumerate(zip(scores, held)):
        pooled[row, : len(positions)] = score[: len(positions)]
    winners = pooled.flatten().topk(budget).indices
    return [positions[(winners[winners // slots == row] % slots).sort().values] for row, positions in enumerate(held)]


def install(layers, full, kept: list[list[torch.Tensor]], seen: int, scoring: bool, ragged: bool = False) -> None:
    """Make each layer hold exactly the tokens at positions ``kept[layer][head]`` of ``full``, having seen ``seen``
    tokens: dense, heads padded to one length with the padding invalid, or with ``ragged`` in ragged storage (heads
    holding different counts, no padding: the bytes are the kept tokens'). With ``scoring``, the next forward
    scores them (KVzip's mode) and is then forgotten."""
    for layer, (keys, values), per_head in zip(layers, full, kept):
        if ragged:
            layer.store = DenseKVStore.wrap(keys, values)
            RaggedKV.move_into(layer, per_head)
        else:
            counts = [len(positions) for positions in per_head]
            length = max(counts)
            positions = torch.stack([nn.functional.pad(held, (0, length - len(held))) for held in per_head])
            valid = torch.arange(length, device=positions.device) < torch.tensor(counts, device=positions.device)[:, None]
            index = positions[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            layer.store = DenseKVStore.wrap(keys.gather(2, index), values.gather(2, index), positions[None].to(torch.int32),
                                            heads_aligned=False, valid=None if bool(valid.all()) else valid[None])  # fmt: skip
        layer.seen, layer.seen_real = seen, seen
        if scoring:
            layer.store.add_extra(EXTRA)
            layer.mode = RECONSTRUCTION
