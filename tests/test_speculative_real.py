"""Speculative decoding on the embedded SmolLM2-135M-Instruct: prompt lookup on a copying task."""

import pytest
import torch

import kvopt
from kvopt.runtime import encode_prompt

pytestmark = pytest.mark.real_model
#: The passage to copy, pinned: the machine's "best local prose" (licence texts, the Python docs where python3-doc is
#: installed, stdlib docstrings) is copied at acceptance rates from 0.03 to 0.93 depending on the source and where
#: in it the passage starts, so a threshold on it would test the machine, not the proposer.
PASSAGE = ("A lighthouse stands at the end of the harbour wall. Its keeper climbs the ninety steps every evening to "
           "light the lamp. Ships coming in from the north use the light to find the narrow channel between the rocks.")


@pytest.mark.parametrize("spec", ["full", "kivi:bits=4", "h2o:budget=128"])
def test_prompt_lookup_equals_plain_greedy_on_a_copying_task(default_model, spec):
    model, tokenizer = default_model
    prompt = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
    ids = encode_prompt(tokenizer, prompt, chat=True)
    expected = model.generate(ids, past_key_values=kvopt.cache(spec, model), max_new_tokens=48, do_sample=False)
    with torch.no_grad():
        out = kvopt.generate(model, ids, cache=spec, speculate="prompt_lookup:k=4", max_new_tokens=48, adaptive=False)
    assert out.tokens == expected[0, ids.shape[-1] :].tolist()
    if spec == "full":
        assert out.stats.acceptance_rate > 0.6  # the answer copies the prompt
