"""mixedkv: salient tokens by normalized attention (slow reference), bytes between its bit widths."""

import copy
import math

import pytest
import torch

import kvopt
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods import parse

from tiny_models import VOCAB, tiny_model


def reference_high_positions(model, ids, residual, group, salient, probe) -> list[list[set[int]]]:
    """Per layer and KV head: positions stored in high bits after the prefill, by loops over eager attention."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    n = ids.shape[1]
    probes = max(1, math.ceil(probe * n))
    quantized = n // group * group
    high = round(salient * quantized / group) * group
    kv_heads = model.config.num_key_value_heads
    group_size = model.config.num_attention_heads // kv_heads
    result = []
    for weights in attentions:  # [1, H, n, n]
        per_head = []
        for kv in range(kv_heads):
            saliency = []
            for j in range(quantized):
                total = sum(
                    weights[0, kv * group_size + g, i, j].item() for g in range(group_size) for i in range(n - probes, n)
                ) / group_size
                seen_by = sum(1 for i in range(n - probes, n) if i >= j)
                saliency.append(total / seen_by)
            ranked = sorted(range(quantized), key=lambda j: -saliency[j])
            per_head.append(set(ranked[:high]))
        result.append(per_head)
    return result


def test_mixedkv_puts_the_reference_salient_tokens_in_high_bits():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(5))
    cache = kvopt.cache("mixedkv:high=8,low=2,salient=0.25,residual=24,group=16,probe=0.2", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    expected = reference_high_positions(model, ids, residual=24, group=16, salient=0.25, probe=0.2)
    for layer, heads in zip(cache.layers, expected):
        parts = {part.bits: part for part in layer.parts_of(QuantizedKV)}
        assert len(parts[8]) == 32 and len(parts[2]) == 80  # 112 quantized: 2 of 7 groups salient
        for head, positions in enumerate(heads):
            assert set(parts[8].positions[0, head].tolist()) == positions
            assert set(parts[2].positions[0, head].tolist()).isdisjoint(positions)


def test_mixedkv_holds_bytes_between_its_two_widths_and_reevaluates_while_decoding():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 300))
    held = {}
    for spec in ("kivi:bits=2,residual=32", "mixedkv:high=4,low=2,salient=0.25,residual=32", "kivi:bits=4,residual=32"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            for t in range(70):
                logits = model(torch.tensor([[5 + t]]), past_key_values=cache).logits
        assert torch.isfinite(logits).all()
        held[spec] = cache.nbytes()
    assert held["kivi:bits=2,residual=32"] < held["mixedkv:high=4,low=2,salient=0.25,residual=32"] < held["kivi:bits=4,residual=32"]
    layer = cache.layers[0]
    assert sum(len(p) for p in layer.parts_of(QuantizedKV)) + len(layer.store) == 370


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("mixedkv:high=2,low=4", "must exceed low"),
        ("mixedkv:salient=1.5", r"\[0, 1\]"),
        ("mixedkv:high=3", "high=3 is not supported"),
    ],
)
def test_bad_mixedkv_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)
