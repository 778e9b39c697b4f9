"""The long-conversation task with the default model's real tokenizer: reproducible, sized to its budget, 20-60
one-line turns over distinct topics, one fact per topic, the asked one early, middle or late, scored like niah."""

import re

import pytest

from kvopt.eval.tasks import TASKS, build_sample, format_prompt, score
from kvopt.eval.tasks.conversation import TOPICS
from kvopt.local_text import real_text
from kvopt.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def topics(sample) -> list[list[str]]:
    """The conversation's lines, grouped by topic (a topic starts at each user line naming a new archive)."""
    grouped, label = [], None
    for line in sample.context.strip("\n").split("\n"):
        named = re.search(r"(the \w+ \w+ archive)", line) if line.startswith("User:") else None
        if named and named.group(1) != label:
            label = named.group(1)
            grouped.append([])
        grouped[-1].append(line)
    return grouped


def test_same_seed_same_sample_other_seed_other_sample(tokenizer):
    first, again = (build_sample("conversation", tokenizer, 4096, 0.5, index=2, seed=7) for _ in range(2))
    other = build_sample("conversation", tokenizer, 4096, 0.5, index=2, seed=8)
    assert (first.context, first.question, first.answers) == (again.context, again.question, again.answers)
    assert first.context != other.context and first.answers != other.answers


@pytest.mark.parametrize("length", [4096, 8192, 16384])
def test_fills_its_budget_with_20_to_60_one_line_turns(tokenizer, length):
    sample = build_sample("conversation", tokenizer, length, 0.5)
    context_ids, question_ids = format_prompt(tokenizer, sample)
    assert 0.98 * length <= len(context_ids) + len(question_ids) + sample.max_new_tokens <= length
    lines = sample.context.strip("\n").split("\n")
    assert 20 <= len(lines) == sample.metadata["turns"] <= 60
    assert all(line.startswith(("User: ", "Assistant: ")) for line in lines)
    assert sample.metadata["text_source"] == real_text()[1]


@pytest.mark.parametrize("depth, asked", [(0.1, 0), (0.5, TOPICS // 2), (0.9, TOPICS - 1)])
def test_every_topic_states_its_fact_once_and_the_asked_one_is_early_middle_or_late(tokenizer, depth, asked):
    sample = build_sample("conversation", tokenizer, 4096, depth, index=1)
    grouped = topics(sample)
    assert len(grouped) == TOPICS and sample.metadata["asked_topic"] == asked
    (value,) = sample.answers
    values = [value, *sample.metadata["distractors"]]
    assert len(set(values)) == TOPICS and all(sample.context.count(v) == 1 for v in values)
    label = re.search(r"(the \w+ \w+ archive)", grouped[asked][0]).group(1)
    assert value in "\n".join(grouped[asked]) and f"of {label} is {value}." in sample.context
    assert label in sample.question and sample.answer_prefix.endswith(f"of {label} is")
    first_words = grouped[asked][1].removeprefix("Assistant: ").split(" ")[:8]
    assert " ".join(first_words) in sample.question  # the question recalls how the topic began


def test_topics_read_different_parts_of_the_text(tokenizer):
    sample = build_sample("conversation", tokenizer, 16384, 0.5)
    shingles = []
    for lines in topics(sample):
        words = " ".join(line.split(": ", 1)[1] for line in lines if line.startswith("Assistant:")).split(" ")
        shingles.append({" ".join(words[i : i + 8]) for i in range(len(words) - 8)})
    for i in range(TOPICS):
        for j in range(i + 1, TOPICS):
            # The licence texts themselves repeat a few preamble sentences (GPL-3 and LGPL-2.1): ~3% at most.
            assert len(shingles[i] & shingles[j]) < 0.05 * min(len(shingles[i]), len(shingles[j])), (i, j)


def test_scored_like_niah(tokenizer):
    sample = build_sample("conversation", tokenizer, 4096, 0.5)
    assert TASKS["conversation"].uses_depth
    assert score(sample, f"{sample.answer_prefix} {sample.answers[0]}.") == 1.0
    assert score(sample, f"{sample.answer_prefix} {sample.metadata['distractors'][0]}.") == 0.0
