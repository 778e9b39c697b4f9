"""Haystack text for the tasks: real local prose (:mod:`kvopt.local_text`) and the Landmark/RULER noise.

Kamradt's NIAH and RULER's "essay" haystack use Paul Graham essays, which need a download; we use the
best local prose instead, and its source name travels with each sample so results say what was read.
"""

from __future__ import annotations

import functools
import random

from kvopt.local_text import SENTENCE_END, real_text

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""Landmark's passkey "garbage", which RULER reuses as its "noise" haystack."""


def prose_haystack(rng: random.Random, n_words: int) -> tuple[str, str]:
    """``n_words`` words of :func:`real_text` from a random sentence start, wrapping around at the end."""
    words, starts = _indexed_words()
    start = rng.choice(starts)
    return " ".join(words[(start + i) % len(words)] for i in range(n_words)), real_text()[1]


def sentence_boundary(text: str, fraction: float) -> int:
    """The end of the last sentence that finishes before ``fraction`` of ``text`` (Kamradt's walk back)."""
    if fraction >= 1.0:
        return len(text)
    limit = int(fraction * len(text))
    ends = [m.start() for m in SENTENCE_END.finditer(text, 0, limit + 1)]
    return ends[-1] if ends else 0


@functools.lru_cache(maxsize=1)
def _indexed_words() -> tuple[tuple[str, ...], tuple[int, ...]]:
    words = tuple(real_text()[0].split(" "))
    starts = tuple(i for i in range(len(words)) if i == 0 or words[i - 1][-1:] in ".!?")
    return words, starts
