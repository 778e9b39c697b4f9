"""A few checks on the embedded SmolLM2-135M-Instruct (converted once into $KVOPT_CACHE)."""

import pytest
import torch
from transformers import DynamicCache

import kvopt
from kvopt.runtime import generate_streaming

pytestmark = pytest.mark.real_model


def test_default_model_knows_paris(default_model):
    model, tokenizer = default_model
    pieces: list[str] = []
    result = generate_streaming(
        "What is the capital of France?", model=model, tokenizer=tokenizer, max_new_tokens=24, sink=pieces.append
    )
    assert "Paris" in result.text
    assert "".join(pieces).strip() == result.text.strip()
    assert result.kv_bytes > 0 and result.prompt_tokens > 5


def test_default_model_full_matches_dynamic_cache(default_model):
    model, tokenizer = default_model
    prompts = ["The quick brown fox", "Once upon a time in a land far away, there lived", "Hi"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model.generate(**batch, past_key_values=DynamicCache(config=model.config), **kwargs)
        got = model.generate(**batch, past_key_values=kvopt.cache("full", model), **kwargs)
    for a, b in zip(expected.logits, got.logits):
        assert (a - b).abs().max().item() <= 1e-5
    assert torch.equal(expected.sequences, got.sequences)
