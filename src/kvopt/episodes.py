"""EpiCache across the turns of a chat: the history's episodes kept, compressed, and each question routed to its own.

A single ``epicache`` cache keeps the episode its *first* question needs; the next question, about another topic,
would find that topic evicted. EpiCache's answer (arXiv 2509.17396, ALGORITHMS.md section 23) is to keep one
compressed cache per episode and route every question to its episode's cache, dropping the question and answer
afterwards so the episode serves the next question. A :class:`EpisodicConversation` does that for a conversation
that goes on:

- The turns since the last **consolidation** (the *tail*) stay whole, as token ids: each turn computes them again on
  top of the routed episode's cache (at most ``block`` tokens plus the new turn), then forgets that KV, so an
  episode's cache never holds another episode's question.
- When the tail outgrows epicache's ``block`` the whole history is **consolidated**: one lossless prefill, its
  segments embedded and clustered into ``episodes`` (as a one-shot epicache prompt is), and one compressed cache per
  episode, each scored by its own patched prompt (E scoring passes over one prefill, not E prefills). The space the
  segments were embedded in (:mod:`kvopt.methods.segment_spaces`) and the centroids are kept to route later
  questions the same way.
- The state saves to one file (:meth:`to_bytes`): every episode's cache as :func:`kvopt.save_cache` writes it, inside
  one checksummed container, so a session resumes with its episodes or fails whole.

Memory: the episodes hold ``episodes`` x the budget (the paper parks them on the CPU); a turn holds one of them plus
the tail. While it runs, a consolidation holds the history's recorded lossless prefill (keys, values and the queries
methods replay from: about 3x the history's lossless KV with grouped-query attention) and one episode being
compressed. Time: a turn prefills the tail and its own tokens; a consolidation prefills the history once and scores
it once per episode and block (in the engine, the other sequences wait for it).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

import torch

from kvopt.api import build_cache
from kvopt.codec import container
from kvopt.codec.errors import CacheCorruptError
from kvopt.codec.fingerprint import check_fingerprint, model_fingerprint
from kvopt.codec.session import cache_bytes, cache_from_bytes
from kvopt.errors import KVOptError
from kvopt.methods import canonical_spec, parse, spec_text
from kvopt.methods.epicache import INSTRUCTION, EpiCache, compress_blockwise, patched_prompt, plan_conversation, route
from kvopt.methods.segment_spaces import SegmentSpace, StatesSpace, space_from_state
from kvopt.methods.recording import record_prefill

KIND = "kvopt-episodes"
#: Bumped when the saved state changes meaning (format 1 is read; an unknown one is refused, naming both versions).
VERSION = 2


@dataclass
class EpisodicConversation:
    """A conversation's episodes: ``history`` tokens consolidated into one compressed cache per episode."""

    spec: str
    history: int = 0
    #: Digest of the history's token ids: a prompt that does not start with them is another conversation.
    digest: str = ""
    #: The space the history's segments were embedded in (places a question as they were) and the episodes' centroids.
    space: SegmentSpace | None = None
    centroids: torch.Tensor | None = None
    #: Each episode's compressed cache, as :func:`kvopt.codec.session.cache_bytes` writes it (restored per turn).
    episodes: list[bytes] = field(default_factory=list)
    #: How episode caches are encoded (``kvopt.save_cache``'s encodings).
    encoding: str = "raw"

    def __post_init__(self) -> None:
        self.method = episodic_method(self.spec)
        self.spec = canonical_spec(self.spec)  # as a cache names its spec

    def prepare(self, model, tokenizer, ids: list[int]) -> None:
        """Make the episodes ready for a turn whose prompt is ``ids`` (the conversation so far and the new turn): a
        prompt that does not continue the history drops them; more than one block of turns before its question
        since the last consolidation consolidates everything before the question."""
        if self.episodes and not self.continues(ids):
            self.history, self.digest, self.space, self.centroids, self.episodes = 0, "", None, None, []
        question = plan_conversation(ids, tokenizer, self.method.utterances, self.method.window).question_start
        if question - self.history > self.method.block:
            self.consolidate(model, tokenizer, ids[:question])

    def continues(self, ids: list[int]) -> bool:
        """Whether ``ids`` starts with the consolidated history (and goes on past it)."""
        return len(ids) > self.history and token_digest(ids[: self.history]) == self.digest

    @torch.inference_mode()
    def consolidate(self, model, tokenizer, ids: list[int]) -> None:
        """Build one compressed cache per episode of ``ids`` (the whole history, ending after an answer)."""
        plan = plan_conversation(ids, tokenizer, self.method.utterances, window=0)
        space, points, labels, centroids = self.method.cluster(model, [ids[start:stop] for start, stop in plan.segments])
        recorded, _ = record_prefill(model, torch.as_tensor([ids], device=model.device), logits_to_keep=1)
        instruction = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"]
        episodes = []
        for episode in range(len(centroids)):
            cache = build_cache(self.spec, model)
            cache.replay_prefill(recorded)
            patched = patched_prompt(ids, plan.segments, points, labels, centroids, episode, self.method.medoids,
                                     self.method.patch)  # fmt: skip
            budgets = self.method.layer_targets(cache.layers, len(ids))
            compress_blockwise(cache, model, ids, len(ids), budgets, instruction + patched, self.method.block,
                               self.method.level)
            episodes.append(cache_bytes(cache, model, self.encoding))
        self.history, self.digest, self.space, self.centroids, self.episodes = len(ids), token_digest(ids), space, centroids, episodes

    def cache_for(self, model, tokenizer, ids: list[int], episode: int | None = None):
        """``(cache, episode)``: the cache a turn whose prompt is ``ids`` starts from, its routed episode's restored
        (or ``episode``'s, when given; None and a lossless cache while nothing is consolidated); the caller feeds it
        ``ids``."""
        if not self.episodes:
            return build_cache("full", model), None
        if episode is None:
            question = plan_conversation(ids, tokenizer, self.method.utterances, self.method.window).question_start
            episode = route(self.space.points(model, [ids[max(question, self.history) :]])[0], self.centroids)
        return cache_from_bytes(self.episodes[episode], model, f"episode {episode}")[0], episode

    def nbytes(self) -> int:
        """Bytes held: the episodes' cache files, their centroids and the space that routes to them."""
        routing = 0 if self.space is None else self.space.nbytes() + self.centroids.numel() * self.centroids.element_size()
        return routing + sum(len(episode) for episode in self.episodes)

    def to_bytes(self, model, meta: dict) -> bytes:
        """One container: the state and ``meta`` (JSON-able) in its header, each episode's cache file a chunk."""
        header = {"kind": KIND, "version": VERSION, "model": model_fingerprint(model), "spec": self.spec, "history": self.history,
                  "digest": self.digest, "encoding": self.encoding, "meta": meta,
                  "space": None if self.space is None else self.space.state(),
                  "centroids": None if self.centroids is None else self.centroids.tolist()}  # fmt: skip
        return container.pack(header, self.episodes)

    @classmethod
    def from_header(cls, header: dict, chunks: list, model, source: str) -> EpisodicConversation:
        """The conversation :meth:`to_bytes` wrote, for ``model`` (its episodes are checked again when restored)."""
        if header.get("version") == 1:
            header = from_version_1(header)
        if header.get("version") != VERSION:
            raise CacheCorruptError(f"{source} holds episodes in format {header.get('version')!r}, this kvopt reads "
                                    f"{VERSION}; start a new session, or use the kvopt that wrote it")  # fmt: skip
        if not isinstance(header.get("model"), dict):
            raise CacheCorruptError(f"{source}: its episodes name no model; the file is damaged")
        check_fingerprint(header["model"], model, source)
        try:
            space = None if header["space"] is None else space_from_state(header["space"])
            centroids = None if header["centroids"] is None else torch.tensor(header["centroids"], dtype=torch.float32)
            state = cls(header["spec"], int(header["history"]), str(header["digest"]), space, centroids,
                        [bytes(chunk) for chunk in chunks], header["encoding"])  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise CacheCorruptError(f"{source}: its episodes cannot be read ({error}); the file is damaged") from None
        if not state.matches(model):
            raise CacheCorruptError(f"{source}: its episodes do not match their space and centroids; the file is damaged")
        return state

    def matches(self, model) -> bool:
        """Whether the episodes, their centroids and their space agree (a loaded state's consistency)."""
        if not self.episodes:
            return self.space is None and self.centroids is None
        return (self.history > 0 and self.space is not None and self.space.kind == self.method.embedding
                and self.space.fits(model) and self.centroids is not None
                and tuple(self.centroids.shape) == (len(self.episodes), self.space.dim))  # fmt: skip


def from_version_1(header: dict) -> dict:
    """A format-1 header as format 2 writes it: format 1 routed by the model's states (no ``embedding=`` then) and
    saved their mean, which is that space's whole state; a damaged one is left for the checks to refuse."""
    try:
        methods = parse(header["spec"])
    except (KeyError, TypeError, KVOptError):
        return header
    for method in methods:
        if isinstance(method, EpiCache):
            method.embedding = StatesSpace.kind
    space = None if header.get("mean") is None else {"kind": StatesSpace.kind, "mean": header["mean"]}
    return {**header, "version": 2, "spec": spec_text(methods), "space": space}


def token_digest(ids: list[int]) -> str:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


def episodic_method(spec: str) -> EpiCache:
    """The ``epicache`` method of ``spec`` (composed methods, such as a quantizer after it, act in every episode)."""
    found = [method for method in parse(spec) if isinstance(method, EpiCache)]
    if not found:
        raise KVOptError(f"an episodic conversation needs epicache in its spec, not {spec!r}; use e.g. epicache:ratio=0.75")
    return found[0]


def is_episodic(spec: str) -> bool:
    """Whether a conversation run by ``spec`` keeps episodes (epicache's) rather than one cache."""
    return any(isinstance(method, EpiCache) for method in parse(spec))
