"""Needles in real prose (prose_needle, prose_multikey) with the default model's real tokenizer: the needle
sentence is in the text once, at the stated depth, the prompt fills its budget, samples are reproducible and
scoring asks for the asked value only."""

import pytest

from kvopt.eval.tasks import TASKS, build_sample, format_prompt, score
from kvopt.eval.tasks import text
from kvopt.eval.tasks.prose import FACTS, PARTS
from kvopt.models import load_tokenizer

PROSE_TASKS = ("prose_needle", "prose_multikey")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _needle_sentence(sample) -> str:
    """The sentence of the context that holds the asked value."""
    value = sample.answers[0]
    start = sample.context.rindex(". ", 0, sample.context.index(value)) + 2
    return sample.context[start : sample.context.index(".", sample.context.index(value)) + 1]


@pytest.mark.parametrize("task", PROSE_TASKS)
@pytest.mark.parametrize("length", (1024, 2048))
def test_prompt_fills_its_token_budget_with_local_prose(tokenizer, task, length):
    sample = build_sample(task, tokenizer, length, 0.5)
    context_ids, question_ids = format_prompt(tokenizer, sample)
    assert 0.98 * length <= len(context_ids) + len(question_ids) + sample.max_new_tokens <= length
    assert sample.metadata["text_source"] == text.real_text()[1]


@pytest.mark.parametrize("task", PROSE_TASKS)
@pytest.mark.parametrize("depth", (0.1, 0.5, 0.9))
def test_the_asked_needle_sits_once_at_the_stated_depth(tokenizer, task, depth):
    sample = build_sample(task, tokenizer, 2048, depth)
    value = sample.answers[0]
    assert sample.context.count(value) == 1
    position = sample.context.index(_needle_sentence(sample)) / len(sample.context)
    # Inserted at the sentence boundary before ``depth`` of the haystack: slightly shallower, never deeper
    # (the other needles inserted before it shift it by a few hundred characters at most).
    assert depth - 0.05 < position <= depth + 0.02, (task, depth, position)


def test_the_needle_is_a_sentence_in_the_prose_register(tokenizer):
    sample = build_sample("prose_needle", tokenizer, 1024, 0.5)
    fact = next(f for f in FACTS if f.question == sample.question)
    assert fact.sentence.format(value=sample.answers[0]) in sample.context
    assert sample.answer_prefix == fact.answer_prefix and sample.answer_prefix in fact.sentence
    assert "magic" not in sample.context.lower()


def test_multikey_states_several_parts_and_asks_one(tokenizer):
    sample = build_sample("prose_multikey", tokenizer, 2048, 0.3)
    distractors = sample.metadata["distractors"]
    assert len(distractors) == TASKS["prose_multikey"].keys - 1 and sample.answers[0] not in distractors
    assert all(sample.context.count(value) == 1 for value in distractors)
    named = [part for part in PARTS if part in sample.context]
    asked = sample.question.removeprefix("What is the registration number of ").removesuffix("?")
    assert asked in named and len(named) >= TASKS["prose_multikey"].keys
    assert asked in _needle_sentence(sample)
    assert sample.metadata["needle_depths"][0] == 0.3


@pytest.mark.parametrize("task", PROSE_TASKS)
def test_deterministic_given_the_seed_and_only_the_needle_moves_with_depth(tokenizer, task):
    sample = build_sample(task, tokenizer, 1024, 0.5)
    assert build_sample(task, tokenizer, 1024, 0.5) == sample
    assert build_sample(task, tokenizer, 1024, 0.5, seed=3).answers != sample.answers
    assert build_sample(task, tokenizer, 1024, 0.5, index=1).context != sample.context
    deep = build_sample(task, tokenizer, 1024, 0.9)
    assert (deep.answers, deep.question) == (sample.answers, sample.question)
    assert deep.context.index(sample.answers[0]) > sample.context.index(sample.answers[0])


def test_scored_like_niah_on_the_asked_value_only(tokenizer):
    sample = build_sample("prose_multikey", tokenizer, 1024, 0.5)
    value, wrong = sample.answers[0], sample.metadata["distractors"][0]
    assert score(sample, f" {value}.") == 1.0
    assert score(sample, f" {wrong}.") == 0.0
    assert score(sample, f" {value[:-1]}") == 0.0
    needle = build_sample("prose_needle", tokenizer, 1024, 0.5)
    assert score(needle, f" number {needle.answers[0]}") == 1.0 and score(needle, " not stated") == 0.0
