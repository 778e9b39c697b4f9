"""Codec round trips: save -> load -> continue decoding equals never saving, for every kind of cache state."""

import pytest
import torch

import kvopt
from kvopt.cache.merged import MergedView
from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.ragged import RaggedKV
from kvopt.codec import cache_bytes, cache_from_bytes, decode_block, encode_block, model_fingerprint
from kvopt.codec.encodings import GROUP, _groups, decode, encode

PROMPT, BEFORE_SAVE, AFTER_SAVE = 160, 3, 8

SPECS = [
    "full", "window:size=48", "streamingllm:budget=40", "streamingllm:budget=40,rolling=always", "h2o:budget=40",
    "tova:budget=40", "snapkv:ratio=0.5", "adakv:ratio=0.5", "kvzip:ratio=0.5", "kivi:bits=4",
    "snapkv:ratio=0.5+kivi:bits=4", "minicache:start=0", "minicache:start=0+kivi:bits=4", "pyramidkv:ratio=0.5",
]  # fmt: skip


def greedy(model, cache, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Feed ``ids`` (all not yet cached), then ``steps`` greedy tokens one at a time: (tokens, last logits)."""
    tokens = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1]
        for _ in range(steps):
            tokens.append(int(logits.argmax(-1)))
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[:, -1]
    return tokens, logits


def prefilled(spec: str, model, tokenizer):
    """A cache of ``spec`` after a prompt and a few decoded tokens (decode-time state exists), and the next id."""
    ids = torch.randint(100, 5000, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        if cache.needs_prefill_pass:
            cache.prefill(model, ids[:, :-1], tokenizer=tokenizer)
            ids = ids[:, -1:]
    tokens, logits = greedy(model, cache, ids, BEFORE_SAVE)
    return cache, torch.tensor([[int(logits.argmax(-1))]])


@pytest.mark.parametrize("spec", SPECS)
def test_raw_round_trip_continues_exactly_as_never_saving(spec, tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    cache, following = prefilled(spec, model, tokenizer)
    data = cache_bytes(cache, model, "raw")
    loaded, _ = cache_from_bytes(data, model)
    assert cache_bytes(loaded, model, "raw") == data  # same tensors, positions, extras, parts, state
    assert loaded.spec == cache.spec and loaded.get_seq_length() == cache.get_seq_length()
    assert [stats.kept for stats in loaded.stats()] == [stats.kept for stats in cache.stats()]
    expected, expected_logits = greedy(model, cache, following, AFTER_SAVE)
    tokens, logits = greedy(model, loaded, following, AFTER_SAVE)
    assert tokens == expected
    assert torch.equal(logits, expected_logits)


@pytest.mark.parametrize(
    ("spec", "kind"), [("adakv:ratio=0.5", RaggedKV), ("kivi:bits=4", QuantizedKV), ("minicache:start=0", MergedView)]
)
def test_compact_parts_are_stored_as_they_are(spec, kind, tiny_with_tokenizer):
    """The round trip above covers these kinds only if the cache really holds them (and shares MiniCache's pair)."""
    model, tokenizer = tiny_with_tokenizer
    cache, _ = prefilled(spec, model, tokenizer)
    loaded, _ = cache_from_bytes(cache_bytes(cache, model, "cachegen"), model)
    held = [part for layer in loaded.layers for part in layer.parts_of(kind)]
    assert held
    if kind is QuantizedKV:  # packed codes kept bit for bit even by a lossy encoding
        original = [part for layer in cache.layers for part in layer.parts_of(kind)]
        assert all(torch.equal(a.keys.codes, b.keys.codes) for a, b in zip(original, held))
    if kind is MergedView:
        assert held[0].pair is held[1].pair


@pytest.mark.parametrize("encoding", ["raw", "int4"])
def test_per_head_positions_and_method_scores_are_kept_exactly(encoding, tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    per_head, _ = prefilled("snapkv:ratio=0.5", model, tokenizer)
    scored, _ = prefilled("h2o:budget=40", model, tokenizer)
    for cache in (per_head, scored):
        loaded, _ = cache_from_bytes(cache_bytes(cache, model, encoding), model)
        for before, after in zip(cache.layers, loaded.layers):
            assert after.store.heads_aligned == before.store.heads_aligned
            assert torch.equal(before.store.positions, after.store.positions)
            assert before.store.extras().keys() == after.store.extras().keys()
            assert all(torch.equal(before.store.extra(name), after.store.extra(name)) for name in before.store.extras())
    assert not per_head.layers[0].store.heads_aligned and scored.layers[0].store.has_extra("h2o")


def layer_keys(cache) -> torch.Tensor:
    return torch.cat([layer.store.keys.flatten() for layer in cache.layers] + [layer.store.values.flatten() for layer in cache.layers])


# The tiny model's head_dim of 8 makes per-token value parameters (fp16 scale and zero per 8 elements)
# weigh 4 bits per element: ratios here are higher than on real models (see benchmarks/codec.py).
@pytest.mark.parametrize(("encoding", "max_ratio", "max_error"), [("int8", 0.42, 0.01), ("int4", 0.28, 0.1), ("cachegen", 0.33, 0.05)])
def test_lossy_encodings_are_smaller_with_bounded_error(encoding, max_ratio, max_error, tiny_with_tokenizer):
    """Fractions of the raw fp32 file, and relative L2 error of the rebuilt keys and values."""
    model, tokenizer = tiny_with_tokenizer
    cache, following = prefilled("full", model, tokenizer)
    raw, lossy = cache_bytes(cache, model, "raw"), cache_bytes(cache, model, encoding)
    assert len(lossy) < max_ratio * len(raw)
    loaded, _ = cache_from_bytes(lossy, model)
    original, rebuilt = layer_keys(cache), layer_keys(loaded)
    assert (rebuilt - original).norm() / original.norm() < max_error
    tokens, _ = greedy(model, loaded, following, 2)  # it decodes on
    assert len(tokens) == 2


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("encoding", ["int8", "int4", "cachegen"])
def test_reconstruction_stays_within_half_a_quantization_step(encoding, role, smooth):
    """Per group, |x - x^| <= scale / 2 (plus fp16 rounding of the scale and zero); cachegen chains key
    deltas along tokens exactly when they compress smaller (keys that drift slowly, not noise)."""
    shape = (2, 3, 2 * GROUP + 5, 16)
    x = torch.randn(shape).mul(0.02).cumsum(dim=-2) if smooth else torch.randn(shape) * torch.linspace(0.1, 4, 16)
    descriptor, chunks = encode(x, encoding, role, depth=0.9)
    rebuilt = decode(descriptor, chunks)
    assert rebuilt.shape == x.shape and rebuilt.dtype == x.dtype
    assert descriptor["delta"] == (encoding == "cachegen" and role == "key" and smooth)
    axis = -2 if role == "key" else -1
    grouped, error = _groups(x, role), _groups(rebuilt - x, role)
    step = (grouped.amax(dim=axis, keepdim=True) - grouped.amin(dim=axis, keepdim=True)) / ((1 << descriptor["bits"]) - 1)
    assert (error.abs() <= step * 0.5 + 1e-2 * grouped.abs().amax(dim=axis, keepdim=True)).all()


def test_lossless_tensors_and_bfloat16_survive_every_encoding():
    values = torch.randn(1, 2, 70, 8, dtype=torch.bfloat16)
    positions = torch.randperm(70, dtype=torch.int32)
    for encoding in ("raw", "int8", "int4", "cachegen"):
        descriptor, chunks = encode(positions, encoding, None, 0.0)
        assert torch.equal(decode(descriptor, chunks), positions)
    descriptor, chunks = encode(values, "raw", "value", 0.0)
    assert torch.equal(decode(descriptor, chunks), values)
    descriptor, chunks = encode(values, "cachegen", "key", 0.0)
    rebuilt = decode(descriptor, chunks)
    assert rebuilt.dtype == torch.bfloat16 and (rebuilt.float() - values.float()).norm() < 0.05 * values.float().norm()


def test_blocks_round_trip_and_refuse_another_model(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    layers = [(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)) for _ in range(3)]
    fingerprint = model_fingerprint(model)
    data = encode_block(layers, fingerprint, "raw", meta={"hash": "abc", "tokens": [1, 2]})
    decoded, meta = decode_block(data, fingerprint)
    assert meta == {"hash": "abc", "tokens": [1, 2]}
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(layers, decoded))
    with pytest.raises(kvopt.codec.CacheModelMismatchError):
        decode_block(data, {**fingerprint, "weights": "0" * 32})


@pytest.mark.parametrize("spec", ["full", "snapkv:ratio=0.5", "kivi:bits=4"])
def test_a_padded_batch_round_trips_with_its_padding_bits(spec, tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (2, 140), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    data = cache_bytes(cache, model, "raw")
    loaded, _ = cache_from_bytes(data, model)
    assert cache_bytes(loaded, model, "raw") == data
    assert not loaded.layers[0].store.all_valid or loaded.layers[0].parts  # the padding bits came back
    step, longer = torch.tensor([[7], [9]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        expected = model(step, attention_mask=longer, past_key_values=cache).logits
        logits = model(step, attention_mask=longer, past_key_values=loaded).logits
    assert torch.equal(logits, expected)
