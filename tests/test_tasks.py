"""Synthetic evaluation tasks with the default model's real tokenizer: sizing, answers, determinism, depth,
prompt pieces, scoring and errors (a few seconds)."""

import dataclasses
import json
import re
from collections import Counter

import pytest

from kvopt import local_text
from kvopt.errors import KVOptError
from kvopt.eval.tasks import TASKS, Sample, TaskError, build_sample, format_prompt, score
from kvopt.eval.tasks.niah import NEEDLE
from kvopt.eval.tasks.scoring import first_integer, string_match_all
from kvopt.models import load_tokenizer

NEEDLE_TASKS = ["passkey", "niah", "niah_multikey", "niah_multivalue", "niah_multiquery", "prose_needle",
                "prose_multikey"]
CASES = [(task, length) for task in TASKS for length in ((1024, 2048) if task == "cwe" else (512, 1024))]
CASES.append(("niah", 2048))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def samples(tokenizer) -> dict[tuple[str, int], Sample]:
    return {(task, length): _build(tokenizer, task, length) for task, length in CASES}


def _build(tokenizer, task: str, length: int, depth: float = 0.5, **kwargs) -> Sample:
    return build_sample(task, tokenizer, length, depth if TASKS[task].uses_depth else None, **kwargs)


def _needle_position(sample: Sample) -> float:
    """Where the (first) needle sits in the context, as a fraction of its characters."""
    marker = {"passkey": f"The pass key is {sample.answers[0]}.", "niah": NEEDLE}.get(sample.task, sample.answers[0])
    return sample.context.index(marker) / len(sample.context)


def test_registry_exposes_every_task():
    assert set(TASKS) == {"passkey", "niah", "niah_multikey", "niah_multivalue", "niah_multiquery", "prose_needle",
                          "prose_multikey", "vt", "cwe", "fwe", "retrieval", "retrieval_2hop", "conversation"}
    for name, task in TASKS.items():
        assert task.name == name and task.max_new_tokens > 0
        assert task.uses_depth == (name in NEEDLE_TASKS or name == "conversation")  # depth: the topic asked about


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_samples_fill_the_token_budget(samples, tokenizer, case):
    sample = samples[case]
    context_ids, question_ids = format_prompt(tokenizer, sample)
    total = len(context_ids) + len(question_ids) + sample.max_new_tokens
    assert 0.98 * case[1] <= total <= case[1]
    assert (sample.task, sample.length, sample.max_new_tokens) == (case[0], case[1], TASKS[case[0]].max_new_tokens)
    json.dumps(dataclasses.asdict(sample))  # metadata stays serialisable


def test_needles_appear_exactly_once(samples):
    for (task, _), sample in samples.items():
        if task == "passkey":
            key = sample.answers[0]
            assert sample.context.count(f"The pass key is {key}. Remember it. {key} is the pass key.") == 1
        elif task in NEEDLE_TASKS:
            for answer in sample.answers:
                assert sample.context.count(answer) == 1, (task, answer)
    assert samples["niah", 512].metadata["text_source"] == local_text.real_text()[1]


def test_variable_chain_is_in_the_context(samples):
    for length in (512, 1024):
        sample = samples["vt", length]
        names, lines = sample.answers, set(sample.context.splitlines())
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", name) for name in names)
        value = re.search(r"value (\d{5})", sample.question).group(1)
        assert f"VAR {names[0]} = {value}" in lines
        assert all(f"VAR {names[i + 1]} = VAR {names[i]}" in lines for i in range(4))
        assert value in sample.answer_prefix and "5 variables" in sample.answer_prefix


def test_common_and_frequent_words_are_the_most_frequent(samples):
    for length in (1024, 2048):
        sample = samples["cwe", length]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", sample.context))
        assert len(sample.answers) == 10
        assert min(counts[w] for w in sample.answers) > max(c for w, c in counts.items() if w not in sample.answers)
    for length in (512, 1024):
        sample = samples["fwe", length]
        counts = Counter(sample.context.split())
        assert counts.most_common(1)[0][0] == "...."
        del counts["...."]
        assert len(sample.answers) == 3
        assert [w for w, _ in counts.most_common(3)] == list(sample.answers)
        assert counts[sample.answers[2]] > max(c for w, c in counts.items() if w not in sample.answers)


def test_samples_are_deterministic(samples, tokenizer):
    for task in TASKS:
        length = 1024
        again = _build(tokenizer, task, length)
        assert again == samples[task, length]
        other = _build(tokenizer, task, length, index=1)
        assert other.context != again.context
        assert _build(tokenizer, task, length, seed=7).context != again.context


def test_depth_moves_the_needle(tokenizer):
    for task in NEEDLE_TASKS:
        shallow, deep = (_build(tokenizer, task, 1024, depth) for depth in (0.1, 0.9))
        assert (shallow.depth, deep.depth) == (0.1, 0.9)
        assert _needle_position(shallow) < 0.35 < 0.55 < _needle_position(deep), task
        assert shallow.answers == deep.answers  # only the needle moves across depths


def test_depth_none_is_drawn_and_reproducible(tokenizer):
    drawn = build_sample("niah_multikey", tokenizer, 512)
    assert 0.0 <= drawn.depth <= 1.0
    assert build_sample("niah_multikey", tokenizer, 512, drawn.depth) == drawn
    assert build_sample("vt", tokenizer, 512).depth is None


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_pieces_decode_to_context_and_question(samples, tokenizer, chat):
    for task in ("passkey", "niah_multiquery", "vt", "cwe"):
        sample = samples[task, 1024]
        context_ids, question_ids = format_prompt(tokenizer, sample, chat)
        head, tail = tokenizer.decode(context_ids), tokenizer.decode(question_ids)
        assert sample.metadata["intro"] + sample.context in head
        assert tail.startswith(sample.question) and tail.endswith(sample.answer_prefix)
        assert ("<|im_start|>assistant" in tail) == chat


def test_plain_prompt_layout(samples, tokenizer):
    sample = samples["passkey", 512]
    context_ids, question_ids = format_prompt(tokenizer, sample, chat=False)
    # Whether a BOS is prepended depends on the tokenizer's config (it differs across transformers versions).
    prompt = tokenizer.decode(context_ids + question_ids, skip_special_tokens=True)
    assert prompt == f"{sample.metadata['intro']}{sample.context}\n{sample.question}\n{sample.answer_prefix}"


def test_scoring_rules(samples):
    passkey = samples["passkey", 512]
    key = passkey.answers[0]
    assert score(passkey, f" {key}. Remember it.") == 1.0
    assert score(passkey, f" {int(key) + 1} or {key}") == 0.0
    assert score(passkey, " unknown") == 0.0
    niah = samples["niah", 512]
    assert score(niah, "eat a SANDWICH and sit in dolores park") == 1.0
    assert score(niah, "eat a sandwich at home") == 0.5
    multi = samples["niah_multiquery", 512]
    assert score(multi, " ".join(multi.answers[:3])) == 0.75
    assert first_integer("the key is 0042 not 7") == 42 and first_integer("none") is None
    assert string_match_all("Alpha BETA", ["alpha", "Beta", "gamma", "delta"]) == 0.5


def test_clear_errors(tokenizer):
    with pytest.raises(TaskError, match="too small for task 'cwe'") as caught:
        build_sample("cwe", tokenizer, 512)
    assert isinstance(caught.value, KVOptError) and isinstance(caught.value, ValueError)
    with pytest.raises(TaskError, match="unknown task 'nope'; choose one of: passkey"):
        build_sample("nope", tokenizer, 512)
    with pytest.raises(TaskError, match="no needle depth"):
        build_sample("vt", tokenizer, 512, 0.5)
    with pytest.raises(TaskError, match="between 0.0 and 1.0"):
        build_sample("niah", tokenizer, 512, 1.5)
    with pytest.raises(TaskError, match="positive"):
        build_sample("niah", tokenizer, 0)


def test_text_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(local_text, "MIN_CHARS", 100)
    paragraph = "This is prose. It has sentences and more words to read.\n\n"
    licenses = tmp_path / "licenses"
    licenses.mkdir()
    (licenses / "GPL-2").write_text("Old   version.\n" * 10)
    (licenses / "GPL-3").write_text(paragraph * 10)
    (licenses / "BSD").write_text("Short license. Fine.")
    found, name = local_text.licenses(licenses)
    assert name == "common-licenses:BSD,GPL-3" and "Old" not in found and "  " not in found

    docs = tmp_path / "doc"
    rst = "Title\n=====\n\nUse :func:`len` and ``x`` here.\n\n    code = 1\n\n.. note::\n\n>>> 1 + 1\n\n"
    for package, body in (("python3.11", rst + paragraph * 10), ("python3-pip", "pip docs. " * 50)):
        (docs / package / "html/_sources/tutorial").mkdir(parents=True)
        (docs / package / "html/_sources/tutorial/intro.rst.txt").write_text(body)
    found, name = local_text.python_docs(docs)
    assert name.startswith("python-docs:") and "python3.11" in name
    assert found.startswith("Use len and x here. This is prose.")
    assert not any(bit in found for bit in ("Title", "code", "note", ">>>", "pip"))
    assert local_text.python_docs(tmp_path / "missing") is None

    found, name = local_text.stdlib_docstrings()
    assert len(found) > 20_000 and name.startswith("stdlib-docstrings:python3")


def test_real_text_is_long_prose():
    found, name = local_text.real_text()
    assert len(found) >= local_text.MIN_CHARS and "  " not in found and name
