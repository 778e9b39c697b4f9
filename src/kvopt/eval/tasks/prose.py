"""Needles in real prose that read like the prose: one fact, or several labelled values, one asked.

RULER's niah needles ("One of the special magic numbers for calm-otter is: 4812753.") and Kamradt's
San Francisco sentence stand out from a licence or a Python HOWTO by their wording alone, so a cache
that keeps only what looks unusual can still find them. Here the needle is a sentence in the
haystack's own formal register (a reference number a notice must quote, the registration number of
a distribution's parts), placed at a sentence boundary at the stated depth, in the same local prose
the other needle tasks read (:func:`kvopt.eval.tasks.text.prose_haystack`). Values are 7-digit numbers
as in RULER; scoring is niah's (every reference found in the prediction).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvopt.eval.tasks.base import Parts, Task, distinct
from kvopt.eval.tasks.niah import DEPTH_GRID, insert_needles
from kvopt.eval.tasks.text import prose_haystack

_INTRO = "Read the following document, then answer the question after it.\n"


@dataclass(frozen=True)
class Fact:
    """A needle sentence with a ``{value}`` slot, the question it answers and the answer's opening words."""

    sentence: str
    question: str
    answer_prefix: str


#: One is drawn per sample; each states an identifier the way a licence or a manual would.
FACTS = (
    Fact("Any notice given under this section must quote the reference number {value}.",
         "What reference number must a notice given under this section quote?",
         "A notice given under this section must quote the reference number"),
    Fact("Copies distributed before the revision date carry the serial number {value} on their title page.",
         "What serial number do copies distributed before the revision date carry?",
         "Copies distributed before the revision date carry the serial number"),
    Fact("Written requests for the complete corresponding source should be sent to post office box {value}.",
         "To which post office box should written requests for the complete corresponding source be sent?",
         "Written requests for the complete corresponding source should be sent to post office box"),
    Fact("The original version of this text was filed with the registrar under record number {value}.",
         "Under which record number was the original version of this text filed?",
         "The original version of this text was filed under record number"),
    Fact("Contributors who wish to be credited should cite the agreement number {value} in their submission.",
         "Which agreement number should contributors who wish to be credited cite?",
         "Contributors who wish to be credited should cite the agreement number"),
)  # fmt: skip

#: The parts of a distribution whose registration numbers the multi-key task states; a sample draws some.
PARTS = (
    "the source archive", "the reference manual", "the translated edition", "the test suite", "the sample programs",
    "the installer", "the font files", "the build scripts", "the data tables", "the printed handbook",
    "the tutorial", "the command-line tools", "the graphical interface", "the library headers", "the image assets",
    "the configuration templates",
)  # fmt: skip
#: Ways of stating one part's registration number, so the needles do not share one surface pattern.
REGISTRATIONS = (
    "The registration number of {part} is {value}.",
    "For {part}, the registration number assigned by the maintainers is {value}.",
    "Where {part} is redistributed, its registration number, {value}, must be kept with it.",
    "The maintainers registered {part} under the number {value}.",
)


def _seven_digits(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


class ProseNeedle(Task):
    """One fact sentence in the prose's register at ``depth``; the question asks for its number."""

    name = "prose_needle"
    uses_depth = True
    max_new_tokens = 32
    filler_unit = "words"

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        fact = rng.choice(FACTS)
        value = _seven_digits(rng)
        haystack, source = prose_haystack(rng, units)
        return Parts(
            intro=_INTRO,
            context=insert_needles(haystack, [(depth, fact.sentence.format(value=value))], " "),
            question=fact.question,
            answer_prefix=fact.answer_prefix,
            answers=(value,),
            text_source=source,
        )


class ProseMultiKey(Task):
    """``keys`` parts' registration numbers stated in the prose, one asked: the asked one at ``depth``, the
    others at depths drawn from RULER's grid (as :class:`~kvopt.eval.tasks.niah.MagicNumbers` places them)."""

    name = "prose_multikey"
    uses_depth = True
    max_new_tokens = 32
    filler_unit = "words"

    def __init__(self, keys: int = 4) -> None:
        self.keys = keys

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        parts = rng.sample(PARTS, self.keys)
        values = distinct(lambda: _seven_digits(rng), self.keys)
        sentences = [rng.choice(REGISTRATIONS).format(part=part, value=value) for part, value in zip(parts, values)]
        placed = [(depth, sentences[0]), *zip(rng.sample(DEPTH_GRID, self.keys - 1), sentences[1:])]
        haystack, source = prose_haystack(rng, units)
        asked = parts[0]
        return Parts(
            intro=_INTRO,
            context=insert_needles(haystack, placed, " "),
            question=f"What is the registration number of {asked}?",
            answer_prefix=f"The registration number of {asked} is",
            answers=(values[0],),
            text_source=source,
            extra={"needle_depths": [d for d, _ in placed], "distractors": values[1:]},
        )
