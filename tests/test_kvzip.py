"""kvzip and shallowzip: reconstruction scoring against a slow reference, real savings, batches, clear errors.

shallowzip scores as kvzip does in the layers its reconstruction runs through and carries their mean score
deeper, so every test runs both: the reference feeds the reconstruction forwards to a plain eager model."""

import copy

import pytest
import torch

import kvopt
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import CacheUsageError
from kvopt.methods.kvzip import KVzip
from kvopt.methods.shallowzip import ShallowZip

#: shallowzip reconstructs through the first of the tiny model's two layers; the second carries its mean score.
METHODS = {"kvzip": KVzip, "shallowzip": lambda **kwargs: ShallowZip(depth=0.5, **kwargs)}
#: Spec prefixes the tests complete with their parameters.
SPECS = {"kvzip": "kvzip:", "shallowzip": "shallowzip:depth=0.5,"}


def reference_scores(model, tokenizer, context: torch.Tensor, method: KVzip) -> list[torch.Tensor]:
    """Per layer [kv_heads, n]: max eager attention weight from any reconstruction query (fresh full forwards)."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    n = context.shape[1]
    layers = model.config.num_hidden_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    best = [torch.zeros(model.config.num_key_value_heads, n) for _ in range(layers)]
    for prompt, chunk, _ in method._reconstruction_chunks(tokenizer, context, torch.ones_like(context)):
        ids = torch.cat([context, torch.tensor([prompt]), chunk], dim=1)
        with torch.no_grad():
            attentions = eager(ids, output_attentions=True).attentions
        for layer, weights in enumerate(attentions):  # [1, H, L, L]
            rows = weights[0, :, n:, :n]  # reconstruction queries -> context keys
            for kv_head in range(model.config.num_key_value_heads):
                heads = rows[kv_head * group : (kv_head + 1) * group]
                best[layer][kv_head] = torch.maximum(best[layer][kv_head], heads.amax(dim=(0, 1)))
    if isinstance(method, ShallowZip):  # deeper layers: the mean, over layers and KV heads, of the last scored ones
        depth = method.scored_layers(layers)
        carried = torch.stack(best[max(0, depth - method.carry) : depth]).mean(dim=(0, 1))
        best = best[:depth] + [carried.expand_as(scores) for scores in best[depth:]]
    return best


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize(("length", "chunk"), [(150, 64), (2040, 512)])
def test_kvzip_layer_budgets_keep_what_the_reference_scores_highest(tiny_with_tokenizer, name, length, chunk):
    """2040 tokens: a prompt just under the model's 2048 positions, whose reconstruction forwards (forgotten
    afterwards) run past them; the prompt fits, so it is scored, not refused."""
    model, tokenizer = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, length), generator=torch.Generator().manual_seed(1))
    method = METHODS[name](ratio=0.6, window=4, sinks=2, chunk=chunk, budgets="layer")
    cache = kvopt.cache([method], model)
    cache.prefill(model, context, tokenizer=tokenizer)
    assert cache.get_seq_length() == length
    for layer, scores in zip(cache.layers, reference_scores(model, tokenizer, context, method)):
        keep = int(length * 0.4)
        for head in range(scores.shape[0]):
            ranked = scores[head].clone()
            ranked[:2] = float("inf")  # sinks
            ranked[-4:] = float("inf")  # window
            expected = sorted(ranked.topk(keep).indices.tolist())
            assert layer.store.positions[0, head].tolist() == expected


@pytest.mark.parametrize("name", METHODS)
def test_kvzip_global_budgets_rank_all_layers_and_heads_together(tiny_with_tokenizer, name):
    """budgets=global: the slow reference ranks every (layer, head, token) score in one list."""
    model, tokenizer = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, 150), generator=torch.Generator().manual_seed(5))
    method = METHODS[name](ratio=0.6, window=4, sinks=2, chunk=64)
    cache = kvopt.cache([method], model)
    cache.prefill(model, context, tokenizer=tokenizer)
    scores = reference_scores(model, tokenizer, context, method)
    keep, window = int(150 * 0.4), 4
    candidates = []  # (score, layer, head, token) outside the protected window
    for layer, per_head in enumerate(scores):
        for head in range(per_head.shape[0]):
            for token in range(150 - window):
                score = float("inf") if token < 2 else float(per_head[head, token])
                candidates.append((score, layer, head, token))
    candidates.sort(key=lambda c: -c[0])
    winners = candidates[: (keep - window) * len(scores) * scores[0].shape[0]]
    for layer, held in enumerate(cache.layers):
        (prefix,) = held.parts_of(RaggedKV)
        counts = prefix.counts()[0]
        for head in range(counts.numel()):
            start = int(prefix.offsets[head])
            kept = prefix.positions[start : start + int(counts[head])].tolist()
            chosen = sorted(t for _, l, h, t in winners if (l, h) == (layer, head))
            assert kept == chosen + list(range(150 - window, 150))
    sizes = {int(c) for layer in cache.layers for c in layer.parts_of(RaggedKV)[0].counts().flatten()}
    assert len(sizes) > 1  # the point of global budgets: heads and layers keep different amounts


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("budgets", ["global", "layer"])
def test_kvzip_frees_memory_and_never_keeps_reconstruction_tokens(tiny_with_tokenizer, budgets, name):
    model, tokenizer = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, 300), generator=torch.Generator().manual_seed(2))
    full = kvopt.cache("full", model)
    cache = kvopt.cache(f"{SPECS[name]}ratio=0.75,budgets={budgets}", model)
    full.prefill(model, context)
    cache.prefill(model, context, tokenizer=tokenizer)
    assert cache.get_seq_length() == 300
    heads = model.config.num_key_value_heads
    prefixes = [layer.parts_of(RaggedKV) for layer in cache.layers]
    held = [p[0].counts().sum() if p else len(layer.store) * heads for p, layer in zip(prefixes, cache.layers)]
    assert int(sum(held)) == 75 * heads * len(cache.layers)
    for prefix, layer in zip(prefixes, cache.layers):
        positions = prefix[0].positions if prefix else layer.store.positions
        assert int(positions.max()) < 300 and not layer.store.has_extra("kvzip")
    assert cache.nbytes() < 0.3 * full.nbytes()


@pytest.mark.parametrize("name", METHODS)
def test_kvzip_batch_rows_keep_their_own_budget(tiny_with_tokenizer, name):
    model, tokenizer = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (2, 120), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    cache = kvopt.cache(f"{SPECS[name]}ratio=0.5", model)
    cache.prefill(model, ids, attention_mask=mask, tokenizer=tokenizer)
    per_row = sum(layer.parts_of(RaggedKV)[0].counts().sum(dim=1) for layer in cache.layers)  # token-heads per row
    slots = model.config.num_key_value_heads * len(cache.layers)
    assert per_row.tolist() == [60 * slots, 40 * slots]


def test_kvzip_needs_tokenizer(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    cache = kvopt.cache("kvzip:ratio=0.5", model)
    with pytest.raises(CacheUsageError, match="tokenizer"):
        cache.prefill(model, torch.randint(100, 500, (1, 40)))


def min_max_4bit(groups: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit min-max quantized and dequantized along ``dim`` by hand (fp16 step and zero-point)."""
    low, high = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
    step, zero = ((high - low) / 15).half().float(), low.half().float()
    return torch.round((groups - zero) / step).clamp(0, 15) * step + zero


def test_kivi_after_kvzip_quantizes_keys_per_channel_and_values_per_token(tiny_with_tokenizer):
    """kvzip selects at full precision (kivi waits for its pass), then kivi packs the same rows as KIVI does: each
    head's keys per channel over groups of 16 of its own tokens (the last group short), values per token. Against a
    slow reference (the rows quantized and dequantized by hand, attended as plain ragged rows), and for real bytes."""
    model, tokenizer = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, 300), generator=torch.Generator().manual_seed(3))
    alone, both = kvopt.cache("kvzip:ratio=0.75", model), kvopt.cache("kvzip:ratio=0.75+kivi:bits=4,group=16", model)
    for cache in (alone, both):
        cache.prefill(model, context, tokenizer=tokenizer)
    query = torch.randn(1, model.config.num_attention_heads, 1, 8)
    uneven = 0
    for plain, packed in zip(alone.layers, both.layers):
        rows, codes = plain.parts_of(RaggedKV)[0], packed.parts_of(RaggedKV)[0]
        assert torch.equal(rows.positions, codes.positions) and torch.equal(rows.offsets, codes.offsets)
        bounds = rows.offsets.tolist()
        keys = []
        for start, end in zip(bounds, bounds[1:]):  # per head: groups of 16 tokens, per channel
            keys += [min_max_4bit(rows.keys[first : min(first + 16, end)], 0) for first in range(start, end, 16)]
            uneven += (end - start) % 16 != 0
        values = min_max_4bit(rows.values.unflatten(-1, (-1, min(16, rows.values.shape[-1]))), -1).flatten(-2)
        reference = RaggedKV(torch.cat(keys), values, rows.positions, rows.offsets, rows.batch, rows.kv_heads)
        position = torch.tensor([300])
        for got, want in zip(codes.attend(query, position, 0.35), reference.attend(query, position, 0.35)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert uneven  # some heads' last groups are short (padded in storage, left out of the ranges)
    assert both.nbytes() < 0.4 * alone.nbytes()


def test_kvzip_waits_for_nothing_from_kivi_before_its_pass(tiny_with_tokenizer):
    """kivi leaves the prompt dense until kvzip's pass (which needs it at full precision) has run."""
    model, _ = tiny_with_tokenizer
    cache = kvopt.cache("kvzip:ratio=0.75+kivi:bits=4,group=16,residual=16", model)
    with torch.no_grad():
        model(torch.randint(100, 5000, (1, 64)), past_key_values=cache)
    assert all(not layer.parts and len(layer.store) == 64 for layer in cache.layers)
