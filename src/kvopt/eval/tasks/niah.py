"""Needle-in-a-haystack tasks on real prose: Kamradt's single needle and RULER's multi-needle variants.

Needles go at sentence boundaries: the character position ``depth * len(haystack)`` walked back to
the end of the previous sentence (Kamradt walks back to a period token; RULER inserts between
sentences). The filler unit is a word of prose, fine-grained enough to hit a token budget within 2%.
"""

from __future__ import annotations

import random

from kvopt.eval.tasks.base import Parts, Task, distinct
from kvopt.eval.tasks.text import prose_haystack, sentence_boundary
from kvopt.words import ADJECTIVES, NOUNS

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
DEPTH_GRID = tuple(round(i * 100 / 39) / 100 for i in range(40))
"""RULER's 40 evenly spaced needle depths (``np.round(np.linspace(0, 100, 40))`` percent)."""

_RULER_INTRO = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n"
)
_RULER_QUESTION = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
_RULER_ANSWER = "The special magic {type_v} for {query} mentioned in the provided text are"
_RULER_NEEDLE = "One of the special magic numbers for {key} is: {value}."


def insert_needles(haystack: str, placed: list[tuple[float, str]], sep: str) -> str:
    """``haystack`` with each ``(depth, needle)`` inserted at the sentence boundary at ~depth."""
    cuts = sorted((sentence_boundary(haystack, depth), order, needle) for order, (depth, needle) in enumerate(placed))
    pieces, start = [], 0
    for cut, _, needle in cuts:
        pieces += [haystack[start:cut].strip(), needle]
        start = cut
    pieces.append(haystack[start:].strip())
    return sep.join(piece for piece in pieces if piece)


class Needle(Task):
    """Kamradt's needle ("...sandwich... Dolores Park..."); scored by the two keywords."""

    name = "niah"
    uses_depth = True
    max_new_tokens = 32
    filler_unit = "words"

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        haystack, source = prose_haystack(rng, units)
        return Parts(
            intro="Read the following document, then answer the question after it.\n",
            context=insert_needles(haystack, [(depth, NEEDLE)], "\n"),
            question="What is the best thing to do in San Francisco?",
            answer_prefix="The best thing to do in San Francisco is",
            answers=("sandwich", "Dolores Park"),
            text_source=source,
        )


class MagicNumbers(Task):
    """RULER's ``niah_*`` on the essay haystack: word keys ("adjective-noun"), 7-digit values.

    ``keys`` needles' keys are inserted with ``values`` values each; ``queries`` keys are asked for.
    The first needle the question asks about goes at ``depth``; the others at depths drawn from
    RULER's grid (RULER draws them all from the grid).
    """

    uses_depth = True
    max_new_tokens = 128
    filler_unit = "words"

    def __init__(self, name: str, keys: int, values: int, queries: int) -> None:
        self.name, self.keys, self.values, self.queries = name, keys, values, queries

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        keys = distinct(lambda: f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}", self.keys)
        numbers = distinct(lambda: str(rng.randint(1_000_000, 9_999_999)), self.keys * self.values)
        values = [numbers[i * self.values : (i + 1) * self.values] for i in range(self.keys)]
        asked = rng.sample(range(self.keys), self.queries)
        needles = [_RULER_NEEDLE.format(key=keys[k], value=v) for k in range(self.keys) for v in values[k]]
        anchor = _RULER_NEEDLE.format(key=keys[asked[0]], value=values[asked[0]][0])
        others = [needle for needle in needles if needle != anchor]
        rng.shuffle(others)
        placed = [(depth, anchor)] + list(zip(rng.sample(DEPTH_GRID, len(others)), others))
        haystack, source = prose_haystack(rng, units)
        asked_keys = [keys[k] for k in asked]
        query = f"{', '.join(asked_keys[:-1])}, and {asked_keys[-1]}" if len(asked) > 1 else asked_keys[0]
        intro, question, answer_prefix = _ruler_wording(self.queries * self.values == 1)
        return Parts(
            intro=intro,
            context=insert_needles(haystack, placed, " "),
            question=question.format(query=query),
            answer_prefix=answer_prefix.format(query=query),
            answers=tuple(v for k in asked for v in values[k]),
            text_source=source,
            extra={"needle_depths": [d for d, _ in placed]},
        )


def _ruler_wording(single: bool) -> tuple[str, str, str]:
    """RULER's template, made singular (A / is / number) when exactly one value is asked for."""
    texts = (_RULER_INTRO, _RULER_QUESTION, _RULER_ANSWER)
    if single:
        texts = tuple(t.replace("Some", "A").replace("are all", "is").replace("are", "is") for t in texts)
    type_v = "number" if single else "numbers"
    return tuple(t.replace("{type_v}", type_v) for t in texts)  # type: ignore[return-value]
