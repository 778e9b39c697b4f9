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
  episode, each scored by its own patched prompt (E scoring passes over one prefill, not E prefills). The history's
  mean embedding and the centroids are kept to route later questions the same way.
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
from kvopt.methods import canonical_spec, parse
from kvopt.methods.epicache import (
    INSTRUCTION, EpiCache, centred, compress_blockwise, kmeans, patched_prompt, plan_conversation, pooled_states, route,
)  # fmt: skip
from kvopt.methods.recording import record_prefill

KIND = "kvopt-episodes"
#: Bumped when the saved state changes meaning (an older file is refused, naming both versions).
VERSION = 1


@dataclass
class EpisodicConversation:
    """A conversation's episodes: ``history`` tokens consolidated into one compressed cache per episode."""

    spec: str
    history: int = 0
    #: Digest of the history's token ids: a prompt that does not start with them is another conversation.
    digest: str = ""
    #: The history's mean pooled embedding (centres a question as the segments were) and the episodes' centroids.
    mean: torch.Tensor | None = None
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
            self.history, self.digest, self.mean, self.centroids, self.episodes = 0, "", None, None, []
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
        pooled = pooled_states(model, [ids[start:stop] for start, stop in plan.segments])
        mean = pooled.mean(dim=0)
        points = centred(pooled, mean)
        labels, centroids = kmeans(points, min(self.method.episodes, len(plan.segments)))
        recorded, _ = record_prefill(model, torch.as_tensor([ids], device=model.device), logits_to_keep=1)
        instruction = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"]
        episodes = []
        for episode in range(len(centroids)):
            cache = build_cache(self.spec, model)
            cache.replay_prefill(recorded)
            patched = patched_prompt(ids, plan.segments, points, labels, centroids, episode, self.method.medoids,
                                     self.method.patch)  # fmt: skip
            budgets = self.method.layer_targets(cache.layers, len(ids))
            compress_blockwise(cache, model, ids, len(ids), budgets, instruction + patched, self.method.block)
            episodes.append(cache_bytes(cache, model, self.encoding))
        self.history, self.digest, self.mean, self.centroids, self.episodes = len(ids), token_digest(ids), mean, centroids, episodes

    def cache_for(self, model, tokenizer, ids: list[int], episode: int | None = None):
        """``(cache, episode)``: the cache a turn whose prompt is ``ids`` starts from, its routed episode's restored
        (or ``episode``'s, when given; None and a lossless cache while nothing is consolidated); the caller feeds it
        ``ids``."""
        if not self.episodes:
            return build_cache("full", model), None
        if episode is None:
            question = plan_conversation(ids, tokenizer, self.method.utterances, self.method.window).question_start
            query = centred(pooled_states(model, [ids[max(question, self.history) :]])[0], self.mean)
            episode = route(query, self.centroids)
        return cache_from_bytes(self.episodes[episode], model, f"episode {episode}")[0], episode

    def to_bytes(self, model, meta: dict) -> bytes:
        """One container: the state and ``meta`` (JSON-able) in its header, each episode's cache file a chunk."""
        header = {"kind": KIND, "version": VERSION, "model": model_fingerprint(model), "spec": self.spec, "history": self.history,
                  "digest": self.digest, "encoding": self.encoding, "meta": meta,
                  "mean": None if self.mean is None else self.mean.tolist(),
                  "centroids": None if self.centroids is None else self.centroids.tolist()}  # fmt: skip
        return container.pack(header, self.episodes)

    @classmethod
    def from_header(cls, header: dict, chunks: list, model, source: str) -> EpisodicConversation:
        """The conversation :meth:`to_bytes` wrote, for ``model`` (its episodes are checked again when restored)."""
        if header.get("version") != VERSION:
            raise CacheCorruptError(f"{source} holds episodes in format {header.get('version')!r}, this kvopt reads "
                                    f"{VERSION}; start a new session, or use the kvopt that wrote it")  # fmt: skip
        if not isinstance(header.get("model"), dict):
            raise CacheCorruptError(f"{source}: its episodes name no model; the file is damaged")
        check_fingerprint(header["model"], model, source)
        try:
            tensor = lambda values: None if values is None else torch.tensor(values, dtype=torch.float32)  # noqa: E731
            state = cls(header["spec"], int(header["history"]), str(header["digest"]), tensor(header["mean"]),
                        tensor(header["centroids"]), [bytes(chunk) for chunk in chunks], header["encoding"])  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise CacheCorruptError(f"{source}: its episodes cannot be read ({error}); the file is damaged") from None
        shapes = [] if state.centroids is None else [tuple(state.centroids.shape), tuple(state.mean.shape)]
        expected = [] if not state.episodes else [(len(state.episodes), model.config.get_text_config().hidden_size),
                                                  (model.config.get_text_config().hidden_size,)]  # fmt: skip
        if shapes != expected or (state.episodes and not state.history):
            raise CacheCorruptError(f"{source}: its episodes do not match their centroids ({shapes} for {expected}); "
                                    "the file is damaged")  # fmt: skip
        return state


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
