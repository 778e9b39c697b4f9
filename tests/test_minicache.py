"""minicache: SLERP merge against a slow reference, exact retained tokens, reads equal HF on the
reconstructed tensors, real savings, composition with kivi, theoretical size."""

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.cache.merged import MergedView, slerp_merge
from kvopt.errors import MethodParameterError
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.methods.base import LayerContext
from kvopt.models.info import ModelInfo

from tiny_models import VOCAB


def six_layer_model(head_dim: int = 64):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_slerp_matches_a_per_token_reference():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 5, 8, generator=generator), torch.randn(2, 3, 5, 8, generator=generator)
    direction, norm_a, norm_b, angle = slerp_merge(a, b, 0.6)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(5)).tolist():
        x, y = a[tuple(index)].tolist(), b[tuple(index)].tolist()
        mx, my = math.sqrt(sum(v * v for v in x)), math.sqrt(sum(v * v for v in y))
        ux, uy = [v / mx for v in x], [v / my for v in y]
        omega = math.acos(max(-1.0, min(1.0, sum(p * q for p, q in zip(ux, uy)))))
        e = [math.sin(0.4 * omega) / math.sin(omega) * p + math.sin(0.6 * omega) / math.sin(omega) * q for p, q in zip(ux, uy)]
        norm = math.sqrt(sum(v * v for v in e))
        assert torch.allclose(direction[tuple(index)], torch.tensor([v / norm for v in e]), atol=1e-5)
        assert abs(norm_a[tuple(index)].item() - mx) < 1e-5 and abs(angle[tuple(index)].item() - omega / math.pi) < 1e-5


def test_parallel_vectors_merge_losslessly():
    a = torch.randn(1, 1, 4, 8)
    direction, norm_a, norm_b, angle = slerp_merge(a, 3 * a, 0.6)
    assert torch.allclose(direction * norm_b[..., None], 3 * a, atol=1e-5) and (angle < 1e-3).all()


def effective_kv(cache) -> DynamicCache:
    """What each kvopt layer attends over (merged tokens reconstructed, in position order), as an HF cache."""
    dynamic = DynamicCache()
    for index, layer in enumerate(cache.layers):
        keys, values = layer.store.keys, layer.store.values
        for view in layer.parts_of(MergedView):
            merged_keys, merged_values = view.layer_kv()
            keys, values = torch.cat([merged_keys, keys], 2), torch.cat([merged_values, values], 2)
        dynamic.update(keys, values, index)
    return dynamic


def test_merged_layers_read_exactly_their_reconstruction_and_retained_tokens_stay_exact():
    model = six_layer_model()
    ids = torch.randint(3, VOCAB, (1, 200))
    full, cache = kvopt.cache("full", model), kvopt.cache("minicache:retain=0.1", model)
    with torch.no_grad():
        model(ids, past_key_values=full)
        model(ids, past_key_values=cache)
    for layer, reference in zip(cache.layers, full.layers):
        for view in layer.parts_of(MergedView):
            keys, _ = view.layer_kv()
            slots = view.pair.retained_index[0, 0].long()
            assert len(slots) == 20
            assert torch.allclose(keys[0, 0, slots], reference.store.keys[0, 0, slots])
    reference_model = six_layer_model()
    token = torch.tensor([[7]])
    with torch.no_grad():
        expected = reference_model(token, past_key_values=effective_kv(cache), position_ids=torch.tensor([[200]])).logits
        got = model(token, past_key_values=cache).logits
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("spec", ["minicache", "minicache:retain=0.2,start=0.3"])
def test_minicache_frees_memory_and_matches_its_theoretical_size(spec):
    model = six_layer_model()
    ids = torch.randint(3, VOCAB, (1, 1000))
    full, cache = kvopt.cache("full", model), kvopt.cache(spec, model)
    with torch.no_grad():
        model(ids, past_key_values=full)
        model(ids, past_key_values=cache)
    assert cache.nbytes() < full.nbytes()
    merged = [layer for layer in cache.layers if layer.parts_of(MergedView)]
    assert merged and all(len(layer.store) == 0 and len(layer.parts_of(MergedView)[0].pair) == 1000 for layer in merged)
    (method,) = cache.methods
    info = ModelInfo.from_config(model.config)
    for layer in merged:  # the merged layers hold what the theoretical size says (unmerged ones are `full`)
        context = LayerContext(layer.index, (method,), per_head=False)
        assert abs(layer.nbytes() / method.layer_bytes(1000, info, 4, context) - 1) <= 0.02
    theoretical = estimate(info, 1000, methods=parse(spec), dtype=torch.float32).total_bytes
    assert theoretical < estimate(info, 1000, dtype=torch.float32).total_bytes


def test_minicache_composes_with_kivi_and_keeps_merging_while_decoding():
    model = six_layer_model()
    ids = torch.randint(3, VOCAB, (1, 300))
    held = {}
    for spec in ("minicache", "kivi:bits=4", "minicache+kivi:bits=4"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            for step in range(40):
                logits = model(torch.tensor([[5 + step]]), past_key_values=cache).logits
        assert torch.isfinite(logits).all()
        held[spec] = cache.nbytes()
    assert held["minicache+kivi:bits=4"] < held["kivi:bits=4"] < held["minicache"]
    (view,) = next(layer.parts_of(MergedView) for layer in cache.layers if layer.parts_of(MergedView))
    assert len(view.pair) == 320 and type(view.pair.direction).__name__ == "QuantizedKV"  # 340 = 10 groups + 20


@pytest.mark.parametrize(
    "spec, fragment",
    [("minicache:t=1.5", r"\(0, 1\)"), ("minicache:start=1", r"\[0, 1\)"), ("minicache:retain=1", r"outside \(0, 1\)")],
)
def test_bad_minicache_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)


def test_minicache_needs_a_layer_pair():
    model = six_layer_model()
    with pytest.raises(MethodParameterError, match="lower start"):
        kvopt.cache("minicache:start=0.95", model)
