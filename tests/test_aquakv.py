"""aquakv: cross-layer predictors over kvquant's codes: a slow reference of the chain, bytes, batches, composition."""

import pytest
import torch
from test_kvquant import fitted
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt.cache import prerope, quantized
from kvopt.cache.crosslayer import product_dtype
from kvopt.cache.nonuniform import NonUniformKV, decode_keys, decode_values, encode_keys, encode_values
from kvopt.errors import MethodParameterError
from kvopt.methods import parse
from kvopt.methods.recording import record_prefill

SMALL = "aquakv:bits=2,residual=16,group=16,calibration=96"


def slow_affine(weight: torch.Tensor, inputs: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Obviously right: per token, the heads of every input concatenated, times the weight (both rounded to
    ``dtype``, the sum in fp32 rounded to it too), plus the bias row."""
    heads, tokens, dim = inputs[0].shape
    rounded = lambda x: x.to(dtype).float()  # noqa: E731
    out = torch.empty(weight.shape[1] // dim, tokens, dim)
    for t in range(tokens):
        features = torch.cat([x[h, t] for x in inputs for h in range(x.shape[0])])
        out[:, t] = (rounded(rounded(features) @ rounded(weight[:-1])) + weight[-1]).reshape(-1, dim)
    return out


def reference_reconstruction(method, model, post_keys: list, values: list, first: int, group: int) -> list:
    """Per layer, the keys (post-RoPE) and values a decoder rebuilds for tokens ``first:`` of one sequence,
    computed layer after layer from scratch: un-rotate, predict from the layer below's reconstruction,
    quantize the residual (kvquant's quantizer, tested on its own), add the prediction back, rotate."""
    out, below = [], None
    for layer, (keys, vals) in enumerate(zip(post_keys, values)):
        positions = torch.arange(first, first + keys.shape[1], dtype=torch.int32)[None, None]
        table = prerope.RopeTable(prerope.rope_inv_freq(model.config, layer, keys.shape[-1]))
        pre = prerope.rotate(prerope.to_pairs(keys[None], table), positions, table, inverse=True)[0]
        predictor = method.predictors[layer]
        codec = method.residual_codecs[layer] if predictor is not None else method.codecs[layer]
        predicted_keys = (torch.zeros_like(pre) if predictor is None
                          else slow_affine(predictor.key_weight, [below], product_dtype(below.device)))  # fmt: skip
        rebuilt_keys = predicted_keys + decode_keys(encode_keys((pre - predicted_keys)[None], codec, group), codec)[0]
        predicted_values = (torch.zeros_like(vals) if predictor is None
                            else slow_affine(predictor.value_weight, [rebuilt_keys, below]))  # fmt: skip
        residual = encode_values((vals - predicted_values)[None], codec)
        rebuilt_values = predicted_values + decode_values(residual, codec)[0]
        below = rebuilt_keys
        out.append((prerope.from_pairs(prerope.rotate(rebuilt_keys[None], positions, table), table)[0], rebuilt_values))
    return out


@pytest.mark.parametrize("block_elements", [None, 1], ids=["one-block", "group-sized-blocks"])
def test_the_chain_matches_a_slow_layer_by_layer_reference_through_decoding(monkeypatch, block_elements):
    """After a prefill and 40 decoded tokens (two more groups quantized), every layer's quantized tokens equal the
    slow reference's rebuilt from the vectors each layer was given, and attention over the codes (the chain
    kept between layers, blocks, rotation in pair order, predicted values applied to attention-weighted sums
    of keys) gives the logits of a lossless cache holding them."""
    if block_elements is not None:
        monkeypatch.setattr(quantized, "BLOCK_ELEMENTS", block_elements)
    model = tiny_model("llama")
    method = fitted(SMALL, model)[0]
    given: dict[int, list] = {}  # per layer: the post-RoPE keys and values handed to the quantizer, in order
    encode = NonUniformKV.encode.__func__

    def spy(cls, keys, values, index, codec, *args, **kwargs):
        layer = next(i for i, c in enumerate(method.codecs + method.residual_codecs) if c is codec) % len(method.codecs)
        given.setdefault(layer, []).append((keys[0].clone(), values[0].clone()))
        return encode(cls, keys, values, index, codec, *args, **kwargs)

    monkeypatch.setattr(NonUniformKV, "encode", classmethod(spy))
    ids = torch.randint(3, VOCAB, (1, 140), generator=torch.Generator().manual_seed(3))
    cache = kvopt.cache([method], model)
    with torch.no_grad():
        model(ids[:, :100], past_key_values=cache)
        for t in range(100, 140):
            model(ids[:, t : t + 1], past_key_values=cache)
    parts = [layer.parts_of(NonUniformKV)[0] for layer in cache.layers]
    assert all(part.predictor is not None for part in parts[1:]) and parts[0].predictor is None
    assert len(parts[0]) == 128  # 4 sinks, 96 + 2 x 16 quantized, 8 in full precision
    inputs = [[torch.cat(pieces, dim=1) for pieces in zip(*given[layer])] for layer in range(len(parts))]
    expected = reference_reconstruction(method, model, *zip(*inputs), method.sinks, method.group)
    lossless = kvopt.cache("full", model)
    for part, (keys, values), layer, copy in zip(parts, expected, cache.layers, lossless.layers):
        got_keys, got_values = part.dequantize()
        for got, want in ((got_keys[0], keys), (got_values[0], values)):
            # The reference sums in another order: a value within float error of a rounding boundary (a range
            # end's 8-bit code, a level) may round the other way; anything else is the same.
            assert torch.isclose(got, want, atol=1e-4, rtol=1e-4).float().mean() > 0.998
            assert (got - want).abs().max() < 0.05
        assert part.memo is None  # nothing kept between forward passes
        sinks, rest = part.sinks, layer.store
        copy.store.append(torch.cat([sinks.keys, got_keys, rest.keys], dim=2),
                          torch.cat([sinks.values, got_values, rest.values], dim=2), 0, None)  # fmt: skip
        copy.seen, copy.seen_real, copy.is_initialized = 140, 140, True
        copy.dtype, copy.device = layer.dtype, layer.device
    with torch.no_grad():
        step = torch.tensor([[7]])
        got = model(step, past_key_values=cache).logits
        want = model(step, past_key_values=lossless).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_stored_bytes_drop_and_equal_kvquants():
    """Predictors are per model: a token takes exactly kvquant's bytes, and far fewer than full precision."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 200))
    held = {}
    for spec in ("full", SMALL, SMALL.replace("aquakv", "kvquant")):
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        held[spec] = cache.nbytes()
    assert held[SMALL] == held[SMALL.replace("aquakv", "kvquant")] < held["full"] / 3
    method = fitted(SMALL, model)[0]
    predictor_bytes = sum(p.nbytes() for p in method.predictors if p is not None)
    assert method.model_bytes() > predictor_bytes > 0


def test_predicted_residuals_are_smaller_than_kvquants_errors_on_correlated_layers():
    """On a model whose layers share their key and value projections, the layer below predicts most of each
    layer: aquakv's reconstruction error is well below kvquant's at the same bytes."""
    model = tiny_model("llama")
    for layer in model.model.layers[1:]:
        layer.self_attn.k_proj.weight.data = model.model.layers[0].self_attn.k_proj.weight.data * 1.1
        layer.self_attn.v_proj.weight.data = model.model.layers[0].self_attn.v_proj.weight.data * 0.9
    ids = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(5))
    reference, _ = record_prefill(model, ids)
    errors = {}
    for spec in (SMALL, SMALL.replace("aquakv", "kvquant")):
        cache = kvopt.cache(fitted(spec, model), model)
        cache.replay_prefill(reference)
        part = cache.layers[2].parts_of(NonUniformKV)[0]
        keys, values = part.dequantize()
        exact = reference.layers[2].store
        first = len(part.sinks.index.positions[0, 0])
        errors[spec] = sum(((got - want[:, :, first : first + len(part)]).norm() / want.norm()).item()
                           for got, want in ((keys, exact.keys), (values, exact.values)))  # fmt: skip
    assert errors[SMALL] < 0.7 * errors[SMALL.replace("aquakv", "kvquant")]


@pytest.mark.parametrize("eviction, predicted", [("window:ratio=0.5", True), ("snapkv:ratio=0.5", False)])
def test_composes_with_prefill_eviction(eviction, predicted):
    """Eviction that keeps the same tokens in every layer keeps the prediction; one that chooses per layer and
    head leaves each layer's codes holding its own vectors. Both free memory and decode."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 200))
    held = {}
    for spec in (eviction, f"{eviction}+{SMALL}"):
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            for t in range(20):
                logits = model(torch.tensor([[7 + t]]), past_key_values=cache).logits
        assert torch.isfinite(logits).all() and cache.layers[0].kept_per_row().tolist() == [120]
        held[spec] = cache.nbytes()
    assert held[f"{eviction}+{SMALL}"] < held[eviction] / 2
    parts = [layer.parts_of(NonUniformKV)[0] for layer in cache.layers]
    assert all((part.predictor is not None) == predicted for part in parts[1:])


def test_calibration_state_round_trips():
    """What is cached per model (codecs, residual codecs, predictors) rebuilds a method that stores the same codes."""
    model = tiny_model("llama")
    trained = fitted(SMALL, model)[0]
    loaded = parse(SMALL)[0]
    loaded.load_calibration(trained.calibration_state())
    ids = torch.randint(3, VOCAB, (1, 80))
    parts = []
    for method in (trained, loaded):
        cache = kvopt.cache([method], model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        parts.append(cache.layers[2].parts_of(NonUniformKV)[0])
    assert torch.equal(parts[0].keys.codes, parts[1].keys.codes)
    assert torch.equal(parts[0].values.codes, parts[1].values.codes)


def test_bad_parameters_say_what_to_do():
    with pytest.raises(MethodParameterError, match="ridge=-1.0 must be >= 0"):
        parse("aquakv:ridge=-1")
    with pytest.raises(MethodParameterError, match="keep one of the two"):
        parse("aquakv+kvquant")


def test_attention_over_predicted_values_equals_the_predictor_applied_to_weighted_key_sums():
    """Attention is linear in the values: with values = residual + [keys, source keys, 1] @ W, attending over the
    residual and mapping the attention-weighted key sums by W gives attention over the rebuilt values (GQA
    groups, several queries, a mask)."""
    from kvopt.cache.attention_math import _explicit_attention_with_lse, attention_with_shared_sums
    from kvopt.cache.crosslayer import LayerPredictor

    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, source_heads, group, queries, tokens, dim = 2, 2, 3, 3, 4, 10, 8
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    keys, residual = randn(batch, kv_heads, tokens, dim), randn(batch, kv_heads, tokens, dim)
    source_keys = randn(batch, source_heads, tokens, dim)
    predictor = LayerPredictor(torch.empty(0), randn((kv_heads + source_heads) * dim + 1, kv_heads * dim))
    query = randn(batch, kv_heads * group, queries, dim)
    mask = torch.rand(batch, 1, queries, tokens, generator=generator) > 0.3
    mask[..., 0] = True
    values = predictor.values(keys, source_keys, out=residual.clone())
    want, want_lse = _explicit_attention_with_lse(query, keys, values, mask, 0.3)
    output, sums, lse = attention_with_shared_sums(query, keys, residual, [keys, source_keys], mask, 0.3)
    torch.testing.assert_close(output + predictor.fold_values(sums, kv_heads), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)
