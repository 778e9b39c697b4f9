"""The engine on the embedded SmolLM2-135M-Instruct: outputs equal HF generate's, the chat answer is right."""

import copy

import pytest
import torch

from kvopt.engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model


def test_engine_equals_hf_generate_on_the_default_model(default_model):
    model, tokenizer = default_model
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    story = "Once upon a time, in a village by the sea, there lived an old fisherman who"
    prompts = [story, "The three primary colors are", story + " every morning", "def fibonacci(n):\n    "]
    llm = LLM(model, tokenizer=tokenizer, kv_memory="64MB", max_model_len=1024, max_num_batched_tokens=16)  # chunked prefill
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
    # The story is computed in 16-token chunks, so its first block is cached when the third prompt arrives.
    assert outputs[2].metrics.cached_tokens == 16
    assert llm.metrics()["kv_blocks_used"] == 0


def test_engine_chat_knows_paris(default_model):
    model, tokenizer = default_model
    llm = LLM(model, tokenizer=tokenizer, kv_memory="64MB", max_model_len=1024)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=24), use_tqdm=False)[0]  # fmt: skip
    assert "Paris" in answer.outputs[0].text
    assert answer.outputs[0].finish_reason in ("stop", "length")


def test_engine_with_drafts_equals_hf_generate_on_the_default_model(default_model):
    """Prompt-lookup drafts on a prompt the model copies from: HF's greedy tokens, most drafts accepted."""
    model, tokenizer = default_model
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    passage = "The quick brown fox jumps over the lazy dog. " * 3 + "A stitch in time saves nine."
    messages = [{"role": "user", "content": f"{passage}\n\nRepeat the text above exactly."}]
    llm = LLM(model, tokenizer=tokenizer, kv_memory="64MB", max_model_len=1024, speculate="prompt_lookup:k=4")
    prompt = llm.chat_prompt(messages)
    output = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
    counted = llm.metrics()
    assert counted["spec_decode_num_accepted_tokens_total"] >= counted["spec_decode_num_draft_tokens_total"] / 2 > 0
