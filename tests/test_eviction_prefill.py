"""Eviction methods against slow references: snapkv, pyramidkv, knorm, random (prefill) and tova (decode).

The references below are written to be obviously right rather than fast: Python loops over
batch rows, KV heads, query heads and tokens; attention weights from explicit dot products
and a hand-written softmax (in float64); pooling by explicit windows; top-k by sorting. They
read what the cache held and the queries of the step *before* the method acted, captured by
a probe method placed first in the cache's method list, and must keep exactly the positions
the fast path keeps, per batch row and KV head (tied scores at the cut may break either way).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
from conftest import random_batch
from tiny_models import COMMON, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

import kvopt
from kvopt.cache.storage import slack_tokens
from kvopt.errors import MethodParameterError
from kvopt.methods import parse
from kvopt.methods.base import Method
from kvopt.methods.pyramidkv import pyramid_budget



pytestmark = pytest.mark.usefixtures("one_thread")


# -- capture -----------------------------------------------------------------------------------


class Probe(Method):
    """Records, per layer and step, the stored tokens and the queries before the next methods act."""

    name = "probe"

    def __init__(self) -> None:
        self.records: dict[int, list[dict]] = {}

    def after_attention(self, layer, step) -> None:
        store = layer.store
        self.records.setdefault(step.module.layer_idx, []).append(
            dict(
                query=step.query.detach().double().clone(),
                query_positions=step.query_positions.tolist(),
                scaling=step.scaling,
                keys=store.keys.detach().double().clone(),
                positions=store.positions.tolist(),
                valid=store.valid.tolist(),
                is_prefill=step.is_prefill,
            )
        )


def run(spec: str, ids, mask=None, model=None):
    """One forward pass (the prefill) through a cache whose first method is a probe."""
    model = model if model is not None else tiny_model("llama")
    probe = Probe()
    cache = kvopt.cache([probe, *parse(spec)], model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    return model, cache, probe


def kept_positions(layer, row: int, head: int) -> list[int]:
    """Sorted positions a layer keeps (valid slots only) for one row and KV head."""
    store = layer.store
    return sorted(p for p, v in zip(store.positions[row, head].tolist(), store.valid[row, head].tolist()) if v)


# -- slow references ---------------------------------------------------------------------------


def softmax_row(snap, row: int, head: int, kv_head: int, query: int) -> dict[int, float]:
    """Attention weights of one query head's query over the stored slots it may see: {slot: weight}."""
    q = snap["query"][row, head, query]
    dim = q.shape[0]
    scale = snap["scaling"] if snap["scaling"] is not None else dim**-0.5
    query_position = snap["query_positions"][query]
    logits = {}
    for slot in range(snap["keys"].shape[2]):
        if snap["valid"][row][kv_head][slot] and snap["positions"][row][kv_head][slot] <= query_position:
            logits[slot] = float(torch.dot(q, snap["keys"][row, kv_head, slot])) * scale
    top = max(logits.values())
    exps = {slot: math.exp(value - top) for slot, value in logits.items()}
    total = sum(exps.values())
    return {slot: e / total for slot, e in exps.items()}


def window_scores(snap, window: int) -> list[list[list[float]]]:
    """SnapKV scores ``[row][kv_head][slot]``: sum over the last ``window`` queries, mean over the GQA group."""
    batch, heads, queries, _ = snap["query"].shape
    kv_heads, slots = snap["keys"].shape[1], snap["keys"].shape[2]
    group = heads // kv_heads
    window = min(window, queries)
    out = []
    for row in range(batch):
        per_head = []
        for kv_head in range(kv_heads):
            total = [0.0] * slots
            for head in range(kv_head * group, (kv_head + 1) * group):  # query heads reading this KV head
                for query in range(queries - window, queries):
                    for slot, weight in softmax_row(snap, row, head, kv_head, query).items():
                        total[slot] += weight
            per_head.append([t / group for t in total])
        out.append(per_head)
    return out


def pool(scores: list[float], kernel: int, kind: str) -> list[float]:
    """Stride-1 pooling keeping the length: window [j - kernel//2, j - kernel//2 + kernel), zero/absent padding."""
    out = []
    for j in range(len(scores)):
        inside = [scores[i] for i in range(j - kernel // 2, j - kernel // 2 + kernel) if 0 <= i < len(scores)]
        out.append(sum(inside) / kernel if kind == "avg" else max(inside))
    return out


def select(scores: list[float], valid: list[bool], positions: list[int], target: int, protect: int):
    """Positions kept: the last ``protect`` slots, then the best-scoring valid slots up to ``target``."""
    slots = len(scores)
    protected = list(range(slots - protect, slots))
    ranked = sorted((s for s in range(slots - protect) if valid[s]), key=lambda s: -scores[s])
    return sorted(positions[s] for s in protected + ranked[: target - protect])


def assert_same_selection(got: list[int], expected: list[int], score_of: dict[int, float], where: str) -> None:
    """Equal sets, or differing only by a swap of tied scores at the cut.

    Max pooling makes exact ties (a peak spreads over its neighbours), which ``topk`` and a
    stable sort break differently; float32 vs float64 can also reorder scores ~1e-8 apart.
    """
    if got == expected:
        return
    assert len(got) == len(expected), f"{where}: kept {len(got)} tokens, reference {len(expected)}"
    swapped = [score_of[p] for p in set(got) ^ set(expected)]
    scale = max(abs(v) for v in score_of.values()) or 1.0
    assert max(swapped) - min(swapped) <= 1e-6 * scale, f"{where}: kept {got}, reference {expected}"


def real_tokens(snap, row: int) -> int:
    return sum(snap["valid"][row][0])


def ratio_target(real: int, ratio: float) -> int:
    return max(1, int(real * (1 - ratio)))


def expected_pyramid(uniform: int, real: int, window: int, layer: int, layers: int, beta: int = 20) -> int:
    """KVCache-Factory's schedule, written from ALGORITHMS.md §5 with exact fractions (step not floored)."""
    if real <= uniform:
        return real
    average = uniform - window
    if average <= 0 or layers == 1 or real < 2 * average:
        return uniform
    low = average // beta
    high = 2 * average - low
    if high >= real - window:
        high = real - window
        low = 2 * average - high
    return round(Fraction(high) - Fraction(layer * (high - low), layers - 1)) + window  # half to even


def check_snapkv_family(cache, probe, *, window, kernel, pooling, targets_of) -> None:
    """Every layer, row and KV head keeps what the slow SnapKV reference keeps with ``targets_of(layer, real)``."""
    for index, layer in enumerate(cache.layers):
        (snap,) = probe.records[index]
        scores = window_scores(snap, window)
        batch, kv_heads = len(snap["valid"]), len(snap["valid"][0])
        targets = [targets_of(index, real_tokens(snap, row)) for row in range(batch)]
        protect = min(window, min(targets))
        for row in range(batch):
            assert layer.store.valid_counts()[row] == targets[row], f"layer {index} row {row}"
            for kv_head in range(kv_heads):
                pooled = pool(scores[row][kv_head], kernel, pooling)
                positions = snap["positions"][row][kv_head]
                expected = select(pooled, snap["valid"][row][kv_head], positions, targets[row], protect)
                assert_same_selection(
                    kept_positions(layer, row, kv_head),
                    expected,
                    dict(zip(positions, pooled)),
                    f"layer {index} row {row} head {kv_head}",
                )


# -- reference tests -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window, kernel, pooling", [(8, 5, "avg"), (8, 7, "max"), (1, 1, "avg"), (16, 4, "max"), (4, 3, "avg")]
)
def test_snapkv_matches_slow_reference(window, kernel, pooling):
    ids, mask = random_batch([64, 50], seed=3)
    ratio = 0.6
    _, cache, probe = run(f"snapkv:ratio={ratio},window={window},kernel={kernel},pooling={pooling}", ids, mask)
    check_snapkv_family(
        cache, probe, window=window, kernel=kernel, pooling=pooling,
        targets_of=lambda _, real: ratio_target(real, ratio),
    )


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_snapkv_scores_per_query_head_reduced_per_kv_head(kv_heads):
    """GQA groups of 4, 2 and 1: the reference averages each group's query heads; KV heads are never expanded."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "num_key_value_heads": kv_heads})).eval()
    ids, mask = random_batch([48, 40], seed=5)  # two rows: storage.append fails for batch 1 with one KV head
    _, cache, probe = run("snapkv:budget=20,window=6,kernel=3", ids, mask, model=model)
    for layer in cache.layers:
        assert layer.store.keys.shape[1] == kv_heads
    check_snapkv_family(cache, probe, window=6, kernel=3, pooling="avg", targets_of=lambda _, real: min(real, 20))


def test_snapkv_with_budget_keeps_short_prompts_whole():
    ids, mask = random_batch([30, 12], seed=2)
    _, cache, _ = run("snapkv:budget=16,window=4", ids, mask)
    for layer in cache.layers:
        assert layer.store.valid_counts().tolist() == [16, 12]
        assert kept_positions(layer, 1, 0) == list(range(18, 30))  # the short row, whole


@pytest.mark.parametrize("ratio, window, pooling", [(0.5, 4, "avg"), (0.7, 8, "max")])
def test_pyramidkv_matches_slow_reference_and_schedule(ratio, window, pooling):
    ids, mask = random_batch([64, 50], seed=4)
    model, cache, probe = run(f"pyramidkv:ratio={ratio},window={window},kernel=5,pooling={pooling}", ids, mask)
    layers = model.config.num_hidden_layers

    def targets_of(index, real):
        return expected_pyramid(ratio_target(real, ratio), real, window, index, layers)

    check_snapkv_family(cache, probe, window=window, kernel=5, pooling=pooling, targets_of=targets_of)
    for row, real in enumerate((64, 50)):
        counts = [int(layer.store.valid_counts()[row]) for layer in cache.layers]
        assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]  # a real pyramid
        assert sum(counts) == layers * ratio_target(real, ratio)  # same total as uniform snapkv
    (method,) = parse(f"pyramidkv:ratio={ratio}")
    assert method.kept_tokens(64) == ratio_target(64, ratio)


@pytest.mark.parametrize("layers", [2, 3, 16, 30, 32])
@pytest.mark.parametrize(
    "uniform, real, window",
    [
        (100, 200, 8),  # the pyramid
        (50, 200, 8),
        (128, 4000, 32),
        (108, 200, 8),  # clamped: layer 0 keeps the whole prompt
        (150, 200, 8),  # n < 2·B̄: uniform
        (200, 150, 8),  # n <= B: no compression
        (8, 200, 8),  # window fills the budget: uniform
        (9, 50, 8),
    ],
)
def test_pyramid_schedule(uniform, real, window, layers):
    """Factory's schedule: layer 0 the most, linear, equal total; clamp, fallback and no-compression edges."""
    budgets = [pyramid_budget(uniform, real, window, layer, layers, 20) for layer in range(layers)]
    assert budgets == [expected_pyramid(uniform, real, window, layer, layers) for layer in range(layers)]
    assert sum(budgets) == layers * min(uniform, real)
    assert budgets == sorted(budgets, reverse=True)
    assert all(window <= b <= real for b in budgets) or budgets == [uniform] * layers
    average = uniform - window
    if real >= 2 * average > 0 and uniform < real:
        low = average // 20
        high = min(2 * average - low, real - window)
        assert (budgets[0], budgets[-1]) == (high + window, 2 * average - high + window)
    else:
        assert budgets == [min(uniform, real)] * layers


def test_pyramid_clamps_the_bottom_layer_to_the_prompt():
    # B̄ = 100, n - w = 192 < 2B̄ - B̄//20 = 195: layer 0 keeps the whole prompt, the top layer 2B̄ - 192.
    assert [pyramid_budget(108, 200, 8, layer, 3, 20) for layer in range(3)] == [200, 108, 16]


@pytest.mark.parametrize("window", [0, 4])
def test_knorm_matches_slow_reference(window):
    ids, mask = random_batch([60, 41], seed=6)
    ratio = 0.5
    _, cache, probe = run(f"knorm:ratio={ratio},window={window}", ids, mask)
    for index, layer in enumerate(cache.layers):
        (snap,) = probe.records[index]
        keys = snap["keys"]
        batch, kv_heads, slots, dim = keys.shape
        targets = [ratio_target(real_tokens(snap, row), ratio) for row in range(batch)]
        protect = min(window, min(targets))
        for row in range(batch):
            assert layer.store.valid_counts()[row] == targets[row]
            for kv_head in range(kv_heads):
                norms = [math.sqrt(sum(float(keys[row, kv_head, s, d]) ** 2 for d in range(dim))) for s in range(slots)]
                scores = [-n for n in norms]  # lowest norm kept
                positions = snap["positions"][row][kv_head]
                expected = select(scores, snap["valid"][row][kv_head], positions, targets[row], protect)
                assert_same_selection(
                    kept_positions(layer, row, kv_head), expected, dict(zip(positions, scores)), f"layer {index}"
                )
        assert not layer.store.heads_aligned  # selection is per KV head


def test_tova_matches_slow_reference_at_prefill_and_while_decoding():
    """Last query's attention averaged over all heads of the layer; one index set for all KV heads."""
    budget = 24
    ids, mask = random_batch([40, 33], seed=7)
    model, cache, probe = run(f"tova:budget={budget}", ids, mask)
    assert probe.records[0][0]["is_prefill"] and probe.records[0][0]["query"].shape[2] == 40
    check_tova(cache, probe, budget, step=0)
    extra = torch.tensor([[5], [9]])
    with torch.no_grad():
        for step in range(1, 4):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            model(extra + step, attention_mask=mask, past_key_values=cache)
            assert not probe.records[0][step]["is_prefill"]
            check_tova(cache, probe, budget, step=step)


def check_tova(cache, probe, budget: int, step: int) -> None:
    for index, layer in enumerate(cache.layers):
        snap = probe.records[index][step]
        batch, heads = snap["query"].shape[:2]
        kv_heads = snap["keys"].shape[1]
        group = heads // kv_heads
        queries = snap["query"].shape[2]
        for row in range(batch):
            scores = [0.0] * snap["keys"].shape[2]
            for head in range(heads):
                for slot, weight in softmax_row(snap, row, head, head // group, queries - 1).items():
                    scores[slot] += weight / heads
            positions = snap["positions"][row][0]
            expected = select(scores, snap["valid"][row][0], positions, min(budget, real_tokens(snap, row)), 0)
            for kv_head in range(kv_heads):
                assert_same_selection(
                    kept_positions(layer, row, kv_head),
                    expected,
                    dict(zip(positions, scores)),
                    f"layer {index} step {step} row {row} head {kv_head}",
                )
        assert layer.store.heads_aligned


def test_random_is_seeded():
    ids, _ = random_batch([80], seed=8)
    model = tiny_model("llama")

    def selection(spec):
        _, cache, _ = run(spec, ids, model=model)
        return [layer.store.positions.tolist() for layer in cache.layers], cache

    first, cache = selection("random:ratio=0.5,seed=1")
    again, _ = selection("random:ratio=0.5,seed=1")
    other, _ = selection("random:ratio=0.5,seed=2")
    assert first == again
    assert first != other
    assert first[0] != first[1]  # each layer draws its own sample
    for layer in cache.layers:
        assert layer.store.valid_counts().tolist() == [40]
        assert not layer.store.heads_aligned
        for head in range(layer.store.positions.shape[1]):
            kept = layer.store.positions[0, head].tolist()
            assert kept == sorted(kept) and len(set(kept)) == 40


# -- real savings ----------------------------------------------------------------------------------

SPECS = [
    "snapkv:ratio={r},window=8",
    "pyramidkv:ratio={r},window=8",
    "knorm:ratio={r}",
    "random:ratio={r}",
    "tova:ratio={r}",
]


@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("template", SPECS)
def test_bytes_drop_to_the_kept_tokens(template, ratio):
    model = tiny_model("llama")
    config = model.config
    n = 200
    ids, _ = random_batch([n], seed=9)
    full = kvopt.cache("full", model)
    spec = template.format(r=ratio)
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        model(ids, past_key_values=full)
        model(ids, past_key_values=cache)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_key_value_heads * (2 * head_dim * 4 + 4 + 1)  # fp32 keys+values, int32 position, bool
    uniform = int(n * (1 - ratio))
    layers = config.num_hidden_layers
    if spec.startswith("pyramidkv"):
        kept = [expected_pyramid(uniform, n, 8, layer, layers) for layer in range(layers)]
    else:
        kept = [uniform] * layers
    assert [len(layer.store) for layer in cache.layers] == kept
    theoretical = sum((k + slack_tokens(k)) * per_token for k in kept)
    assert abs(cache.nbytes() - theoretical) <= 0.05 * theoretical
    assert cache.nbytes() < (1 - ratio + 0.06) * full.nbytes()


@pytest.mark.parametrize("spec", [template.format(r=0.5) for template in SPECS])
def test_kv_heads_are_never_expanded(spec):
    model = tiny_model("llama")
    ids, _ = random_batch([100], seed=10)
    _, cache, _ = run(spec, ids, model=model)
    for layer in cache.layers:
        assert layer.store.keys.shape[1] == model.config.num_key_value_heads
        assert layer.store.values.shape[1] == model.config.num_key_value_heads


# -- batches ---------------------------------------------------------------------------------------

LENGTHS = [60, 45, 30]
BATCH_SPECS = ["snapkv:ratio=0.5,window=4", "pyramidkv:ratio=0.5,window=4", "knorm:ratio=0.5", "random:ratio=0.5"]


def generate(spec: str, ids, mask, model, new_tokens: int, probe: Probe | None = None):
    cache = kvopt.cache(([probe] if probe else []) + parse(spec), model)
    with torch.no_grad():
        model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return cache


@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_left_padded_batch_keeps_only_real_tokens(spec):
    model = tiny_model("llama")
    ids, mask = random_batch(LENGTHS, seed=11)
    width = ids.shape[1]
    cache = generate(spec, ids, mask, model, new_tokens=4)
    layers = model.config.num_hidden_layers
    for index, layer in enumerate(cache.layers):
        decoded = layer.seen - width
        assert decoded >= 1
        store = layer.store
        for row, real in enumerate(LENGTHS):
            uniform = int(real * (1 - 0.5))
            target = expected_pyramid(uniform, real, 4, index, layers) if spec.startswith("pyramidkv") else uniform
            padding = width - real
            for head in range(store.positions.shape[1]):
                kept = kept_positions(layer, row, head)
                assert len(kept) == target + decoded
                assert all(p >= padding for p in kept), "a padding slot is counted as kept"
                assert sum(1 for p in kept if p < width) == target
            assert int(store.valid_counts()[row]) == target + decoded
        assert cache.stats()[index].kept == sum(
            (expected_pyramid(int(r * 0.5), r, 4, index, layers) if spec.startswith("pyramidkv") else int(r * 0.5))
            + decoded
            for r in LENGTHS
        )


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5,window=4", "knorm:ratio=0.5", "pyramidkv:ratio=0.5,window=4"])
def test_batch_keeps_what_each_prompt_keeps_alone(spec):
    """Batched rows keep what each prompt keeps alone (positions shifted by the row's padding).

    Ties are allowed to break differently: in layer 0 a repeated token has the same key norm
    up to RoPE rounding, so knorm's batched and single float32 runs may pick either copy.
    """
    model = tiny_model("llama")
    ids, mask = random_batch(LENGTHS, seed=12)
    width = ids.shape[1]
    batched = generate(spec, ids, mask, model, new_tokens=1)
    for row, real in enumerate(LENGTHS):
        padding = width - real
        probe = Probe()
        alone = generate(spec, ids[row : row + 1, padding:], mask[row : row + 1, padding:], model, 1, probe)
        for index, (layer, single) in enumerate(zip(batched.layers, alone.layers)):
            for head in range(layer.store.positions.shape[1]):
                shifted = [p - padding for p in kept_positions(layer, row, head)]
                expected = kept_positions(single, 0, head)
                if shifted != expected:  # only then compute the scores, to check for a tie
                    (snap,) = probe.records[index]
                    if spec.startswith("knorm"):
                        scores = (-snap["keys"][0, head].norm(dim=-1)).tolist()
                    else:
                        scores = pool(window_scores(snap, 4)[0][head], 5, "avg")
                    where = f"layer {index} row {row} head {head}"
                    assert_same_selection(shifted, expected, dict(enumerate(scores)), where)


# -- composition and validation ------------------------------------------------------------------


def test_snapkv_composes_with_a_window():
    methods = parse("snapkv:ratio=0.5+window:size=64")
    assert [m.name for m in methods] == ["snapkv", "window"]
    model = tiny_model("llama")
    ids, _ = random_batch([200], seed=13)
    cache = kvopt.cache("snapkv:ratio=0.5+window:size=64", model)
    full = kvopt.cache("full", copy.deepcopy(model))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 205
    for layer in cache.layers:
        assert len(layer.store) == 64
    with torch.no_grad():
        model(ids, past_key_values=full)
    assert cache.nbytes() < 0.5 * full.nbytes()


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("snapkv:ratio=1.5", r"ratio=1.5 is outside \(0, 1\)"),
        ("pyramidkv:ratio=0", r"outside \(0, 1\)"),
        ("knorm:ratio=1", r"outside \(0, 1\)"),
        ("random:ratio=-0.1", r"outside \(0, 1\)"),
        ("snapkv:ratio=0.5,budget=128", "exactly one of ratio"),
        ("pyramidkv", "exactly one of ratio"),
        ("knorm", "e.g. knorm:ratio=0.5"),
        ("random:budget=10,ratio=0.2", "exactly one of ratio"),
        ("snapkv:budget=64", "window=64 must be smaller than budget=64"),
        ("pyramidkv:budget=32,window=40", "window=40 must be smaller than budget=32"),
        ("knorm:budget=8,window=8", "must be smaller than budget"),
        ("snapkv:ratio=0.5,pooling=mean", "pooling='mean'; use avg or max"),
        ("pyramidkv:ratio=0.5,pooling=median", "use avg or max"),
        ("pyramidkv:ratio=0.5,beta=0", "beta=0 must be >= 1"),
        ("random:ratio=0.5,seed=x", "not a valid int"),
    ],
)
def test_bad_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)
