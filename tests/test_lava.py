"""lava: value-weighted scores, entropy layer budgets and Ada-KV head budgets against a slow reference;
ragged bytes that follow both budgets; batches; the layer split's arithmetic."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from conftest import random_batch
from test_adakv import reference_allocation
from test_eviction_prefill import Probe, pool, window_scores
from tiny_models import tiny_model

import kvopt
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import MethodParameterError
from kvopt.methods import parse
from kvopt.methods.lava import entropy, layer_shares


class ValueProbe(Probe):
    """The prefill probe of the SnapKV tests, keeping each layer's values too."""

    def after_attention(self, layer, step) -> None:
        super().after_attention(layer, step)
        self.records[step.module.layer_idx][-1]["values"] = layer.store.values.double().clone()


def reference_shares(entropies: list[float], per_layer: int, available: int) -> list[int]:
    """Exact fractions: water-filling of ``per_layer x L`` in proportion to the entropies, capped at ``available``,
    then floors plus one for the largest remainders."""
    total = min(per_layer, available) * len(entropies)
    shares: dict[int, Fraction] = {}
    while len(shares) < len(entropies):
        rest = [i for i in range(len(entropies)) if i not in shares]
        left = total - sum(shares.values())
        mass = sum(Fraction(entropies[i]) for i in rest)
        ideal = {i: left * Fraction(entropies[i]) / mass for i in rest}
        capped = [i for i in rest if ideal[i] >= available]
        shares.update({i: Fraction(available) for i in capped} if capped else ideal)
    floors = {i: math.floor(share) for i, share in shares.items()}
    for i in sorted(shares, key=lambda i: floors[i] - shares[i])[: total - sum(floors.values())]:
        floors[i] += 1
    return [floors[i] for i in range(len(entropies))]


def reference_lava(probe, ratio: float, window: int, kernel: int, alpha: float) -> list[list[list[int]]]:
    """Per layer, per (row, head) segment: the positions LAVa keeps, from loops over rows, heads and tokens."""
    snaps = [probe.records[index][0] for index in sorted(probe.records)]
    batch, kv_heads = len(snaps[0]["valid"]), len(snaps[0]["valid"][0])
    weighted, targets, recents = [], [], []
    for snap in snaps:
        raw = window_scores(snap, window)
        layer_scores = torch.zeros(batch, kv_heads, len(snap["valid"][0][0]), dtype=torch.float64)
        for row in range(batch):
            real = [slot for slot, ok in enumerate(snap["valid"][row][0]) if ok]
            target = max(1, int(len(real) * (1 - ratio)))
            recent = min(window, target, len(real))
            prefix = real[: len(real) - recent]
            for head in range(kv_heads):
                bound = max(float(snap["values"][row, head, slot].abs().sum()) for slot in prefix)
                layer_scores[row, head] = torch.tensor(pool(raw[row][head], kernel, "avg")) * bound
            if len(weighted) == 0:
                targets.append(target)
                recents.append(recent)
        weighted.append(layer_scores)
    kept = [[] for _ in snaps]
    valid = torch.tensor(snaps[0]["valid"])
    for row in range(batch):
        real = [slot for slot, ok in enumerate(snaps[0]["valid"][row][0]) if ok]
        prefix = real[: len(real) - recents[row]]
        entropies = []
        for scores in weighted:
            mass = [float(scores[row, head, slot]) for head in range(kv_heads) for slot in prefix]
            entropies.append(-sum(m / sum(mass) * math.log(m / sum(mass)) for m in mass if m > 0) / math.log(len(mass)))
        shares = reference_shares(entropies, targets[row] - recents[row], len(prefix))
        for index, scores in enumerate(weighted):
            layer_targets = torch.tensor([shares[index] + recents[row]] * batch)
            selected = reference_allocation(scores[row : row + 1], valid[row : row + 1], layer_targets, window, alpha)
            positions = snaps[index]["positions"][row]
            kept[index].extend([[positions[head][slot] for slot in slots] for head, slots in enumerate(selected)])
    return kept


def segments(layer) -> list[list[int]]:
    (part,) = layer.parts_of(RaggedKV)
    bounds = part.offsets.tolist()
    return [part.positions[a:b].tolist() for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("ratio, alpha", [(0.5, 0.2), (0.75, 0.0), (0.6, 1.0)])
def test_lava_matches_the_slow_reference(ratio, alpha):
    model = tiny_model("llama")
    with torch.no_grad():  # layers attend ever more sharply: their scores' entropies (and budgets) differ
        for sharpness, block in zip((1.0, 6.0, 20.0), model.model.layers):
            block.self_attn.q_proj.weight.mul_(sharpness)
            block.self_attn.k_proj.weight.mul_(sharpness)
    ids, mask = random_batch([90, 61], seed=3)
    probe = ValueProbe()
    cache = kvopt.cache([probe, *parse(f"lava:ratio={ratio},window=6,kernel=5,pooling=avg,alpha={alpha}")], model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    expected = reference_lava(probe, ratio, window=6, kernel=5, alpha=alpha)
    for layer, reference in zip(cache.layers, expected):
        assert segments(layer) == reference
        assert not len(layer.store)
    per_layer = [sum(len(s) for s in segments(layer)[:2]) for layer in cache.layers]  # row 0, both KV heads
    assert len(set(per_layer)) > 1  # layer budgets really differ
    assert abs(sum(per_layer) - 3 * 2 * int(90 * (1 - ratio))) <= 3  # same total as uniform (head rounding)


def test_layer_shares_are_proportional_capped_and_exact():
    for entropies, per_layer, available in [
        ([0.9, 0.5, 0.7], 40, 100), ([0.99, 0.2, 0.2, 0.2], 60, 90), ([0.5, 0.5], 30, 30), ([0.3, 0.0], 7, 20),
    ]:  # fmt: skip
        shares = layer_shares(entropies, per_layer, available)
        assert shares == reference_shares([max(e, 1e-12) for e in entropies], per_layer, available)
        assert sum(shares) == min(per_layer, available) * len(entropies) and max(shares) <= available
    assert layer_shares([0.9, 0.5, 0.7], 40, 100) == [51, 29, 40]  # 120 x (0.9, 0.5, 0.7) / 2.1
    assert layer_shares([0.99, 0.2, 0.2, 0.2], 60, 90) == [90, 50, 50, 50]  # the capped surplus goes to the others


def test_entropy_is_normalised():
    assert entropy(torch.ones(3, 10)) == pytest.approx(1.0)
    assert entropy(torch.tensor([0.0, 0.0, 5.0, 0.0])) == pytest.approx(0.0)
    assert 0.0 < entropy(torch.tensor([1.0, 2.0, 3.0])) < 1.0


def test_ragged_bytes_follow_the_budgets():
    model = tiny_model("llama")
    ids, _ = random_batch([300], seed=9)
    cache = kvopt.cache("lava:ratio=0.75,window=8", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    kept = sum(len(s) for layer in cache.layers for s in segments(layer))  # token-heads over all layers
    assert abs(kept - 3 * 2 * 75) <= 3
    per_token_head = 2 * 16 * 4 + 4  # fp32 key and value, int32 position
    assert kept * per_token_head <= cache.nbytes() <= kept * per_token_head + 3 * 8 * 3  # + offsets
    assert cache.nbytes() < 0.27 * 3 * 2 * 300 * 2 * 16 * 4  # the lossless cache's bytes


def test_batch_rows_keep_what_they_keep_alone():
    lengths = [120, 70]
    model = tiny_model("llama")
    ids, mask = random_batch(lengths, seed=11)
    spec = "lava:ratio=0.5,window=8,pooling=avg,kernel=5"
    cache = kvopt.cache(spec, model)
    steps = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    batch_out = model.generate(ids, attention_mask=mask, past_key_values=cache, **steps)
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        alone = kvopt.cache(spec, model)
        single = model.generate(ids[row : row + 1, width - length :], past_key_values=alone, **steps)
        assert torch.equal(batch_out[row, width:], single[0, length:]), f"row {row}"
        for ours, theirs in zip(cache.layers, alone.layers):
            mine = [[p - (width - length) for p in s] for s in segments(ours)[2 * row : 2 * row + 2]]
            assert mine == segments(theirs)


def test_sliding_layers_keep_the_uniform_share_and_soft_capped_ones_go_ragged():
    model = tiny_model("gemma2")  # sliding layers and soft-capped attention
    ids, mask = random_batch([90, 61], seed=2)
    cache = kvopt.cache("lava:ratio=0.5,window=8", model)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert all(torch.isfinite(step).all() for step in out.logits)
    assert [bool(layer.parts) for layer in cache.layers] == [layer.sliding_window is None for layer in cache.layers]


@pytest.mark.parametrize(
    "spec, fragment",
    [("lava:ratio=0.5,pooling=mean", "pooling='mean'"), ("lava:ratio=0.5,scorer=window", "scorer"),
     ("lava:ratio=0.5,alpha=2", "alpha"), ("lava:ratio=0.5+kivi:bits=4", "every layer together")],
)  # fmt: skip
def test_bad_specs_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)
