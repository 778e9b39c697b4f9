"""RULER's non-retrieval synthetic tasks (NVIDIA/RULER ``synthetic.yaml``): vt, cwe and fwe.

Wording follows RULER's ``constants.py`` verbatim (including vt's "assgined"). Deviations, all so
that short targets (512 tokens) fit and the 2% sizing tolerance holds:
- vt's filler unit is one noise *sentence*, not a whole noise line (the last line may be partial), and
  the chain statements go at uniformly random interleavings (RULER draws distinct gaps, which needs
  at least 5 noise lines). Its 1-shot example has ``length // 256`` noise lines, at most 18 (about
  the 500 tokens RULER gives it).
- fwe replaces the rank-1 word by "...." (the prompt's own spelling; RULER's code writes "...").
"""

from __future__ import annotations

import math
import random
import string

from kvopt.eval.tasks.base import Parts, Task, distinct
from kvopt.eval.tasks.text import NOISE
from kvopt.words import WORD_POOL

_NOISE_SENTENCES = [sentence + "." for sentence in NOISE.rstrip(".").split(". ")]

_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_ANSWER = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{count} variables are assgined the value {value}, they are:"
)
_VT_HOPS = 4
_VT_EXAMPLE_LINES = 18

_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
_CWE_ANSWER = "Answer: The top 10 words that appear most often in the list are:"
_CWE_COMMON = 10
_CWE_SHORT = 4096
"""Below this target RULER repeats common words 6x and uncommon 1x (and uses a smaller example)."""

_FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
_FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_ANSWER = "Answer: According to the coded text above, the three most frequently appeared words are:"
_FWE_NOISE = "...."
_ZETA_2 = math.pi**2 / 6
_FWE_MIN_WORDS = math.ceil(_ZETA_2 / (1 / 16 - 1 / 25))
"""With fewer words, floor() can tie the 3rd answer (rank 4) with rank 5, making the answer ambiguous."""


class VariableTracking(Task):
    """One chain of 4 hops (5 variables) hidden in noise; answer = every variable holding the value."""

    name = "vt"
    uses_depth = False
    max_new_tokens = 30
    filler_unit = "noise sentences"

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        example = self._example(rng, min(_VT_EXAMPLE_LINES, length // 256))
        names, value, chain = _chain(rng, 5)
        return Parts(
            intro=example + _VT_INTRO,
            context=_noise_with(rng, units, chain),
            question=_VT_QUESTION.format(value=value),
            answer_prefix=_VT_ANSWER.format(count=_VT_HOPS + 1, value=value),
            answers=tuple(names),
            text_source="ruler-noise",
        )

    @staticmethod
    def _example(rng: random.Random, lines: int) -> str:
        """RULER's 1-shot example: 3-letter names, a full prompt and its answer, then a blank line."""
        names, value, chain = _chain(rng, 3)
        context = _noise_with(rng, lines * len(_NOISE_SENTENCES), chain)
        answer = _VT_ANSWER.format(count=_VT_HOPS + 1, value=value)
        return f"{_VT_INTRO}{context}\n{_VT_QUESTION.format(value=value)} {answer} {' '.join(names)}\n\n"


class CommonWords(Task):
    """A numbered, shuffled word list: 10 words repeated often, the rest rarely; answer = the 10."""

    name = "cwe"
    uses_depth = False
    max_new_tokens = 120
    filler_unit = "uncommon words"
    min_units = 1

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        short = length < _CWE_SHORT
        example_list, example_common = _word_list(rng, 20 if short else 40, *((3, 1) if short else (10, 3)))
        example = f"{_CWE_INTRO}{example_list}\n{_CWE_QUESTION} {_CWE_ANSWER} {_numbered(example_common)}\n"
        context, common = _word_list(rng, _CWE_COMMON + units, *((6, 1) if short else (30, 3)))
        return Parts(
            intro=example + _CWE_INTRO,
            context=context,
            question=_CWE_QUESTION,
            answer_prefix=_CWE_ANSWER,
            answers=common,
            text_source="embedded-word-list",
        )

    def max_units(self, length: int) -> int:
        return len(WORD_POOL) - _CWE_COMMON


class FrequentWords(Task):
    """Coded words with zeta(2)-distributed counts; answer = the 3 most frequent after the "...." noise."""

    name = "fwe"
    uses_depth = False
    max_new_tokens = 50
    filler_unit = "words (zeta total)"
    min_units = _FWE_MIN_WORDS

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        # RULER's vocabulary is max_seq_length // 50 words; 5 is the least with a rival for the answers.
        vocab = distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), max(5, length // 50))
        vocab[0] = _FWE_NOISE
        counts = [int(units * rank**-2.0 / _ZETA_2) for rank in range(1, len(vocab) + 1)]
        words = [word for word, count in zip(vocab, counts) for _ in range(count)]
        rng.shuffle(words)
        return Parts(
            intro=_FWE_INTRO,
            context=" ".join(words),
            question=_FWE_QUESTION,
            answer_prefix=_FWE_ANSWER,
            answers=tuple(vocab[1:4]),
            text_source="coded-words",
        )


def _chain(rng: random.Random, name_length: int) -> tuple[list[str], int, list[str]]:
    """RULER's ``generate_chains`` for one chain: distinct names, ``VAR A = 12345``, ``VAR B = VAR A``..."""
    names = distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)), _VT_HOPS + 1)
    value = rng.randint(10000, 99999)
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(_VT_HOPS)]
    return names, value, chain


def _noise_with(rng: random.Random, sentences: int, statements: list[str]) -> str:
    """Noise lines (the last cut to ``sentences``) with ``statements`` on their own lines, in order."""
    full, rest = divmod(sentences, len(_NOISE_SENTENCES))
    lines = [NOISE] * full + ([" ".join(_NOISE_SENTENCES[:rest])] if rest else [])
    for slot, statement in zip(sorted(rng.sample(range(len(lines) + len(statements)), len(statements))), statements):
        lines.insert(slot, statement)
    return "\n".join(lines)


def _word_list(rng: random.Random, distinct_words: int, common: int, uncommon: int) -> tuple[str, tuple[str, ...]]:
    """RULER's ``get_example``: the first 10 sampled words ``common`` times, the rest ``uncommon`` times."""
    words = rng.sample(WORD_POOL, distinct_words)
    listed = words[:_CWE_COMMON] * common + words[_CWE_COMMON:] * uncommon
    rng.shuffle(listed)
    return _numbered(listed), tuple(words[:_CWE_COMMON])


def _numbered(words: list[str] | tuple[str, ...]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
