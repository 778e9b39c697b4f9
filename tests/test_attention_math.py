"""The one attention math module against slow, obviously right references: the mask, the block loop of coded
parts, soft-capped logits, the scale; and the one top-k/top-p filter both samplers use."""

import pytest
import torch

from kvopt.cache import attention_math, quantized
from kvopt.cache.attention_math import default_scale, grouped_logits, merge_with_lse, softmax_with_lse, visibility
from kvopt.cache.quantized import QuantizedKV
from kvopt.speculative.sampling import Sampler, filtered_probs


def slow_visibility(key_positions, key_valid, query_positions, window):
    """Query by query, key by key: valid, not in the future, and within the window."""
    batch, heads, tokens = key_positions.shape
    rows = query_positions if query_positions.ndim == 2 else query_positions.expand(batch, -1)
    mask = torch.zeros(batch, heads, rows.shape[1], tokens, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for q, query_position in enumerate(rows[b].tolist()):
                for t in range(tokens):
                    key_position = int(key_positions[b, h, t])
                    recent = window is None or query_position - key_position < window
                    seen = key_position <= query_position and recent
                    mask[b, h, q, t] = seen and (key_valid is None or bool(key_valid[b, h, t]))
    return mask


@pytest.mark.parametrize("window", [None, 3, 100])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("row_queries", [False, True])
def test_the_mask_equals_a_loop_over_queries_and_keys(window, padded, row_queries):
    gen = torch.Generator().manual_seed(0)
    # Per-head positions after head-wise eviction: sorted random subsets of 0..19.
    key_positions = torch.stack([torch.randperm(20, generator=gen)[:9].sort().values for _ in range(4)]).reshape(2, 2, 9)
    key_valid = torch.rand(2, 2, 9, generator=gen) > 0.3 if padded else None
    query_positions = torch.tensor([[5, 12, 19], [8, 9, 17]]) if row_queries else torch.tensor([4, 11, 19])
    mask = visibility(key_positions, key_valid, query_positions, window)
    assert torch.equal(mask.expand(2, 2, 3, 9), slow_visibility(key_positions, key_valid, query_positions, window))


def test_one_query_sees_every_older_key_without_a_mask_unless_padding_or_the_window_hides_some():
    key_positions = torch.arange(10).expand(1, 1, -1)
    query = torch.tensor([10])
    assert visibility(key_positions, None, query) is None
    assert visibility(key_positions, None, query, sliding_window=11) is None  # the window reaches the oldest key
    assert visibility(key_positions, None, query, sliding_window=4)[0, 0, 0].tolist() == [False] * 7 + [True] * 3
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    valid[..., 0] = False
    assert visibility(key_positions, valid, query)[0, 0, 0].tolist() == [False] + [True] * 9


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_grouped_logits_and_softmax_equal_per_head_loops(softcap):
    gen = torch.Generator().manual_seed(1)
    query, keys = torch.randn(2, 4, 3, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    mask = torch.rand(2, 2, 3, 5, generator=gen) > 0.3
    mask[1, 0, 2] = False  # a query that sees nothing: no weight, lse -inf
    scale = default_scale(query, None)
    assert scale == 8**-0.5 and default_scale(query, 0.3) == 0.3
    logits = grouped_logits(query, keys, scale, softcap).reshape(2, 2, 2, 3, 5)
    weights, lse = softmax_with_lse(query, keys, mask, None, softcap)
    weights, lse = weights.reshape(2, 2, 2, 3, 5), lse.reshape(2, 2, 2, 3)
    for b in range(2):
        for head in range(4):
            kv, g = divmod(head, 2)
            expected = query[b, head] @ keys[b, kv].T * scale
            if softcap is not None:
                expected = torch.tanh(expected / softcap) * softcap
            assert torch.allclose(logits[b, kv, g], expected, atol=1e-6)
            hidden = expected.masked_fill(~mask[b, kv], float("-inf"))
            assert torch.allclose(weights[b, kv, g], torch.softmax(hidden, -1).nan_to_num(0.0), atol=1e-6)
            assert torch.allclose(lse[b, kv, g], torch.logsumexp(hidden, -1), atol=1e-6)


def test_merging_parts_by_lse_equals_attention_over_their_union():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, 4, 2, 8, generator=gen)
    keys, values = torch.randn(1, 2, 30, 8, generator=gen), torch.randn(1, 2, 30, 8, generator=gen)
    whole = attention_math.attention_with_lse(query, keys, values, None, 0.3)
    cuts = [(0, 7), (7, 8), (8, 30)]
    parts = [attention_math.attention_with_lse(query, keys[:, :, a:b], values[:, :, a:b], None, 0.3) for a, b in cuts]
    merged = merge_with_lse(parts)
    assert torch.allclose(merged[0], whole[0], atol=1e-5) and torch.allclose(merged[1], whole[1], atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_causal_attention_over_a_chunk_s_own_keys_equals_a_loop_over_queries(softcap, tokens):
    """Query ``i`` over keys ``0..i`` one at a time, against the causal kernel (GQA: 4 heads over 2 KV heads)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, tokens, 16, generator=gen)
    keys, values = torch.randn(1, 2, tokens, 16, generator=gen), torch.randn(1, 2, tokens, 16, generator=gen)
    output, lse = attention_math.causal_attention_with_lse(query, keys, values, None, softcap)
    for i in range(tokens):
        row, row_lse = attention_math.attention_with_lse(query[:, :, i : i + 1], keys[:, :, : i + 1],
                                                         values[:, :, : i + 1], None, None, softcap)  # fmt: skip
        torch.testing.assert_close(output[:, :, i], row[:, :, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, :, i], row_lse[:, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("query_positions", [[64], [20, 40, 64]])
def test_coded_parts_attend_block_by_block_as_over_all_their_tokens_at_once(monkeypatch, softcap, query_positions):
    """The shared block loop (quantized and non-uniform parts): many blocks merge to one pass over the part."""
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 2, 64, 16, generator=gen), torch.randn(2, 2, 64, 16, generator=gen)
    positions = torch.arange(64, dtype=torch.int32).expand(2, 2, -1)
    valid = torch.ones(2, 2, 64, dtype=torch.bool)
    valid[1, :, :5] = False  # left padding
    part = QuantizedKV.encode(keys, values, positions, valid, 4, 16)
    query, at = torch.randn(2, 4, len(query_positions), 16, generator=gen), torch.tensor(query_positions)
    one_block = part.attend(query, at, 0.25, softcap)
    monkeypatch.setattr(quantized, "BLOCK_ELEMENTS", 2 * 2 * 16 * 16)  # 16 tokens a block: 4 blocks
    assert quantized.block_tokens(query.device, 2 * 2 * 16, 16) == 16
    blocks = part.attend(query, at, 0.25, softcap)
    dense_keys, dense_values = part.dequantize(dtype=torch.float32)
    expected = attention_math._explicit_attention_with_lse(
        query, dense_keys, dense_values, visibility(positions, valid, at), 0.25, softcap
    )
    for got in (one_block, blocks):
        assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.allclose(got[1], expected[1], atol=1e-5)


def slow_filter(logits, temperature, top_k, top_p):
    """Sort once, keep the top ``top_k``, then tokens while the mass before them is below ``top_p``; renormalise."""
    probs = torch.softmax(logits / temperature, -1)
    order = sorted(range(len(probs)), key=lambda token: -float(probs[token]))
    kept = order[:top_k] if top_k else order
    restricted = torch.softmax(logits[kept] / temperature, -1).tolist()
    chosen, mass = [], 0.0
    for token, p in zip(kept, restricted):
        if top_p is not None and mass >= top_p:
            break
        chosen.append(token)
        mass += p
    result = torch.zeros_like(probs)
    result[chosen] = torch.softmax(logits[chosen] / temperature, -1)
    return result


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.6),
                                                            (0.9, 4, 0.5), (1.0, 0, 1.0), (2.0, 50, 0.95)])  # fmt: skip
def test_one_top_k_top_p_filter_equals_a_sorted_loop_for_both_samplers(temperature, top_k, top_p):
    from kvopt.engine import sampler

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4)) * 2
    batched = filtered_probs(logits, temperature, top_k, top_p)
    for row in range(3):
        assert torch.allclose(batched[row], slow_filter(logits[row], temperature, top_k, top_p), atol=1e-6)
    assert torch.equal(Sampler(temperature, top_k or None, top_p).probs(logits), batched)
    assert sampler._filtered_probs is filtered_probs  # the engine's sampler filters with the same function
