"""The storage-part interface: every kind attends like a slow softmax over its own tokens, and a
layer's bytes and kept tokens are the sums over its parts."""

import pytest
import torch
from conftest import random_batch
from transformers import LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.cache.layer import KVLayer
from kvopt.cache.merged import MergedPair, MergedView, PlainKV
from kvopt.cache.part import KVPart
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.ragged import RaggedKV
from kvopt.cache.storage import DenseKVStore
from tiny_models import VOCAB

BATCH, KV_HEADS, QUERY_HEADS, TOKENS, DIM = 2, 2, 4, 64, 16
SCALE = 0.25


def reference_attention(query, keys, values, visible, scaling, softcap=None):
    """Explicit fp32 softmax; ``keys/values [B, H_kv, T, D]``, ``visible [B, H_kv, q, T]``. Returns (out, lse)."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = query.float() @ keys.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible.repeat_interleave(group, 1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values, lse


def sample_tokens(seed: int = 0):
    """Keys/values ``[B, H, T, D]``, positions ``0..T-1`` and validity with row 1 left-padded."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(BATCH, KV_HEADS, TOKENS, DIM, generator=gen), torch.randn(BATCH, KV_HEADS, TOKENS, DIM, generator=gen)
    positions = torch.arange(TOKENS, dtype=torch.int32).expand(BATCH, KV_HEADS, -1).clone()
    valid = torch.ones(BATCH, KV_HEADS, TOKENS, dtype=torch.bool)
    valid[1, :, :10] = False
    return keys, values, positions, valid


def visibility(positions, valid, query_positions):
    return (positions[:, :, None, :] <= query_positions[None, None, :, None]) & valid[:, :, None, :]


def dense_part():
    keys, values, positions, valid = sample_tokens()
    store = DenseKVStore()
    store.append(keys, values, 0, valid[:, 0])
    kept = torch.stack([torch.arange(0, TOKENS, 2), torch.arange(1, TOKENS, 2)])  # heads keep different slots
    store.keep(kept[None].expand(BATCH, -1, -1))
    return store, (store.keys, store.values, store.positions, store.valid)


def ragged_part():
    keys, values, positions, valid = sample_tokens(1)
    lengths = [[20, 7], [0, 31]]  # one segment empty; row 1 keeps none of its padding
    selected = [torch.arange(TOKENS - n, TOKENS) for row in lengths for n in row]
    part = RaggedKV.gather(keys, values, positions, selected)
    in_part = torch.zeros(BATCH, KV_HEADS, TOKENS, dtype=torch.bool)
    for segment, index in enumerate(selected):
        in_part[segment // KV_HEADS, segment % KV_HEADS, index] = True
    return part, (keys, values, positions, in_part)


def quantized_part():
    keys, values, positions, valid = sample_tokens(2)
    part = QuantizedKV.encode(keys, values, positions, valid, 4, 32)
    dense_keys, dense_values = part.dequantize()
    return part, (dense_keys, dense_values, positions, valid)


def merged_part():
    keys, values, positions, valid = sample_tokens(3)
    norms = lambda x: x.norm(dim=-1)  # noqa: E731
    direction = PlainKV(keys / norms(keys)[..., None], values / norms(values)[..., None], TokenIndex.of(positions, valid))
    magnitudes = torch.stack([torch.stack([norms(keys), norms(values)]), torch.stack([norms(keys), norms(values)]) * 2])
    retained_index = torch.tensor([3, 40], dtype=torch.int32).expand(BATCH, KV_HEADS, -1)
    retained = torch.randn(2, 2, BATCH, KV_HEADS, 2, DIM, generator=torch.Generator().manual_seed(4))
    view = MergedView(MergedPair(direction, magnitudes, retained_index, retained, torch.float32), role=1)
    return view, (*view.layer_kv(), positions, valid)


PARTS = {"dense": dense_part, "ragged": ragged_part, "quantized": quantized_part, "merged": merged_part}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("kind", sorted(PARTS))
def test_every_part_attends_like_a_softmax_over_its_own_tokens(kind, softcap):
    part, (keys, values, positions, visible_slots) = PARTS[kind]()
    assert isinstance(part, KVPart)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(BATCH, QUERY_HEADS, 3, DIM, generator=gen)
    query_positions = torch.tensor([30, 50, TOKENS])  # the first query sees only part of the tokens
    output, lse = part.attend(query, query_positions, SCALE, softcap)
    expected, expected_lse = reference_attention(
        query, keys, values, visibility(positions, visible_slots, query_positions), SCALE, softcap
    )
    assert (output - expected).abs().max().item() <= 1e-5
    assert torch.equal(lse.isinf(), expected_lse.isinf())  # a query that sees nothing weighs nothing when merged
    finite = expected_lse.isfinite()
    assert (lse[finite] - expected_lse[finite]).abs().max().item() <= 1e-5
    counts = part.valid_counts()
    assert counts.shape == (BATCH,) and counts.tolist() == visible_slots[:, 0].sum(-1).tolist()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("kind", ["dense", "ragged"])
def test_head_wise_parts_attend_within_a_sliding_window(kind, softcap):
    """The dense store and a ragged prefix hide keys ``window`` or more positions older than a query, as the
    dense path does for sliding layers (what lets head-wise budgets run on Mistral and Gemma 2)."""
    part, (keys, values, positions, visible_slots) = PARTS[kind]()
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(BATCH, QUERY_HEADS, 3, DIM, generator=gen)
    query_positions, window = torch.tensor([30, 50, TOKENS]), 12
    output, lse = part.attend(query, query_positions, SCALE, softcap, sliding_window=window)
    recent = query_positions[None, None, :, None] - positions[:, :, None, :] < window
    visible = visibility(positions, visible_slots, query_positions) & recent
    expected, expected_lse = reference_attention(query, keys, values, visible, SCALE, softcap)
    assert (output - expected).abs().max().item() <= 1e-5
    assert torch.equal(lse.isinf(), expected_lse.isinf())
    finite = expected_lse.isfinite()
    assert (lse[finite] - expected_lse[finite]).abs().max().item() <= 1e-5
    windowless, _ = part.attend(query, query_positions, SCALE, softcap)
    assert (windowless - output).abs().max().item() > 1e-3  # the window hid keys that matter


def test_a_layer_reads_its_parts_in_their_fixed_order_whatever_the_order_they_came_in():
    layer = KVLayer(methods=[])
    made = [merged_part()[0], quantized_part()[0], ragged_part()[0], quantized_part()[0]]
    for part in made:
        layer.add_part(part)
    assert [type(part) for part in layer.parts] == [RaggedKV, QuantizedKV, QuantizedKV, MergedView]
    assert layer.parts_of(QuantizedKV) == [made[1], made[3]]


def six_layer_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("spec", "kinds"),
    [
        ("adakv:ratio=0.5,window=8", {RaggedKV}),
        ("minicache:start=0.3,residual=16+kivi:bits=2,group=16,residual=32", {MergedView, QuantizedKV}),
        ("mixedkv:group=16,residual=32", {QuantizedKV}),
        ("window:ratio=0.5+minicache:start=0.3", {MergedView}),
    ],
)
def test_layer_bytes_and_kept_tokens_are_the_sums_over_its_parts(spec, kinds):
    model = six_layer_model()
    ids, mask = random_batch([150, 111])
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        for step in range(40):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            model(torch.tensor([[5 + step], [9 + step]]), attention_mask=mask, past_key_values=cache)
    held_kinds = set()
    for layer, stats in zip(cache.layers, cache.stats()):
        held = (layer.store, *layer.parts)
        held_kinds.update(type(part) for part in layer.parts)
        assert layer.nbytes() == sum(part.nbytes() for part in held) == stats.nbytes
        kept = sum(part.valid_counts() for part in held if part.valid_counts().numel())
        assert kept.tolist() == layer.kept_per_row().tolist() and int(kept.sum()) == stats.kept
    assert cache.nbytes() == sum(stats.nbytes for stats in cache.stats())
    assert held_kinds == kinds
    for layer in cache.layers:  # a merged pair's bytes are counted once, split between its two layers
        for view in layer.parts_of(MergedView):
            (other,) = cache.layers[layer.index + (1 if view.role == 0 else -1)].parts_of(MergedView)
            assert other.pair is view.pair and view.nbytes() + other.nbytes() == view.pair.nbytes()
