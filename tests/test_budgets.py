"""Per-layer budget allocation (methods/budgets.py) and XKV's measured layer sensitivity (methods/xkv_calibration.py).

The references are slow and obviously right: XKV's allocation one token at a time in Python floats (the
paper's greedy), and the sensitivity from HF's eager attention weights with pooling and sorting by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_batch
from tiny_models import tiny_model

import kvopt
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import MethodParameterError
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.methods import xkv_calibration as calibration
from kvopt.methods.budgets import pyramid_budget, xkv_budgets
from kvopt.models import ModelInfo

pytestmark = pytest.mark.usefixtures("one_thread")


def random_retention(layers: int, points: int, seed: int) -> torch.Tensor:
    """Concave curves from 0 to 1, as a measurement gives: running sums of sorted random gains."""
    generator = torch.Generator().manual_seed(seed)
    gains = torch.rand(layers, points, generator=generator, dtype=torch.float64) ** torch.linspace(1, 12, layers)[:, None]
    curves = torch.cat([torch.zeros(layers, 1, dtype=torch.float64), gains.sort(descending=True).values.cumsum(-1)], -1)
    return curves / curves[:, -1:]


def slow_xkv(uniform: int, real: int, window: int, retention: torch.Tensor) -> list[int]:
    """XKV's greedy: give one token at a time to the layer whose next token adds the most retention."""
    curves = retention.tolist()
    layers, points = len(curves), len(curves[0]) - 1
    if real <= uniform:
        return [real] * layers
    candidates, prefix = real - window, uniform - window

    def curve_at(layer: int, tokens: int) -> float:
        where = tokens * points / candidates
        low = min(int(where), points - 1)
        return curves[layer][low] + (curves[layer][low + 1] - curves[layer][low]) * (where - low)

    counts = [0] * layers
    for _ in range(layers * prefix):
        best, best_gain = None, -1.0
        for layer in range(layers):
            if counts[layer] < candidates:
                gain = curve_at(layer, counts[layer] + 1) - curve_at(layer, counts[layer])
                if gain > best_gain:
                    best, best_gain = layer, gain
        counts[best] += 1
    return [count + window for count in counts]


@pytest.mark.parametrize(
    "layers, uniform, real, window, seed",
    [(3, 40, 200, 8, 0), (5, 30, 97, 4, 1), (30, 25, 211, 8, 2), (4, 120, 130, 8, 3), (6, 12, 500, 0, 4)],
)
def test_xkv_allocation_matches_the_slow_greedy_and_sums_to_the_total(layers, uniform, real, window, seed):
    retention = random_retention(layers, 64, seed)
    budgets = xkv_budgets(uniform, real, window, retention)
    assert list(budgets) == slow_xkv(uniform, real, window, retention)
    assert sum(budgets) == layers * uniform
    assert all(window <= b <= real for b in budgets) and len(set(budgets)) > 1


def test_xkv_edges_keep_everything_or_fall_back_to_uniform():
    retention = random_retention(4, 16, 0)
    assert xkv_budgets(300, 200, 8, retention) == (200,) * 4  # shorter than the budget: nothing to compress
    assert xkv_budgets(8, 200, 8, retention) == (8,) * 4  # the window fills the budget
    # A layer whose importance sits in its best tenth of tokens gets exactly those; the rest go to a layer whose
    # importance is spread evenly (each of its tokens still adds some).
    fractions = torch.linspace(0, 1, 11, dtype=torch.float64)
    concentrated, spread = torch.ones(11, dtype=torch.float64), fractions
    concentrated[0] = 0
    assert xkv_budgets(28, 108, 8, torch.stack([spread, concentrated])) == (38, 18)


def test_resample_reads_curves_linearly():
    curve = torch.tensor([0.0, 0.5, 0.75, 1.0], dtype=torch.float64)
    assert calibration.resample(curve, 6).tolist() == pytest.approx([0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0])


def eager_retention(model, ids: torch.Tensor) -> torch.Tensor:
    """Retention curves from HF's eager attention weights, pooled, sorted and summed by hand."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(ids[None], output_attentions=True).attentions
    window, kernel = calibration.WINDOW, calibration.KERNEL
    curves = []
    for weights in attentions:
        heads, length = weights.shape[1], ids.numel()
        kv_heads = model.config.num_key_value_heads
        group = heads // kv_heads
        prefix = length - window
        per_head = []
        for kv_head in range(kv_heads):
            raw = [
                sum(float(weights[0, h, q, t]) for h in range(kv_head * group, (kv_head + 1) * group) for q in range(length - window, length)) / group
                for t in range(prefix)
            ]  # fmt: skip
            pooled = [sum(raw[j] for j in range(t - kernel // 2, t + kernel // 2 + 1) if 0 <= j < prefix) / kernel for t in range(prefix)]
            per_head.append(sorted(pooled, reverse=True))
        gains = [sum(head[i] for head in per_head) for i in range(prefix)]
        total, running, curve = sum(gains), 0.0, [0.0]
        for gain in gains:
            running += gain
            curve.append(running / total)
        curves.append(calibration.resample(torch.tensor(curve, dtype=torch.float64), calibration.POINTS))
    return torch.stack(curves)


def test_sensitivity_matches_eager_attention():
    model = tiny_model("llama")
    kvopt.prepare(model)
    ids, _ = random_batch([70, 70], seed=3)
    measured = calibration.measure(model, ids)
    expected = (eager_retention(model, ids[0]) + eager_retention(model, ids[1])) / 2
    assert measured.shape == (3, calibration.POINTS + 1)
    torch.testing.assert_close(measured, expected, atol=1e-5, rtol=0)
    assert torch.all(measured.diff(dim=-1) >= -1e-12) and torch.allclose(measured[:, -1], torch.ones(3, dtype=torch.float64))


@pytest.fixture
def folder_model(model_folder, tmp_path, monkeypatch):
    """The tiny llama with the real tokenizer, loaded from its folder (the calibration finds its tokenizer),
    with calibrations cached in a fresh folder."""
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "cache"))
    model, tokenizer = kvopt.load_model(str(model_folder))
    return model, tokenizer


def test_snapkv_xkv_drops_bytes_by_the_allocation(folder_model, monkeypatch):
    model, tokenizer = folder_model
    text = kvopt.api.local_prose()[:4000]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :600]
    spec = "snapkv:ratio=0.75,window=8,budgets=xkv"
    cache = kvopt.cache(spec, model)
    (method,) = cache.methods
    assert method.retention is not None and not method.uniform_budgets
    full = kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids, past_key_values=full)
    real, target = ids.shape[1], int(ids.shape[1] * 0.25)
    expected = xkv_budgets(target, real, 8, method.retention)
    assert [s.kept for s in cache.stats()] == list(expected)
    assert sum(expected) == model.config.num_hidden_layers * target and len(set(expected)) > 1
    theoretical = estimate(ModelInfo.from_config(model.config), real, methods=parse(spec)).total_bytes
    assert cache.nbytes() < 0.3 * full.nbytes()
    assert abs(cache.nbytes() - theoretical) <= 0.02 * theoretical
    # Measured once: the next cache reads the stored curves.
    monkeypatch.setattr(calibration, "measure", lambda *a: pytest.fail("measured twice"))
    again = kvopt.cache(spec, model)
    assert torch.equal(again.methods[0].retention, method.retention)


def test_budgets_option_reaches_the_one_allocator():
    """snapkv:budgets=pyramid is pyramidkv; adakv's layer totals follow the pyramid too."""
    model = tiny_model("llama")
    ids, mask = random_batch([90, 61], seed=5)
    kept = {}
    for spec in ("snapkv:ratio=0.75,window=8,budgets=pyramid", "pyramidkv:ratio=0.75,window=8", "adakv:ratio=0.75,window=8,budgets=pyramid"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
        kept[spec.split(":")[0]] = cache
    layers = model.config.num_hidden_layers
    for index in range(layers):
        snap, pyramid = kept["snapkv"].layers[index].store, kept["pyramidkv"].layers[index].store
        assert torch.equal(snap.positions, pyramid.positions) and torch.equal(snap.valid, pyramid.valid)
    heads = model.config.num_key_value_heads
    for row, real in enumerate((90, 61)):
        budgets = [pyramid_budget(int(real * 0.25), real, 8, layer, layers, 20) for layer in range(layers)]
        assert len(set(budgets)) > 1
        for layer, budget in zip(kept["adakv"].layers, budgets):
            held = int(layer.parts_of(RaggedKV)[0].counts()[row].sum())  # heads differ; each rounds its share
            assert abs(held - heads * budget) <= heads / 2


def test_bad_budgets_is_one_line():
    with pytest.raises(MethodParameterError, match="budgets='layers' is not an allocation; use one of uniform, pyramid, xkv"):
        parse("snapkv:ratio=0.5,budgets=layers")
    (method,) = parse("snapkv:ratio=0.5,budgets=xkv")
    assert not method.uniform_budgets and parse("snapkv:ratio=0.5")[0].uniform_budgets
    assert not parse("pyramidkv:ratio=0.5")[0].uniform_budgets and parse("pyramidkv:ratio=0.5")[0].spec() == "pyramidkv:ratio=0.5"


def test_engine_serves_xkv_budgets_as_generate_does(folder_model):
    """budgets=xkv in the engine (head blocks, as pyramidkv): the same tokens as generate with the same cache."""
    from kvopt.engine import LLM, SamplingParams

    model, _ = folder_model
    spec = "snapkv:ratio=0.75,window=8,budgets=xkv"
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (120, 75)]
    llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory="4MB")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, outputs):
        expected = model.generate(torch.tensor([prompt]), past_key_values=kvopt.cache(spec, model), max_new_tokens=8,
                                  min_new_tokens=8, do_sample=False, pad_token_id=0)  # fmt: skip
        assert tokens == expected[0, len(prompt) :].tolist()
