"""``kvopt generate``'s engine path (kvopt.engine.streaming): the same answer as ``model.generate`` over a kvopt
cache, streamed piece by piece, with the stats line's numbers; past the model's context, the HF path."""

import pytest

from kvopt.engine.streaming import stream_through_engine
from kvopt.runtime import generate_streaming

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method", ["full", "kivi:bits=4,residual=16,group=16", "streamingllm:budget=24"])
def test_the_engine_streams_the_answer_model_generate_gives(tiny_with_tokenizer, method):
    model, tokenizer = tiny_with_tokenizer
    pieces = []
    prompt = "the cat sat on the mat and the dog ran " * 6
    result = stream_through_engine(prompt, model, method, 20, chat=False, tokenizer=tokenizer, sink=pieces.append)
    reference = generate_streaming(prompt, model, method, 20, chat=False, tokenizer=tokenizer)
    assert result.text == reference.text == "".join(pieces) and len(pieces) > 2
    assert result.new_tokens == reference.new_tokens and result.prompt_tokens == reference.prompt_tokens
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert 0 < result.kv_bytes and result.full_kv_bytes == reference.full_kv_bytes
    if method != "full":  # the compressed sequence held fewer blocks than its tokens take in full precision
        assert result.kv_bytes < result.full_kv_bytes


def test_past_the_context_a_streaming_method_takes_the_hf_path(tiny_with_tokenizer, monkeypatch):
    model, tokenizer = tiny_with_tokenizer
    monkeypatch.setattr(model.config, "max_position_embeddings", 24)
    result = stream_through_engine("the cat sat on the mat", model, "streamingllm:budget=16", 30, chat=False,
                                   tokenizer=tokenizer)  # fmt: skip
    assert result.new_tokens == 30 and result.prompt_tokens + 30 > 24
