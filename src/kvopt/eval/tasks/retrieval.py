"""Multi-document QA over local real prose: retrieved passages that recur across prompts in other orders.

A retrieval-augmented prompt holds ``passages`` documents of which one (or, in the two-hop variant, two)
holds the answer. The documents come from one fixed pool of :data:`POOL` passages of the local prose
(:func:`kvopt.local_text.real_text`), each stating two facts in the prose's register at sentence
boundaries: the registration number of its archive, and which other archive it replaced
(``"The calm otter archive replaced the bold falcon archive."``, the next passage of the pool). A
passage's text depends only on its pool index and the target length, so the same documents come back
in other prompts at other positions, which is what chunk caching reuses (:mod:`kvopt.chunks`).

- ``retrieval``: "What is the registration number of the calm otter archive?" (one passage holds it).
- ``retrieval_2hop``: "... of the archive that the calm otter archive replaced?": the link is in one passage,
  the number in another, so the answer needs attention across documents.

A prompt of up to 2k tokens holds ``passages`` documents (4 as registered); a longer one 4 more per 2k tokens, up
to half the pool (:meth:`Retrieval.count`: 8 at 4k, as CacheBlend's prompts of ~500-token passages).
The documents take about 70% of the target length less :data:`RESERVED` (:data:`PASSAGE_SHARE`, at an assumed
:data:`TOKENS_PER_WORD`); the rest, so the prompt fills the length as the sizing requires, is a background
preamble: the opening words of the same prose, the same for every prompt (a shared prefix). The
prompt's documents are ``metadata["passages"]`` in order; the context joins them with blank lines.
Scored like niah (the number found in the answer).
"""

from __future__ import annotations

import functools
import random

from kvopt.eval.tasks.base import Parts, Task, distinct, seeded_rng
from kvopt.eval.tasks.niah import insert_needles
from kvopt.eval.tasks.text import _indexed_words
from kvopt.words import ADJECTIVES, NOUNS
from kvopt.local_text import real_text

POOL = 32
PASSAGE_SHARE = 0.7
TOKENS_PER_WORD = 1.5
#: Tokens left out of the documents' share: instruction, question, answer prefix, chat template, the answer.
RESERVED = 128
SEPARATOR = "\n\n"
_INTRO = "Answer the question from the passages below.\n"


@functools.lru_cache(maxsize=1)
def _pool_facts() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[float, ...]]:
    """Each pool passage's archive name, 7-digit number, first word in the prose and fact depth (fixed)."""
    rng = seeded_rng("retrieval-pool")
    names = distinct(lambda: f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", POOL)
    numbers = distinct(lambda: str(rng.randint(1_000_000, 9_999_999)), POOL)
    words, starts = _indexed_words()
    begins = tuple(starts[(index * len(starts)) // POOL] for index in range(POOL))
    depths = tuple(rng.uniform(0.1, 0.9) for _ in range(POOL))
    return tuple(names), tuple(numbers), begins, depths


@functools.lru_cache(maxsize=4 * POOL)
def passage(index: int, words: int) -> str:
    """Pool passage ``index`` of ``words`` words of prose, with its number and its link to the next passage."""
    names, numbers, begins, depths = _pool_facts()
    text, _ = _indexed_words()
    haystack = " ".join(text[(begins[index] + i) % len(text)] for i in range(words))
    facts = [
        (depths[index], f"The registration number of the {names[index]} archive is {numbers[index]}."),
        (1.0 - depths[index], f"The {names[index]} archive replaced the {names[(index + 1) % POOL]} archive."),
    ]
    return insert_needles(haystack, facts, " ")


class Retrieval(Task):
    """``passages`` pool documents in a drawn order; the asked one's number (``hops=2``: through a link)."""

    uses_depth = False
    max_new_tokens = 32
    filler_unit = "words"

    def __init__(self, name: str, passages: int = 4, hops: int = 1) -> None:
        self.name, self.passages, self.hops = name, passages, hops

    def count(self, length: int) -> int:
        """Documents per prompt at a target ``length``: ``passages`` up to 2k tokens, then as many more per 2k."""
        return min(POOL // 2, self.passages * max(1, length // 2048))

    def passage_words(self, length: int) -> int:
        """Words per document at a target ``length`` (the same for every prompt of that length)."""
        return max(20, int(PASSAGE_SHARE * (length - RESERVED) / (self.count(length) * TOKENS_PER_WORD)))

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        names, numbers, _, _ = _pool_facts()
        asked = rng.randrange(POOL)
        needed = [asked] if self.hops == 1 else [asked, (asked + 1) % POOL]
        others = rng.sample([i for i in range(POOL) if i not in needed], self.count(length) - len(needed))
        chosen = needed + others
        rng.shuffle(chosen)
        size = self.passage_words(length)
        documents = [passage(index, size) for index in chosen]
        text, _ = _indexed_words()
        background = " ".join(text[:units])
        if self.hops == 1:
            question = f"What is the registration number of the {names[asked]} archive?"
            prefix = f"The registration number of the {names[asked]} archive is"
        else:
            question = f"What is the registration number of the archive that the {names[asked]} archive replaced?"
            prefix = f"The archive that the {names[asked]} archive replaced has the registration number"
        return Parts(
            intro=f"{_INTRO}{background}\n\n" if units else _INTRO,
            context=SEPARATOR.join(documents),
            question=question,
            answer_prefix=prefix,
            answers=(numbers[needed[-1]],),
            text_source=real_text()[1],
            extra={"passages": documents, "pool_indices": chosen, "needed": needed},
        )
