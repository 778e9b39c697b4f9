"""benchmarks/blend.py: the prompt is cut into head, passages and question exactly (their ids make the whole prompt),
and its section reads TTFT ratios and paired answers from the rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import blend  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from kvopt.models import load_tokenizer

    return load_tokenizer()


@pytest.mark.parametrize("length", [1024, 4096])
def test_the_pieces_are_the_templated_prompt_cut_at_its_passages(tokenizer, length):
    from kvopt.eval.tasks import TASKS, build_sample
    from kvopt.eval.tasks.retrieval import passage

    samples = [build_sample("retrieval_2hop", tokenizer, length, index=index) for index in range(3)]
    words = min(map(blend.background_words, samples))
    heads = set()
    for sample in samples:
        head, documents, question = blend.prompt_pieces(tokenizer, sample, words)
        heads.add(tuple(head))
        assert len(documents) == (4 if length <= 2048 else 8)
        text = tokenizer.decode(head + sum(documents, []) + question)
        assert text.startswith(tokenizer.decode(head)) and sample.metadata["passages"][0] in text
        assert text.rstrip().endswith(sample.answer_prefix) and sample.question in text
        for ids, index in zip(documents, sample.metadata["pool_indices"]):  # a passage's ids, wherever it appears
            expected = passage(index, TASKS["retrieval_2hop"].passage_words(length)) + "\n\n"
            assert ids == list(tokenizer(expected, add_special_tokens=False).input_ids)
    assert len(heads) == 1  # one shared head for every prompt of a length


def rows(contender: str, scores: list[float], ttft: float, task: str = "retrieval", alone: bool = False) -> list[dict]:
    """Rows of one contender; a chunk contender's passages computed after the preamble unless ``alone``."""
    after = {} if alone or contender == "full" else blend.chunks_after(contender)
    return [{"model": "m", "task": task, "length": 4096, "sample": index, "seed": 0, "contender": contender,
             "passages": 8, "prompt_tokens": 4000, "ttft_s": ttft, "score": score, **after}
            for index, score in enumerate(scores)]  # fmt: skip


def test_the_section_reads_speed_and_paired_answers():
    full = rows("full", [1, 1, 1, 1, 0], 4.0) + rows("full", [1, 1, 0, 0, 0], 4.0, "retrieval_2hop")
    fast = rows("cacheblend:0.15", [1, 1, 1, 1, 1], 1.0) + rows("cacheblend:0.15", [1, 1, 0, 0, 1], 1.0, "retrieval_2hop")
    loose = rows("blend:0", [0, 0, 1, 1, 1], 0.5)  # answers only some of full's: paired, never above 100%
    earlier = rows("blend:0", [0, 0, 0, 1, 1], 0.5, alone=True)  # the earlier design's rows, reported beside
    warm = [{"model": "m", "kind": "warm", "contender": "cacheblend:0.15", "length": 4096, "seconds": 12.5,
             **blend.chunks_after("cacheblend:0.15")}]  # fmt: skip
    text = blend.render(full + fast + loose + earlier + warm, check_rows=[])
    assert "### m, 8 passages (~4,000-token prompts)" in text
    assert "| cacheblend:0.15 | 10 | 1.00 s | 4.00x | 100% [57–100] | 100% [51–100] of 4 |" in text
    assert "| blend:0 | 5 | 0.50 s | 8.00x | 60% [23–88] | 50% [15–85] of 4 |" in text
    assert "| blend:0 (alone) | 5 | 0.50 s | 8.00x | 40% [12–77] | 25% [5–70] of 4 |" in text
    assert text.index("| blend:0 |") < text.index("| blend:0 (alone) |")
    assert "12.5 s |" in text
    assert "4.00x lower TTFT than full prefill, keeping 100% [61–100] of 6 (accuracy 80% vs full's 60%)" in text and "holds at this length" in text


def test_the_check_layer_run_is_its_own_table_against_its_own_full():
    main = rows("full", [1, 1, 1, 1, 0], 4.0) + rows("cacheblend:0.15", [1, 1, 1, 0, 0], 1.0)
    check = rows("full", [1, 1, 1, 1, 0], 6.0) + rows("cacheblend:0.15@4", [1, 1, 1, 1, 1], 2.0)
    text = blend.render(main, check_rows=check)
    mine = text[text.index("### CacheBlend choosing its tokens at a deeper layer") :]
    assert "#### m, 8 passages" in mine and "cacheblend:0.15 |" not in mine
    assert "| cacheblend:0.15@4 | 5 | 2.00 s | 3.00x | 100% [57–100] | 100% [51–100] of 4 |" in mine  # its own full
    assert "cacheblend:0.15@4 here: 3.00x lower TTFT than full prefill, keeping 100% [51–100] of 4" in mine
    assert "holds at this length" in mine
