"""One prefill, many methods: replaying a recorded prefill equals prefilling each cache directly."""

import pytest
import torch

import kvopt
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import CacheUsageError
from kvopt.methods.recording import record_prefill

from conftest import random_batch
from tiny_models import tiny_model

SPECS = [
    "full",
    "window:ratio=0.5",
    "snapkv:ratio=0.5,window=4",
    "pyramidkv:ratio=0.6",
    "adakv:ratio=0.5",
    "tova:ratio=0.5",
    "h2o:ratio=0.5,window=2",
    "streamingllm:ratio=0.5,sinks=2",
    "morphkv:budget=12,window=4",
    "knorm:ratio=0.5",
]


def continue_decoding(model, cache, ids, mask, steps: int = 3) -> list[torch.Tensor]:
    """Greedy steps after the prefill, the same tokens for both caches; returns the logits."""
    logits = []
    with torch.no_grad():
        for step in range(steps):
            token = torch.full((ids.shape[0], 1), 7 + step)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits.append(model(token, attention_mask=mask, past_key_values=cache).logits[:, -1])
    return logits


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("spec", SPECS)
def test_replayed_prefill_equals_a_direct_one(arch, spec):
    model = tiny_model(arch)
    kvopt.prepare(model)
    ids, mask = random_batch([24, 17])
    direct = kvopt.cache(spec, model)
    with torch.no_grad():
        expected_prefill = model(ids, attention_mask=mask, past_key_values=direct).logits[:, -1]
    recorded, output = record_prefill(model, ids, attention_mask=mask)
    held = [len(layer.store) for layer in recorded.layers]
    replayed = kvopt.cache(spec, model)
    replayed.replay_prefill(recorded)
    assert torch.equal(output.logits[:, -1], expected_prefill)
    assert [s.kept for s in replayed.stats()] == [s.kept for s in direct.stats()]
    assert replayed.nbytes() <= direct.nbytes()  # the copy is compact; a direct run may hold some slack
    for ours, theirs in zip(replayed.layers, direct.layers):
        if not ours.parts_of(RaggedKV):
            assert torch.equal(ours.store.positions, theirs.store.positions)
    for ours, theirs in zip(continue_decoding(model, replayed, ids, mask), continue_decoding(model, direct, ids, mask)):
        assert (ours - theirs).abs().max().item() <= 1e-5
    # The recording is untouched, so the next method can replay it too.
    assert [len(layer.store) for layer in recorded.layers] == held


def test_kvzip_replays_then_runs_its_reconstruction(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (1, 120), generator=torch.Generator().manual_seed(4))
    direct = kvopt.cache("kvzip:ratio=0.5,chunk=32", model)
    direct.prefill(model, ids, tokenizer=tokenizer)
    recorded, _ = record_prefill(model, ids)
    replayed = kvopt.cache("kvzip:ratio=0.5,chunk=32", model)
    replayed.replay_prefill(recorded)
    replayed.after_prefill(model, ids, tokenizer=tokenizer)
    for replayed_layer, direct_layer in zip(replayed.layers, direct.layers):  # global budgets: ragged segments
        (ours,), (theirs,) = replayed_layer.parts_of(RaggedKV), direct_layer.parts_of(RaggedKV)
        assert torch.equal(ours.positions, theirs.positions) and torch.equal(ours.offsets, theirs.offsets)


def test_replay_needs_a_recording_and_an_empty_cache():
    model = tiny_model("llama")
    kvopt.prepare(model)
    ids, mask = random_batch([10])
    plain = kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=plain)
    with pytest.raises(CacheUsageError, match="record_prefill"):
        kvopt.cache("full", model).replay_prefill(plain)
    recorded, _ = record_prefill(model, ids)
    with pytest.raises(CacheUsageError, match="empty cache"):
        plain.replay_prefill(recorded)
