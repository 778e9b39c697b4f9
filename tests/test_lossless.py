"""`full` must reproduce HF's DynamicCache generation logits step by step (fp32, max |diff| <= 1e-5)."""

import pytest
import torch
from conftest import random_batch
from transformers import DynamicCache

import kvopt
from kvopt.errors import CacheUsageError

GENERATE = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)


def generate_both(model_pair, ids, mask, spec="full"):
    reference, ours = model_pair
    expected = reference.generate(
        ids, attention_mask=mask, past_key_values=DynamicCache(config=reference.config), **GENERATE
    )
    cache = kvopt.cache(spec, ours)
    got = ours.generate(ids, attention_mask=mask, past_key_values=cache, **GENERATE)
    return expected, got, cache


@pytest.mark.parametrize("lengths", [[17], [19, 11, 5]], ids=["batch1", "leftpad3"])
def test_full_matches_dynamic_cache(model_pair, lengths):
    ids, mask = random_batch(lengths)
    expected, got, cache = generate_both(model_pair, ids, mask)
    assert len(expected.logits) == len(got.logits) == GENERATE["max_new_tokens"]
    for step, (a, b) in enumerate(zip(expected.logits, got.logits)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-5, f"step {step}: max |logit diff| {diff}"
    assert torch.equal(expected.sequences, got.sequences)
    # Accounting: every real token is seen and kept by a lossless cache (full-attention layers).
    for layer, stats in zip(cache.layers, cache.stats()):
        assert stats.seen == sum(lengths) + len(lengths) * (GENERATE["max_new_tokens"] - 1)
        if not layer.is_sliding:
            assert stats.kept == stats.seen


def test_full_matches_plain_forward(model_pair):
    """Chunked prefill through the cache equals one uncached forward over the whole sequence."""
    reference, ours = model_pair
    ids, _ = random_batch([24])
    expected = reference(ids).logits
    cache = kvopt.cache("full", ours)
    chunks = [ours(ids[:, a:b], past_key_values=cache).logits for a, b in [(0, 10), (10, 11), (11, 24)]]
    assert (torch.cat(chunks, dim=1) - expected).abs().max().item() <= 1e-5


def test_sliding_layers_forget_outside_window():
    from tiny_models import tiny_model

    model = tiny_model("mistral")
    cache = kvopt.cache("full", model)
    ids, _ = random_batch([40])
    model(ids, past_key_values=cache)
    window = model.config.sliding_window
    for stats in cache.stats():
        assert stats.seen == 40 and stats.kept == window - 1


def test_beam_search_matches_dynamic_cache_and_compressed_parts_refuse_it(model_pair):
    """HF's batch operations (beam search reorders and repeats rows) act on the dense store; parts refuse them."""
    reference, ours = model_pair
    ids, mask = random_batch([15, 9])
    beams = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    cache = DynamicCache(config=reference.config)
    expected = reference.generate(ids, attention_mask=mask, past_key_values=cache, **beams)
    got = ours.generate(ids, attention_mask=mask, past_key_values=kvopt.cache("full", ours), **beams)
    assert torch.equal(expected, got)
    quantized = kvopt.cache("kivi:bits=2,residual=8,group=8", ours)
    if all(layer.is_sliding for layer in quantized.layers):
        return  # kivi keeps sliding layers dense
    with pytest.raises(CacheUsageError, match=r"selecting batch rows \(beam search\) is not supported .* quantized"):
        ours.generate(ids, attention_mask=mask, past_key_values=quantized, **beams)
