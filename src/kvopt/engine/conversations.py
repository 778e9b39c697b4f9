"""Named conversations in the engine: a request that continues a session is answered from its episode (EpiCache).

A request ``{"session": "notes", "prompt": ...}`` (``llm.generate``) is a turn of the conversation of that name:
its prompt is the conversation so far and the new turn, as a chat client resends it. The session's spec must hold
``epicache``: the engine keeps the session's episodes (:class:`kvopt.episodes.EpisodicConversation`, in host memory
beside the pool, as the paper parks them on the CPU) and computes the turn on top of the episode its question
matches, after clustering and compressing the history again when it grew by more than one block since the last
time (a prompt that does not start with the clustered history starts the episodes over). A lossless conversation
needs no session: the prefix cache already reuses its earlier turns.

One turn of a session runs at a time (the next one continues its output); its sequence is an ordinary own-cache
sequence (:class:`~kvopt.engine.kv.cache_backed.CacheBackedKV`) from then on, preempted and restored like any.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvopt.engine.kv.cache_backed import CacheBackedKV
from kvopt.episodes import EpisodicConversation, is_episodic

if TYPE_CHECKING:
    from kvopt.engine.kv.paged import PagedKVPool
    from kvopt.engine.sequence import Sequence


#: What a session costs beside its episodes (name, state), charged so that a flood of names stays bounded too.
SESSION_BYTES = 4096
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class SessionPrompt:
    """A turn of the conversation ``session``: ``prompt`` is the conversation so far plus the new turn."""

    session: str
    prompt: str | list[int]


@dataclass
class Session:
    """A conversation's episodes."""

    conversation: EpisodicConversation
    #: Whether a turn is being answered (the next one may build on it: one at a time).
    busy: bool = False


def turn_problem(name: str, spec: str, n: int) -> str | None:
    """Why a turn of session ``name`` run by ``spec`` with ``n`` completions cannot be served by any engine (what the
    request alone decides: ``kvopt batch`` asks before the model loads); None if it can."""
    if not is_episodic(spec):
        return (f"session {name!r}: sessions keep epicache's episodes, and this request runs {spec!r}; "
                "give kv_method='epicache:ratio=0.75' (a lossless conversation needs no session: the prefix "
                "cache reuses its earlier turns)")  # fmt: skip
    if n != 1:
        return f"session {name!r}: a turn of a session has one completion; give n=1"
    if not NAME.fullmatch(name):
        return (f"session {name[:40]!r}: a session name is 1-100 letters, digits, '.', '_' or '-' (it is "
                "shared by every client of this engine: make it hard to guess)")  # fmt: skip
    return None


class Sessions:
    """The engine's named conversations, their episodes within ``memory`` bytes (least recently used idle ones go
    first; the one just used stays even when it alone exceeds it)."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.named: OrderedDict[str, Session] = OrderedDict()

    def begin(self, name: str, spec: str, n: int) -> tuple[Session | None, str | None]:
        """The session a turn continues, now busy; or why the turn cannot be served."""
        problem = turn_problem(name, spec, n)
        if problem:
            return None, problem
        fresh = EpisodicConversation(spec)
        session = self.named.setdefault(name, Session(fresh))
        if session.conversation.spec != fresh.spec:
            return None, f"session {name!r} runs {session.conversation.spec!r}; give that kv_method or a new session"
        if session.busy:
            return None, f"session {name!r} is answering a turn; send the next one after it finishes"
        self.named.move_to_end(name)
        session.busy = True
        return session, None

    def end(self, session: Session) -> None:
        """A turn ended; idle sessions beyond the memory are dropped, least recently used first."""
        session.busy = False
        held = sum(self.nbytes(other) for other in self.named.values())
        for name, other in list(self.named.items()):
            if held <= self.memory or other is session:
                break
            if not other.busy:
                held -= self.nbytes(other)
                del self.named[name]

    @staticmethod
    def nbytes(session: Session) -> int:
        """Its episodes' bytes, plus what any session costs (so sessions that never clustered are bounded too)."""
        return SESSION_BYTES + session.conversation.nbytes()


class EpisodicKV(CacheBackedKV):
    """A session's turn: its cache starts from the episode its question matches (consolidated first when due)."""

    #: Its state depends on the session's episodes, not only on the spec and the tokens a tier key holds.
    keeps_prompt_state: ClassVar[bool] = False

    def __init__(self, session: Session, methods: list, model, tokenizer, pool: PagedKVPool) -> None:
        super().__init__(methods, model, tokenizer, pool)
        self.session = session
        #: Whether the session's episodes were made ready for this turn, and the episode it was routed to (None while
        #: the session has none): a recomputation after a preemption keeps both.
        self.prepared = False
        self.episode: int | None = None

    @torch.inference_mode()
    def compute_prompt(self, seq: Sequence, count: int) -> torch.Tensor:
        """The turn's prompt on top of its episode; recomputed after a preemption, the same episode and the output
        so far (which is no part of the conversation's history: only the prompt is clustered and routed)."""
        conversation, prompt = self.session.conversation, seq.token_ids[: seq.num_prompt_tokens]
        if not self.prepared:
            conversation.prepare(self.model, self.tokenizer, prompt)
            self.prepared = True
        cache, self.episode = conversation.cache_for(self.model, self.tokenizer, prompt, self.episode)
        fed = seq.token_ids[cache.get_seq_length() : count]
        return self.continue_prompt(cache, torch.tensor([fed], device=next(self.model.parameters()).device))
