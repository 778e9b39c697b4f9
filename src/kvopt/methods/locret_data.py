"""Training sequences for Locret's retaining heads: prose continuations and planted facts asked back.

A head learns a token's importance from the queries of a sequence's *answer* (its last tokens; see
:mod:`kvopt.methods.locret_heads`). In a prose continuation those queries rarely reach far back, so
heads trained on prose alone learn that a stray number or name deep in the text never matters, the
opposite of what a later question needs (format 2 ranked passkeys and needles *below* the average
token). The paper trains on SFT pairs whose answers do reach back; we have no downloads, so most
sequences here are made to: 1 to :data:`MOST_FACTS` facts (a key of two words and a number or a word
pair, in sentences of our own wording, not the evaluation's) planted at random sentence boundaries in
the machine's prose, or in a few of its sentences repeated (a filler whose one novel line is the
fact), and the answer asks every fact back and states it. The rest are plain prose continuations, so
the heads still rank ordinary text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvopt.words import ADJECTIVES, NOUNS
from kvopt.local_text import SENTENCE_END

#: Share of the sequences that plant facts and ask them back; the rest continue prose.
RETRIEVAL_SHARE = 0.75
MOST_FACTS = 4
#: Share of the fact sequences whose filler is a few prose sentences repeated (passkey-like) instead of prose.
REPEATED_SHARE = 0.3

#: ``(statement, question, answer, value)`` with ``{key}`` and ``{value}`` slots; the value is a number (4 to 7
#: digits), two words or a name.
TEMPLATES = (
    ("Keep in mind that the {key} code is {value}.", "What is the {key} code?", "The {key} code is {value}.",
     "number"),
    ("For the record, the {key} was stored in locker {value}.", "Which locker was the {key} stored in?",
     "The {key} was stored in locker {value}.", "number"),
    ("The {key} belongs to the person called {value}.", "Who does the {key} belong to?",
     "The {key} belongs to {value}.", "name"),
    ("Note: the password for the {key} is {value}.", "What is the password for the {key}?",
     "The password for the {key} is {value}.", "words"),
    ("The {key} arrived on the train numbered {value}.", "Which train did the {key} arrive on?",
     "The {key} arrived on train {value}.", "number"),
    ("It is agreed that the {key} will be painted {value}.", "What colour will the {key} be painted?",
     "The {key} will be painted {value}.", "words"),
)  # fmt: skip


@dataclass(frozen=True)
class TrainingSequence:
    """Token ids ``[1, T]`` whose last ``answer`` tokens are the queries that define the importance target."""

    ids: torch.Tensor
    answer: int


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    answer: str


def draw_fact(rng: random.Random) -> Fact:
    """A fact of a random template with a two-word key."""
    *texts, kind = rng.choice(TEMPLATES)
    key = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    words = rng.choice(ADJECTIVES), rng.choice(NOUNS)
    value = {"number": str(rng.randint(1000, 9_999_999)), "words": " ".join(words),
             "name": " ".join(w.title() for w in words)}[kind]  # fmt: skip
    return Fact(*(text.format(key=key, value=value) for text in texts))


def prose_sequences(ids: torch.Tensor, length: int, answer: int) -> list[TrainingSequence]:
    """``ids [N]`` cut into sequences of ``length`` tokens (the remainder dropped), the last ``answer`` the answer."""
    flat = ids.reshape(-1)
    return [TrainingSequence(flat[i * length : (i + 1) * length][None], answer) for i in range(flat.numel() // length)]


def retrieval_sequence(rng: random.Random, tokenizer, sentences: list[str], length: int,
                       facts: list[Fact]) -> TrainingSequence:  # fmt: skip
    """``length`` tokens: filler ``sentences`` with ``facts`` planted between them, then a question-and-answer tail
    asking every fact back (the answer)."""
    tail = "\n" + " ".join(f.question for f in facts) + "\n" + " ".join(f.answer for f in facts)
    tail_ids = _encode(tokenizer, tail)
    budget = length - len(tail_ids) - sum(len(_encode(tokenizer, " " + f.statement)) for f in facts)
    pool = rng.sample(sentences, rng.randint(2, 5)) if rng.random() < REPEATED_SHARE else None
    start = rng.randrange(len(sentences))
    filler: list[list[int]] = []
    while budget > 0:
        sentence = pool[len(filler) % len(pool)] if pool else sentences[(start + len(filler)) % len(sentences)]
        filler.append(_encode(tokenizer, " " + sentence)[:budget])
        budget -= len(filler[-1])
    pieces = list(filler)
    for fact in facts:  # at sentence boundaries, anywhere in the filler
        pieces.insert(rng.randint(0, len(pieces)), _encode(tokenizer, " " + fact.statement))
    ids = [token for piece in pieces for token in piece] + tail_ids
    return TrainingSequence(torch.tensor(ids[-length:])[None], len(tail_ids))


def training_sequences(tokenizer, text: str, count: int, length: int, answer: int, seed: int = 0) -> list[TrainingSequence]:
    """``count`` sequences of ``length`` tokens, :data:`RETRIEVAL_SHARE` of them with planted facts (in an order
    drawn from ``seed``) and the rest consecutive pieces of ``text`` whose last ``answer`` tokens are the answer."""
    rng = random.Random(seed)
    sentences = [s for s in SENTENCE_END.split(text) if 4 <= len(s.split()) <= 60]
    prose = prose_sequences(torch.tensor(_encode(tokenizer, text)), length, answer)
    planted = max(count - len(prose), round(count * RETRIEVAL_SHARE))
    kinds = [True] * planted + [False] * (count - planted)
    rng.shuffle(kinds)
    pieces = iter(prose)
    return [
        retrieval_sequence(rng, tokenizer, sentences, length, [draw_fact(rng) for _ in range(rng.randint(1, MOST_FACTS))])
        if kind else next(pieces)
        for kind in kinds
    ]  # fmt: skip


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
