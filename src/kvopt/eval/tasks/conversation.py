"""A long conversation over distinct topics, with one fact per topic; the question asks for an early, middle or
late topic's fact (EpiCache's long conversational QA, built offline).

Each of ``TOPICS`` topics is a passage of local real prose (:func:`kvopt.local_text.real_text`) from its own
region of the text (the text is cut into as many arcs, one per topic, so topics never share words), read out by
an assistant over several turns, the user opening each topic and asking it to go on. Every topic states the same
kind of fact ("The reference number of the calm otter archive is 4812753.") with its own 7-digit value, at a
sentence boundary of one of its turns, so an answer needs the asked topic's part of the history, not merely any
fact. ``depth`` picks the asked topic (0 the first, 1 the last): early, middle and late topics at 0.1, 0.5, 0.9.
The question recalls the topic by its label and the words it began with, as a user returning to an old topic
would. Turns are one line each; an assistant turn holds about ``length / 22`` words, so a conversation has about
20-60 turns from 4k to 16k tokens. Scoring is niah's (the value found in the prediction).
"""

from __future__ import annotations

import random

from kvopt.eval.tasks.base import Parts, Task, distinct
from kvopt.eval.tasks.text import _indexed_words as _words
from kvopt.words import ADJECTIVES, NOUNS
from kvopt.local_text import real_text

TOPICS = 6
#: Fact kinds; one per conversation, stated for every topic.
KINDS = ("reference number", "serial number", "record number", "agreement number", "registration number")
OPENINGS = (
    "User: Let's talk about {label}. What does it say?",
    "User: Next, could you read me {label}?",
    "User: I would like to go over {label} now. How does it start?",
    "User: Please walk me through {label}.",
)
FOLLOW_UPS = (
    "User: Go on with {label}.",
    "User: What else does {label} say?",
    "User: Please continue with {label}.",
    "User: And after that, in {label}?",
)
INTRO = (
    "The following is a long conversation between a user and an assistant who reads documents to the user. "
    "Answer the question after it.\n"
)
#: Words of a topic's opening the question quotes.
QUOTED = 8


class LongConversation(Task):
    """``TOPICS`` topics read out turn by turn, one fact each; the topic at ``depth`` is asked about."""

    name = "conversation"
    uses_depth = True
    max_new_tokens = 16
    filler_unit = "words"
    min_units = TOPICS * QUOTED

    def max_units(self, length: int) -> int:
        return len(_words()[0])

    def compose(self, rng: random.Random, units: int, depth: float | None, length: int) -> Parts:
        kind = rng.choice(KINDS)
        labels = distinct(lambda: f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} archive", TOPICS)
        values = distinct(lambda: str(rng.randint(1_000_000, 9_999_999)), TOPICS)
        arcs = rng.sample(range(TOPICS), TOPICS)  # which region of the text each topic reads
        offsets = [rng.random() for _ in range(TOPICS)]  # where in its region
        places = [rng.random() for _ in range(TOPICS)]  # where in the topic its fact goes
        openings = [rng.choice(OPENINGS) for _ in range(TOPICS)]
        asked = min(int(depth * TOPICS), TOPICS - 1)
        chunk = max(40, length // 22)
        lines, quotes = [], []
        for topic in range(TOPICS):
            size = units // TOPICS + (topic < units % TOPICS)
            passage = _passage(arcs[topic], offsets[topic], size)
            quotes.append(" ".join(passage[:QUOTED]))
            fact = f"The {kind} of {labels[topic]} is {values[topic]}."
            lines += _turns(rng, labels[topic], openings[topic], passage, fact, places[topic], chunk)
        question = (
            f'Earlier we discussed {labels[asked]}, which began "{quotes[asked]}". '
            f"What is the {kind} of {labels[asked]}?"
        )
        return Parts(
            intro=INTRO,
            context="\n".join(lines) + "\n",
            question=question,
            answer_prefix=f"The {kind} of {labels[asked]} is",
            answers=(values[asked],),
            text_source=real_text()[1],
            extra={"asked_topic": asked, "topics": TOPICS, "turns": len(lines), "distractors": values[:asked] + values[asked + 1 :]},
        )


def _turns(rng: random.Random, label: str, opening: str, passage: list[str], fact: str, place: float, chunk: int) -> list[str]:
    """One topic's lines: the user's opening, then assistant turns of about ``chunk`` words with the user's
    follow-ups between them; ``fact`` at the sentence boundary nearest ``place`` of the passage."""
    sentences = [i + 1 for i, word in enumerate(passage[:-1]) if word[-1:] in ".!?"]
    cut = min(sentences, key=lambda i: abs(i - place * len(passage)), default=len(passage))
    words = passage[:cut] + fact.split(" ") + passage[cut:]
    count = max(1, round(len(words) / chunk))
    bounds = [len(words) * i // count for i in range(count + 1)]
    lines = [opening.format(label=label)]
    for i in range(count):
        if i:
            lines.append(rng.choice(FOLLOW_UPS).format(label=label))
        lines.append("Assistant: " + " ".join(words[bounds[i] : bounds[i + 1]]))
    return lines


def _passage(arc: int, offset: float, size: int) -> list[str]:
    """``size`` words from a sentence start at ``offset`` of region ``arc`` (one of ``TOPICS`` equal regions),
    continuing past its end (into the next region) only when the region is too short."""
    words, starts = _words()
    region = len(words) // TOPICS
    first = arc * region + int(offset * max(region - size, 0))
    start = next((s for s in starts if s >= first), 0)
    return [words[(start + i) % len(words)] for i in range(size)]
