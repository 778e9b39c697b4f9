"""Engine sessions: a conversation's KV saved from the pool, restored after a restart, only the new turn computed."""

import copy

import pytest

from kvopt.codec.errors import CacheCorruptError, CacheFileError, CacheModelMismatchError
from kvopt.engine import LLM, SamplingParams
from kvopt.engine.sessions import SessionError
from test_engine_compressed import prompts
from tiny_models import tiny_model

TURN = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def engine(model, **options) -> LLM:
    return LLM(copy.deepcopy(model), kv_memory="2MB", **options)


def test_a_restarted_engine_continues_a_saved_conversation(model, tmp_path):
    first, question = prompts([90, 12], seed=5)
    llm = engine(model)
    (turn,) = llm.generate([first], TURN, use_tqdm=False)
    path = llm.save_session(turn, tmp_path / "chat.kvs")
    history = first + turn.outputs[0].token_ids  # 110 tokens: 6 full computed blocks (the last token never is)

    restarted = engine(model)
    assert restarted.load_session(path) == history
    (second,) = restarted.generate([history + question], TURN, use_tqdm=False)
    assert second.metrics.cached_tokens == 96
    (fresh,) = engine(model).generate([history + question], TURN, use_tqdm=False)
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids and fresh.metrics.cached_tokens == 0


def test_a_damaged_foreign_or_mismatched_session_is_refused_by_name(model, tmp_path):
    llm = engine(model)
    (turn,) = llm.generate(prompts([70]), TURN, use_tqdm=False)
    path = llm.save_session(turn, tmp_path / "chat.kvs")
    data = path.read_bytes()
    (tmp_path / "flipped.kvs").write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    with pytest.raises(CacheCorruptError, match="checksum"):
        engine(model).load_session(tmp_path / "flipped.kvs")
    (tmp_path / "short.kvs").write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheCorruptError, match="truncated"):
        engine(model).load_session(tmp_path / "short.kvs")
    with pytest.raises(CacheModelMismatchError, match="different weights"):
        LLM(tiny_model("llama", seed=1), kv_memory="2MB").load_session(path)
    with pytest.raises(CacheFileError, match="block_size=16"):
        engine(model, block_size=8).load_session(path)
    with pytest.raises(CacheFileError, match="cannot read"):
        engine(model).load_session(tmp_path / "missing.kvs")


def test_saving_what_the_pool_does_not_hold_says_why(model, tmp_path):
    llm = engine(model)
    (turn,) = llm.generate(prompts([70]), SamplingParams(max_tokens=4, ignore_eos=True, kv_method="snapkv:ratio=0.5"),
                           use_tqdm=False)  # fmt: skip
    with pytest.raises(SessionError, match="compressed kv_method"):
        llm.save_session(turn, tmp_path / "x.kvs")
    with pytest.raises(SessionError, match="enable_prefix_caching"):
        engine(model, enable_prefix_caching=False).save_session([1] * 40, tmp_path / "y.kvs")
    assert not (tmp_path / "x.kvs").exists() and not (tmp_path / "y.kvs").exists()
