"""rocketkv: the paper's budget split, stage 1 = SnapKV, stage 2 against a slow token-level reference,
an index cheaper than the keys, real savings, batches and composition."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import generate_rows_alone, random_batch
from tiny_models import tiny_model

import kvopt
from kvopt.cache.sparse import SparseKV, SparseRow, SparseSplit
from kvopt.errors import MethodParameterError
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.methods.rocketkv import capacity_for, ratio_c2, stage_two
from kvopt.models.info import ModelInfo


def official_split(prompt: int, budget: int, head_dim: int) -> tuple[int, int, int, int]:
    """NVlabs/RocketKV ``get_params_for_token_budget`` (gpt-fast/rocket.py), with max_new_tokens = 0."""
    budget = min(prompt, budget)
    ratio = max(1.0, prompt / budget)
    alpha = min(0.2 + math.log2(ratio) * 0.06, 0.8)
    capacity = int(prompt / ratio**alpha)
    k = min(round(budget / 2), capacity)
    ratio = max(1.0, capacity / budget)
    chunk = min(math.floor(ratio), math.ceil(math.sqrt(ratio)))
    r = min(head_dim, max(1, round(head_dim * chunk / ratio)))
    return capacity, chunk, r, k


@pytest.mark.parametrize(
    "prompt, budget", [(4096, 256), (8192, 256), (8192, 512), (32768, 256), (2000, 1000), (300, 40)]
)
def test_budget_split_is_the_papers(prompt, budget):
    capacity = capacity_for(prompt, budget)
    split = stage_two(capacity, max(1.0, capacity / budget), 64)
    assert (capacity, split.chunk, split.channels, split.topk) == official_split(prompt, budget, 64)
    (method,) = parse(f"rocketkv:budget={budget}")
    assert method.kept_tokens(prompt) == capacity


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75, 0.9, 0.99])
def test_a_ratio_pairs_the_capacity_with_the_budget_the_split_would_give_it(ratio):
    prompt = 100_000
    capacity = int(prompt * (1 - ratio))
    budget = capacity / ratio_c2(ratio)  # the token budget stage 2 works with
    assert abs(capacity_for(prompt, round(budget)) - capacity) <= 0.01 * capacity


def test_a_budget_covering_the_prompt_attends_exactly():
    assert stage_two(100, 1.0, 64) == SparseSplit(chunk=1, channels=64, topk=100)


# -- stage 2 against a slow reference ---------------------------------------------------------------


def reference_stage_two(keys, values, query, split: SparseSplit, scaling: float):
    """The paper's hybrid attention for one query, token by token in float64: ``(slots per KV head, output)``.

    ``keys/values [H_kv, n, D]``, ``query [H, D]``. Channels: top-r of the group's summed ``|q|``; a token's
    approximate score uses its chunk's max (group query positive) or min per channel; softmax over tokens
    with temperature sqrt(D sum|q_sel| / sum|q|), summed over the group. Ours (documented deviations): the
    best whole chunks covering top-k tokens (earlier first on a tie), and the ``n % chunk`` newest tokens,
    which no whole chunk holds, always.
    """
    kv_heads, n, dim = keys.shape
    group = query.shape[0] // kv_heads
    chunks = n // split.chunk
    tail = list(range(chunks * split.chunk, n))
    keys, values, query = keys.double(), values.double(), query.double()
    slots, output = [], torch.zeros(query.shape, dtype=torch.float64)
    for h in range(kv_heads):
        heads = range(h * group, (h + 1) * group)
        magnitude = [sum(abs(float(query[q, c])) for q in heads) for c in range(dim)]
        channels = sorted(range(dim), key=lambda c: -magnitude[c])[: split.channels]
        scores = [0.0] * n
        for q in heads:
            approx = []
            for t in range(chunks * split.chunk):
                members = range(t // split.chunk * split.chunk, t // split.chunk * split.chunk + split.chunk)
                total = 0.0
                for c in channels:
                    column = [float(keys[h, m, c]) for m in members]
                    positive = sum(float(query[p, c]) for p in heads) > 0
                    total += float(query[q, c]) * (max(column) if positive else min(column))
                approx.append(total)
            temperature = math.sqrt(dim * sum(abs(float(query[q, c])) for c in channels) / float(query[q].abs().sum()))
            top = max(approx)
            weights = [math.exp((a - top) / temperature) for a in approx]
            for t in range(len(approx)):
                scores[t] += weights[t] / sum(weights)
        needed = -(-split.topk // split.chunk)
        best = sorted(range(chunks), key=lambda c: (-scores[c * split.chunk], c))[:needed]
        chosen = sorted([t for c in best for t in range(c * split.chunk, (c + 1) * split.chunk)] + tail)
        if needed >= chunks:
            chosen = list(range(n))
        slots.append(chosen)
        for q in heads:
            logits = torch.stack([query[q] @ keys[h, t] * scaling for t in chosen])
            output[q] = torch.softmax(logits, dim=0) @ values[h, chosen]
    return slots, output


@pytest.mark.parametrize(
    "tokens, split",
    [
        (50, SparseSplit(chunk=3, channels=5, topk=10)),
        (47, SparseSplit(chunk=4, channels=9, topk=13)),  # three tail tokens no whole chunk holds, a cut inside a chunk
        (40, SparseSplit(chunk=1, channels=6, topk=7)),  # one-token chunks read the keys' channels
        (30, SparseSplit(chunk=2, channels=16, topk=30)),  # top-k covers every token: exact attention
    ],
)
def test_stage_two_matches_the_slow_reference(tokens, split):
    generator = torch.Generator().manual_seed(tokens)
    keys, values = torch.randn(2, tokens, 16, generator=generator), torch.randn(2, tokens, 16, generator=generator)
    query = torch.randn(4, 16, generator=generator) * 2  # GQA: 4 query heads read 2 KV heads
    row = SparseRow.build(keys, values, torch.arange(tokens).expand(2, -1), split)
    expected_slots, expected = reference_stage_two(keys, values, query, split, scaling=0.25)
    if not row.exact:
        flat = row.slots(row.select(query)) - torch.arange(2)[:, None] * tokens  # per KV head
        assert [sorted(s) for s in flat.tolist()] == expected_slots
    output, lse = row.attend(query[None, :, None], scaling=0.25, softcap=None)
    assert (output[0, :, 0].double() - expected).abs().max() <= 1e-5
    assert torch.isfinite(lse).all()
    assert (row.key_bounds is None) == (split.chunk == 1 or row.exact)


# -- through the model ---------------------------------------------------------------------------


def sparse_part(layer) -> SparseKV:
    (part,) = layer.parts_of(SparseKV)
    return part


def test_stage_one_keeps_what_snapkv_keeps_at_the_papers_capacity():
    model = tiny_model("llama")
    ids, _ = random_batch([300], seed=2)
    rocket = kvopt.cache("rocketkv:budget=40,window=8,kernel=7", model)
    capacity = capacity_for(300, 40)
    snap = kvopt.cache(f"snapkv:budget={capacity},window=8,kernel=7,pooling=max", model)
    with torch.no_grad():
        model(ids, past_key_values=rocket)
        model(ids, past_key_values=snap)
    for ours, theirs in zip(rocket.layers, snap.layers):
        row = sparse_part(ours).row(0)
        assert not len(ours.store) and len(row) == capacity
        assert torch.equal(row.positions, theirs.store.positions[0])
        assert torch.equal(row.keys.whole(), theirs.store.keys[0]) and torch.equal(row.values.whole(), theirs.store.values[0])


def test_the_index_is_cheaper_to_read_and_to_hold_than_the_keys_and_counts_in_nbytes():
    model = tiny_model("llama")
    ids, _ = random_batch([500], seed=3)
    cache, full = kvopt.cache("rocketkv:budget=24,window=8", model), kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids, past_key_values=full)
    info = ModelInfo.from_config(model.config)
    for layer in cache.layers:
        row = sparse_part(layer).row(0)
        split = row.split
        assert split.chunk >= 2 and split.topk < len(row)
        key_bytes = row.keys.nbytes()
        index_bytes = row.key_bounds.numel() * row.key_bounds.element_size()
        assert index_bytes == 2 * (len(row) // split.chunk) * info.num_kv_heads * info.head_dim * 4
        assert index_bytes <= key_bytes  # held: 2 / chunk of the keys
        read = row.key_bounds.shape[-1] * split.channels  # elements one step reads from the index, per KV head
        c2 = len(row) / 24  # capacity / B
        assert read / (len(row) * info.head_dim) <= 1.05 / c2 < 0.25  # about 1 / c2 of the keys' elements
        assert layer.nbytes() == row.nbytes() == key_bytes * 2 + index_bytes + row.positions.numel() * 4
    theory = estimate(info, 500, 1, parse("rocketkv:budget=24,window=8"), dtype=torch.float32).total_bytes
    assert cache.nbytes() == theory
    assert cache.nbytes() < 0.5 * full.nbytes()


def test_decoded_tokens_stay_dense_and_bytes_grow_by_them_only():
    model = tiny_model("llama")
    ids, _ = random_batch([300], seed=4)
    cache = kvopt.cache("rocketkv:budget=40,window=8", model)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
        prefilled = cache.nbytes()
        for _ in range(5):
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads * 2 * 16 * 4
    assert all(len(layer.store) == 5 for layer in cache.layers)
    assert cache.nbytes() - prefilled <= 5 * per_token * 1.1  # the dense store's few slots
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("lengths, runs", [([160, 97, 12], [1, 1, 1]), ([160, 160, 97, 97, 97], [2, 3])])
def test_batch_rows_match_single_runs(lengths, runs):
    """Left-padded rows: each keeps and generates what it keeps and generates alone (its own split); consecutive
    rows of one length share one run (one search and attention for all of them).

    Average pooling here: max pooling's plateaus of tied scores are cut wherever ``topk`` breaks ties
    (stage 1 is SnapKV's, whose tests allow such swaps).
    """
    spec = "rocketkv:budget=24,window=8,kernel=5,pooling=avg"
    cache, alone, width = generate_rows_alone(tiny_model("llama"), spec, lengths, seed=7, new_tokens=10)
    assert [run.rows for run in sparse_part(cache.layers[0]).runs] == runs
    for row, (length, single) in enumerate(zip(lengths, alone)):
        for ours, theirs in zip(cache.layers, single.layers):
            mine = sparse_part(ours).row(row)
            if theirs.parts:
                assert mine.split == sparse_part(theirs).row(0).split
                assert torch.equal(mine.positions - (width - length), sparse_part(theirs).row(0).positions)
            else:  # alone, a prompt under the budget stays dense and is read whole; in the batch, exactly
                assert mine.exact and torch.equal(mine.positions - (width - length), theirs.store.positions[0, :, :12])


@pytest.mark.parametrize("arch", ["gemma2", "mistral", "qwen2"])
def test_other_families_generate(arch):
    """Soft-capped layers read the sparse part with their cap; sliding layers keep stage 1 only."""
    model = tiny_model(arch)
    ids, mask = random_batch([120, 80], seed=5)
    cache = kvopt.cache("rocketkv:ratio=0.75,window=8", model)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert all(torch.isfinite(step).all() for step in out.logits)
    for layer in cache.layers:
        assert bool(layer.parts_of(SparseKV)) == (layer.sliding_window is None)


def test_composition_follows_the_stage_rules():
    with pytest.raises(MethodParameterError, match="rocketkv.*kivi.*rocketkv\\+tokenquant"):
        parse("rocketkv:budget=256+kivi:bits=4")
    with pytest.raises(MethodParameterError, match="must come before"):
        parse("rocketkv:budget=256+snapkv:ratio=0.5")
    with pytest.raises(MethodParameterError, match="evicts while decoding"):
        parse("h2o:budget=64+rocketkv:budget=256")
    model = tiny_model("llama")
    ids, _ = random_batch([200], seed=6)
    cache = kvopt.cache("snapkv:ratio=0.5,window=8+rocketkv:budget=24,window=8", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert len(sparse_part(cache.layers[0]).row(0)) == capacity_for(100, 24)


# -- quantized rows (rocketkv+tokenquant) ------------------------------------------------------------------------


def dequantized_reference(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-token min-max quantization of ``x [H, T, D]`` in groups of ``group`` channels, element by element:
    fp16 zero = min and scale = (max - min) / (2^bits - 1), codes rounded against them."""
    out = torch.empty_like(x)
    levels = (1 << bits) - 1
    for h in range(x.shape[0]):
        for t in range(x.shape[1]):
            for start in range(0, x.shape[2], group):
                block = x[h, t, start : start + group]
                zero = block.min().half().float()
                span = (block.max() - block.min()).item()
                scale = torch.tensor(span / levels if span > 0 else 1.0).half().float()
                codes = torch.round((block - zero) / scale).clamp(0, levels)
                out[h, t, start : start + group] = codes * scale + zero
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    "tokens, split",
    [(50, SparseSplit(chunk=3, channels=5, topk=10)), (40, SparseSplit(chunk=1, channels=6, topk=7)),
     (30, SparseSplit(chunk=2, channels=16, topk=30))],
)  # fmt: skip
def test_quantized_rows_attend_like_the_reference_over_dequantized_tokens(bits, tokens, split):
    """The chunks are chosen from the keys before quantization (fp16 summaries), then attention reads the chosen
    tokens' dequantized vectors: the slow reference's choice on the original keys, its attention over slowly
    dequantized keys and values."""
    from kvopt.cache.sparse import Quantizer

    generator = torch.Generator().manual_seed(tokens + bits)
    keys, values = torch.randn(2, tokens, 16, generator=generator), torch.randn(2, tokens, 16, generator=generator)
    query = torch.randn(4, 16, generator=generator) * 2
    row = SparseRow.build(keys, values, torch.arange(tokens).expand(2, -1), split, Quantizer(bits, 8))
    deq_keys, deq_values = dequantized_reference(keys, bits, 8), dequantized_reference(values, bits, 8)
    # One-token chunks have no summaries: the search reads the stored (dequantized) keys' channels.
    searched = deq_keys if split.chunk == 1 else keys.half().float()
    slots, _ = reference_stage_two(searched, values, query, split, scaling=0.25)
    if not row.exact:
        flat = row.slots(row.select(query)) - torch.arange(2)[:, None] * tokens
        assert [sorted(s) for s in flat.tolist()] == slots
    expected = torch.zeros(4, 16, dtype=torch.float64)
    for q in range(4):
        h = q // 2
        chosen = slots[h]
        logits = deq_keys[h, chosen].double() @ query[q].double() * 0.25
        expected[q] = torch.softmax(logits, dim=0) @ deq_values[h, chosen].double()
    output, _ = row.attend(query[None, :, None], scaling=0.25, softcap=None)
    assert (output[0, :, 0].double() - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("bits", [2, 4])
def test_rocketkv_with_tokenquant_holds_its_estimate_and_fewer_bytes(bits):
    model = tiny_model("llama")
    ids, _ = random_batch([500], seed=3)
    plain, quantized = "rocketkv:budget=24,window=8", f"rocketkv:budget=24,window=8+tokenquant:bits={bits},group=16"
    caches = {spec: kvopt.cache(spec, model) for spec in (plain, quantized)}
    with torch.no_grad():
        for cache in caches.values():
            model(ids, past_key_values=cache)
    info = ModelInfo.from_config(model.config)
    for spec, cache in caches.items():
        assert cache.nbytes() == estimate(info, 500, 1, parse(spec), dtype=torch.float32).total_bytes
    # fp32 vectors (8 bytes per element pair) -> bits/8 per element plus fp16 ranges; fp32 -> fp16 summaries
    assert caches[quantized].nbytes() < (0.3 if bits == 4 else 0.25) * caches[plain].nbytes()
    for layer in caches[quantized].layers:
        row = sparse_part(layer).row(0)
        assert row.key_bounds.dtype == torch.float16 and row.keys.groups.bits == bits


def test_rocketkv_with_tokenquant_generates_batches_as_alone_and_quantizes_decoded_tokens():
    lengths = [160, 97, 97]
    spec = "rocketkv:budget=24,window=8,kernel=5,pooling=avg+tokenquant:bits=4,group=16,residual=16"
    model = tiny_model("llama")
    cache, alone, _ = generate_rows_alone(model, spec, lengths, seed=7, new_tokens=24)
    assert [run.rows for run in sparse_part(cache.layers[0]).runs] == [1, 2]  # quantized runs too
    from kvopt.cache.quantized import QuantizedKV

    for single in alone:  # 23 decoded tokens: one group of 16 has left the residual
        assert all(len(layer.store) == 7 and layer.parts_of(QuantizedKV) for layer in single.layers)
