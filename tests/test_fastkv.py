"""fastkv: the TSP selection and every layer's KV against slow references, the later layers against HF's own
decoder layers run on the selected tokens, a prefill that really computes less, real savings, batches."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import generate_rows_alone, random_batch
from test_eviction_prefill import Probe, assert_same_selection, check_snapkv_family, pool, ratio_target, window_scores
from tiny_models import tiny_model
from transformers import DynamicCache

import kvopt
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.eval.contenders import parse_contender
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.methods.recording import record_prefill
from kvopt.models.info import ModelInfo

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "fastkv:ratio=0.7,tsp_rate=0.5,tsp_layer=0"  # the tiny models have 3 layers: 1 and 2 get the selected tokens


def reference_selection(snap, window: int, kernel: int, pooling: str, count: int) -> tuple[list[int], dict]:
    """The TSP layer's choice (one row): SnapKV's pooled window scores summed over the KV heads, the window always
    kept, the best ``count`` positions in all; also each position's summed score (to judge ties at the cut)."""
    per_head = [pool(scores, kernel, pooling) for scores in window_scores(snap, window)[0]]
    summed = [sum(column) for column in zip(*per_head)]
    slots = len(summed)
    ranked = sorted(range(slots - window), key=lambda s: -summed[s])
    chosen = sorted(ranked[: count - window] + list(range(slots - window, slots)))
    return chosen, dict(enumerate(summed))


def test_selection_and_every_layers_kv_match_the_slow_references():
    """Layer 0 (TSP) picks what the reference picks; every layer keeps SnapKV's choice of ``ratio`` of the
    *prompt*, the later ones among the propagated tokens (their queries and keys as the probe saw them)."""
    ids, _ = random_batch([120], seed=11)
    model = tiny_model("llama")
    probe = Probe()
    cache = kvopt.cache([probe, *parse(SPEC)], model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    expected, summed = reference_selection(probe.records[0][0], window=8, kernel=7, pooling="max", count=60)
    for index in (1, 2):
        (snap,) = probe.records[index]
        assert_same_selection(snap["positions"][0][0], expected, summed, f"layer {index}")
        assert snap["query_positions"] == snap["positions"][0][0]
    target = ratio_target(120, 0.7)
    check_snapkv_family(cache, probe, window=8, kernel=7, pooling="max", targets_of=lambda _, __: target)
    assert all(layer.seen == 120 and layer.seen_real == 120 for layer in cache.layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_later_layers_equal_hfs_own_layers_run_on_the_selected_tokens(arch):
    """Reference: HF's plain model (SDPA, DynamicCache) prefills the whole prompt up to the TSP layer; its later
    decoder layers then run on the selected tokens' hidden states at their RoPE positions, causally among them."""
    ids, _ = random_batch([90], seed=12)
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    probe = Probe()
    cache = kvopt.cache([probe, *parse(SPEC)], model)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    chosen = torch.tensor(probe.records[1][0]["positions"][0][0])

    inputs = {}
    entry = reference.model.layers[1].register_forward_pre_hook(
        lambda module, args, kwargs: inputs.update(hidden=args[0], kwargs=kwargs), with_kwargs=True
    )
    with torch.no_grad():
        reference(ids, past_key_values=DynamicCache(config=reference.config))
    entry.remove()
    kwargs, hidden = dict(inputs["kwargs"]), inputs["hidden"][:, chosen]
    later = DynamicCache(config=reference.config)
    kwargs.update(
        attention_mask=None, position_ids=kwargs["position_ids"][:, chosen],
        position_embeddings=tuple(table[:, chosen] for table in kwargs["position_embeddings"]),
        **{"cache" if "cache" in kwargs else "past_key_values": later},
    )  # fmt: skip
    with torch.no_grad():
        for layer in reference.model.layers[1:]:
            hidden = layer(hidden, **kwargs)
        expected = reference.lm_head(reference.model.norm(hidden))[0, -1]
    assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    for index in (1, 2):
        keys = probe.records[index][0]["keys"]
        assert torch.allclose(keys, later.layers[index].keys.double(), atol=1e-5)


def test_the_later_layers_compute_only_the_propagated_tokens():
    """The point of FastKV: the MLPs (and attention) after the TSP layer see tsp_rate of the prompt."""
    model = tiny_model("llama")
    seen = {}
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda module, args, out, index=index: seen.setdefault(index, args[0].shape[1]))
    ids, _ = random_batch([200], seed=13)
    with torch.no_grad():
        model(ids, past_key_values=kvopt.cache("fastkv:ratio=0.9,tsp_rate=0.25,tsp_layer=0", model))
    assert seen == {0: 200, 1: 50, 2: 50}


def test_bytes_drop_to_the_budget_and_match_the_estimate():
    model = tiny_model("llama")
    ids, _ = random_batch([300], seed=14)
    cache, full = kvopt.cache(SPEC, model), kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids, past_key_values=full)
    assert [len(layer.store) for layer in cache.layers] == [90, 90, 90]
    info = ModelInfo.from_config(model.config)
    # the estimate counts the kept tokens' int32 positions too (per KV head), as the cache holds them
    assert cache.nbytes() == estimate(info, 300, 1, parse(SPEC), dtype=torch.float32).total_bytes
    assert cache.nbytes() < 0.35 * full.nbytes()


def test_batch_rows_match_single_runs():
    """Left-padded rows propagate and generate what they do alone (rows with fewer tokens fill their places with
    padding, so their tokens stay a run at the end). Average pooling: max pooling's ties break anywhere."""
    lengths = [160, 97, 40]
    spec = "fastkv:ratio=0.7,tsp_rate=0.4,tsp_layer=0,pooling=avg,kernel=5"
    cache, alone, width = generate_rows_alone(tiny_model("llama"), spec, lengths, seed=15)
    for row, (length, single) in enumerate(zip(lengths, alone)):
        for ours, theirs in zip(cache.layers, single.layers):
            assert int(ours.store.valid_counts()[row]) == len(theirs.store)
            mine = ours.store.positions[row, 0][ours.store.valid[row, 0]]
            assert torch.equal(mine - (width - length), theirs.store.positions[0, 0])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma", "gemma2"])
def test_families_generate_from_the_original_positions(arch):
    """Sliding windows (mistral, gemma2) and soft-capping (gemma2) apply at the propagated tokens' positions."""
    model = tiny_model(arch)
    ids, mask = random_batch([70, 52], seed=16)
    cache = kvopt.cache("fastkv:ratio=0.6,tsp_rate=0.5,window=4", model)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert all(torch.isfinite(step).all() for step in out.logits)
    assert all(layer.seen == 70 + 4 for layer in cache.layers)  # the prompt, then the decoded tokens
    later = cache.layers[-1]
    assert int(later.store.positions.max()) == 73 and later.seen_real == 70 + 52 + 2 * 4


def test_refusals_name_the_fix():
    with pytest.raises(MethodParameterError, match="tsp_layer=2 leaves no later layer"):
        kvopt.cache("fastkv:ratio=0.5,tsp_layer=2", tiny_model("llama"))
    with pytest.raises(MethodParameterError, match="tsp_rate"):
        parse("fastkv:ratio=0.5,tsp_rate=0")
    model = tiny_model("llama")
    ids, _ = random_batch([40], seed=17)
    recorded, _ = record_prefill(model, ids)
    with pytest.raises(CacheUsageError, match="prefill this cache directly"):
        kvopt.cache("fastkv:ratio=0.5", model).replay_prefill(recorded)
    assert not parse_contender("fastkv:ratio=0.5").replays and parse_contender("snapkv:ratio=0.5").replays
    with pytest.raises(MethodParameterError, match=r"put fastkv first: 'fastkv:ratio=0.5\+window:ratio=0.5'"):
        parse("window:ratio=0.5+fastkv:ratio=0.5")
