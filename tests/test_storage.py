"""Storage details under every method: attention with log-sum-exp, implied positions, exact bytes."""

import pytest
import torch
from conftest import random_batch
from transformers import DynamicCache

import kvopt
from kvopt.cache import attention_math, quant
from kvopt.cache.positions import TokenIndex
from kvopt.cache.storage import DenseKVStore
from tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("mask_heads", [None, 1, 2])
def test_attention_with_lse_equals_the_explicit_softmax_even_for_queries_that_see_nothing(mask_heads):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 3, 16, generator=gen)
    keys, values = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    mask = None
    if mask_heads is not None:
        mask = torch.rand(2, mask_heads, 3, 40, generator=gen) > 0.4
        mask[0, 0, 1] = False  # a query row with no visible key: it must weigh nothing when merged
    fast = attention_math.attention_with_lse(query, keys, values, mask, 0.25)
    slow = attention_math._explicit_attention_with_lse(query, keys, values, mask, 0.25)
    assert torch.allclose(fast[0], slow[0], atol=1e-5) and torch.equal(fast[1].isinf(), slow[1].isinf())
    finite = slow[1].isfinite()
    assert torch.allclose(fast[1][finite], slow[1][finite], atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4])
def test_unpacking_round_trips_when_bytes_do_not_fall_into_words(bits):
    codes = torch.randint(0, 1 << bits, (3, 8, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = quant.pack(codes, bits, dim=1)  # last axis of 6 bytes: no int32 view
    assert torch.equal(quant.unpack(packed, bits, dim=1), codes)
    assert torch.equal(quant.unpack(packed[:, :, 1:5], bits, dim=1), codes[:, :, 1:5])


def test_token_index_holds_runs_without_bytes_and_keeps_irregular_positions():
    run = torch.arange(10, 20, dtype=torch.int32).expand(2, 3, -1)
    index = TokenIndex.of(run, None)
    assert index.nbytes() == 0 and torch.equal(index.positions.expand(2, 3, -1), run)
    following = TokenIndex.of(torch.arange(20, 25, dtype=torch.int32).expand(2, 3, -1), None)
    joined = index.cat(following)
    assert joined.nbytes() == 0 and joined.length == 15 and int(joined.positions[0, 0, -1]) == 24
    gap = index.cat(TokenIndex.of(torch.arange(30, 35, dtype=torch.int32).expand(2, 3, -1), None))
    assert gap.nbytes() == 15 * 2 * 4 and int(gap.positions[1, 0, 10]) == 30
    padded = torch.ones(2, 3, 10, dtype=torch.bool)
    padded[1, :, :2] = False
    kept = TokenIndex.of(run, padded)
    assert kept.valid is not None and kept.valid_counts().tolist() == [10, 8]


def test_full_holds_exactly_hf_bytes_and_eviction_adds_only_positions():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 40))
    hf = DynamicCache(config=model.config)
    full = kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=hf)
        model(ids, past_key_values=full)
    hf_bytes = sum(t.numel() * t.element_size() for layer in hf.layers for t in (layer.keys, layer.values))
    assert full.nbytes() == hf_bytes  # under 256 tokens: no slack, and the positions are a run
    evicted = kvopt.cache("snapkv:budget=20,window=4", model)
    with torch.no_grad():
        model(ids, past_key_values=evicted)
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_layer = 20 * heads * (2 * dim * 4 + 4)  # K, V in fp32 and an int32 position per KV head
    assert evicted.nbytes() == per_layer * config.num_hidden_layers


def test_padding_materializes_validity_and_keeps_outputs_exact(model_pair):
    ids, mask = random_batch([9, 5])
    reference, ours = model_pair
    expected = reference(ids, attention_mask=mask, past_key_values=DynamicCache(config=reference.config)).logits
    cache = kvopt.cache("full", ours)
    got = ours(ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    assert (expected - got)[real].abs().max() <= 1e-5
    assert cache.layers[0].store.valid[1, 0].sum() == 5


@pytest.mark.parametrize("threads", [2, 4])
def test_split_kv_decoding_equals_one_pass_attention(threads, monkeypatch):
    monkeypatch.setattr(attention_math, "MIN_PIECE_TOKENS", 8)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert attention_math._kv_pieces(3, 64) == threads  # 3 KV heads cut so the pieces fill every thread
        gen = torch.Generator().manual_seed(2)
        query = torch.randn(1, 6, 1, 16, generator=gen)
        keys, values = torch.randn(1, 3, 64, 16, generator=gen), torch.randn(1, 3, 64, 16, generator=gen)
        fast = attention_math.attention_with_lse(query, keys, values, None, 0.25)
    finally:
        torch.set_num_threads(previous)
    slow = attention_math._explicit_attention_with_lse(query, keys, values, None, 0.25)
    assert torch.allclose(fast[0], slow[0], atol=1e-5) and torch.allclose(fast[1], slow[1], atol=1e-5)


def test_dequantizing_into_a_workspace_reuses_its_memory_and_equals_a_fresh_copy():
    from kvopt.cache.quantized import QuantizedKV

    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 2, 64, 16, generator=gen), torch.randn(1, 2, 64, 16, generator=gen)
    positions, valid = torch.arange(64).expand(1, 2, -1), torch.ones(1, 2, 64, dtype=torch.bool)
    stored = QuantizedKV.encode(keys, values, positions, valid, 4, 32)
    with torch.inference_mode():  # a buffer made here cannot be written outside: the modes keep their own
        inference = stored.dequantize(0, 64, torch.float32, into="test")
    first = stored.dequantize(0, 64, torch.float32, into="test")
    assert torch.equal(inference[0], first[0])
    pointers = [t.data_ptr() for t in first]
    fresh = stored.dequantize()
    assert all(torch.equal(a, b) for a, b in zip(first, fresh))
    again = stored.dequantize(32, 64, torch.float32, into="test")  # a smaller request: same memory
    assert [t.data_ptr() for t in again] == pointers
    assert torch.equal(again[0], fresh[0][:, :, 32:])


def test_quantized_attention_keeps_gradients_and_unpacks_transposed_codes():
    from kvopt.cache.quantized import QuantizedKV

    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 64, 2, 16, generator=gen).transpose(1, 2)  # HF's layout: not contiguous
    values = torch.randn(2, 64, 2, 16, generator=gen).transpose(1, 2)
    positions, valid = torch.arange(64).expand(2, 2, -1), torch.ones(2, 2, 64, dtype=torch.bool)
    stored = QuantizedKV.encode(keys, values, positions, valid, 4, 32)
    assert stored.dequantize()[0].shape == (2, 2, 64, 16)
    packed = quant.pack(torch.randint(0, 16, (8, 6, 4), generator=gen), 4, dim=0)
    transposed = packed.transpose(0, 1).contiguous().transpose(0, 1)  # dense, but not in row-major order
    assert torch.equal(quant.unpack(transposed, 4, dim=0), quant.unpack(packed, 4, dim=0))
    query = torch.randn(2, 4, 1, 16, generator=gen, requires_grad=True)
    output, _ = stored.attend(query, torch.tensor([64]), 0.25)
    output.sum().backward()  # each block's keys stay alive for autograd (no shared workspace)
    assert query.grad is not None and query.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("threads", "items", "tokens", "pieces"), [(2, 3, 4096, 2), (2, 4, 4096, 1), (3, 2, 2048, 4), (2, 3, 256, 1)]
)
def test_split_kv_pieces_even_out_the_threads(threads, items, tokens, pieces, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert attention_math._kv_pieces(items, tokens) == pieces


def test_a_store_presenting_other_keys_reads_them_with_its_own_values_and_masks():
    """What attention reads when methods present the stored keys otherwise (streamingllm re-rotates them)."""
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False
    store = DenseKVStore()
    store.append(keys, values, 0, valid)
    store.keep(torch.tensor([[[0, 2, 5, 6, 7, 9]]]).expand(2, 1, -1))  # explicit positions, padding kept
    presented = torch.randn(2, 2, 6, 8, generator=gen)
    view = store.presenting(presented)
    query, positions = torch.randn(2, 4, 2, 8, generator=gen), torch.tensor([6, 10])
    mask = attention_math.visibility(*store.mask_rows(), positions)
    expected = attention_math.attention_with_lse(query, presented, store.values, mask, 0.3)
    for got, want in zip(view.attend(query, positions, 0.3), expected):
        assert torch.equal(got, want)
    assert torch.equal(view.keys, presented) and torch.equal(store.keys, keys[:, :, [0, 2, 5, 6, 7, 9]])
    assert torch.equal(view.valid_counts(), store.valid_counts())
