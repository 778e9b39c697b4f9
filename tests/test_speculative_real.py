"""Speculative decoding on the embedded SmolLM2-135M-Instruct: prompt lookup on a copying task."""

import pytest
import torch

import kvopt
from kvopt.local_text import real_text
from kvopt.runtime import encode_prompt

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("spec", ["full", "kivi:bits=4", "h2o:budget=128"])
def test_prompt_lookup_equals_plain_greedy_on_a_copying_task(default_model, spec):
    model, tokenizer = default_model
    text = real_text()[0]
    passage = text[: text.find(" ", 1500)]
    prompt = f"{passage}\n\nCopy the first three sentences of the text above exactly, word for word."
    ids = encode_prompt(tokenizer, prompt, chat=True)
    expected = model.generate(ids, past_key_values=kvopt.cache(spec, model), max_new_tokens=48, do_sample=False)
    with torch.no_grad():
        out = kvopt.generate(model, ids, cache=spec, speculate="prompt_lookup:k=4", max_new_tokens=48, adaptive=False)
    assert out.tokens == expected[0, ids.shape[-1] :].tolist()
    if spec == "full":
        assert out.stats.acceptance_rate > 0.6  # the answer copies the prompt
