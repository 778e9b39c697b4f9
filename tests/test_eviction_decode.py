"""Decode-time eviction (h2o, morphkv, streamingllm): slow references, bounded memory, batches, rolling positions.

The reference tests tap each layer's attention inputs (queries, new keys, padding bits) from
a real tiny GQA model (4 query heads, 2 KV heads), replay them through plain-Python versions
of the algorithms, and require the cache to hold exactly the token positions the reference
keeps, per batch row and KV head, after every forward pass.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from conftest import random_batch
from tiny_models import COMMON, VOCAB, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import rotate_half

import kvopt
from kvopt.errors import ContextTooLongError, MethodParameterError
from kvopt.methods import parse
from kvopt.methods.base import Method

SPECS = ["h2o:budget=32", "morphkv:budget=32,window=8", "streamingllm:budget=32"]
#: Query/key weight scale in the reference tests, so random-weight attention depends on content.
SHARPEN = 5.0


pytestmark = pytest.mark.usefixtures("one_thread")


# -- tapping a layer's inputs and outputs ---------------------------------------------------------
@dataclass
class Tap(Method):
    """Records what a layer attended with (phase "in") or what it holds afterwards (phase "out")."""

    name = "tap"
    log: list = field(default_factory=list)
    phase: str = "in"

    def after_attention(self, layer, step) -> None:
        store = layer.store
        if self.phase == "out":
            self.log.append(("out", id(layer), store.positions.clone(), store.valid.clone()))
            return
        new = step.query.shape[-2]
        self.log.append(
            (
                "in",
                id(layer),
                dict(
                    query=step.query.double(),
                    positions=step.query_positions.tolist(),
                    keys=store.keys[:, :, -new:].double(),
                    valid=store.valid[:, 0, -new:].clone(),
                    scale=step.scaling,
                ),
            )
        )


def run_tapped(spec: str, lengths: list[int], steps: int, seed: int = 3):
    """Prefill a left-padded batch, then decode ``steps`` random tokens; returns the tap log.

    Random weights attend almost uniformly, which would make every score a function of the
    position alone; sharper queries and keys make the scores depend on content.
    """
    model = tiny_model("llama")
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(SHARPEN)
            block.self_attn.k_proj.weight.mul_(SHARPEN)
    log: list = []
    cache = kvopt.cache([Tap(log, "in"), *parse(spec), Tap(log, "out")], model)
    ids, mask = random_batch(lengths, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        for _ in range(steps):
            token = torch.randint(3, VOCAB, (len(lengths), 1), generator=generator)
            mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=mask.dtype)], dim=1)
            model(token, attention_mask=mask, past_key_values=cache)
    return log, model.config


# -- slow references: dictionaries of tokens, loops over rows, heads and tokens -------------------
class Reference:
    """Per (row, KV head): position -> key of every kept real token; subclasses choose what stays."""

    def __init__(self, batch: int, kv_heads: int, heads: int, method) -> None:
        self.kv_heads, self.group, self.method = kv_heads, heads // kv_heads, method
        self.keys = [[{} for _ in range(kv_heads)] for _ in range(batch)]
        self.targets: list[int] | None = None

    def row_target(self, real_prefill: int) -> int:
        if self.method.ratio is not None:
            return max(1, int(real_prefill * (1 - self.method.ratio)))
        return self.method.budget

    def step(self, inputs) -> None:
        batch = len(self.keys)
        if self.targets is None:  # fixed from the prefill's real tokens
            self.targets = [self.row_target(int(inputs["valid"][b].sum())) for b in range(batch)]
        elif self.method.ratio is not None:  # later tokens come on top of the prompt's share
            self.targets = [target + len(inputs["positions"]) for target in self.targets]
        for b in range(batch):
            for t, position in enumerate(inputs["positions"]):
                if inputs["valid"][b, t]:
                    for h in range(self.kv_heads):
                        self.keys[b][h][position] = inputs["keys"][b, h, t]
                        self.new_token(b, h, position)
        self.observe(inputs)
        for b in range(batch):
            for h in range(self.kv_heads):
                kept = sorted(self.keys[b][h])
                if len(kept) > self.targets[b]:
                    keep = set(self.choose(b, h, kept, self.targets[b]))
                    assert len(keep) == self.targets[b]
                    for position in kept:
                        if position not in keep:
                            del self.keys[b][h][position]
                            self.forget(b, h, position)

    def new_token(self, b, h, position) -> None: ...

    def observe(self, inputs) -> None: ...

    def forget(self, b, h, position) -> None: ...

    def choose(self, b, h, kept, target) -> list[int]:
        raise NotImplementedError


class H2OReference(Reference):
    """Accumulated attention: sum over every query so far, mean over the group; recent + heavy hitters."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.score = [[{} for _ in range(self.kv_heads)] for _ in range(len(self.keys))]

    def new_token(self, b, h, position) -> None:
        self.score[b][h][position] = 0.0

    def forget(self, b, h, position) -> None:
        del self.score[b][h][position]

    def observe(self, inputs) -> None:
        scale = inputs["scale"]
        for b in range(len(self.keys)):
            for t, query_position in enumerate(inputs["positions"]):
                if not inputs["valid"][b, t]:
                    continue
                for h in range(self.kv_heads):
                    visible = [p for p in sorted(self.keys[b][h]) if p <= query_position]
                    keys = torch.stack([self.keys[b][h][p] for p in visible])
                    for g in range(self.group):
                        query = inputs["query"][b, h * self.group + g, t]
                        probs = torch.softmax(keys @ query * scale, dim=0)
                        for p, prob in zip(visible, probs.tolist()):
                            self.score[b][h][p] += prob / self.group

    def choose(self, b, h, kept, target) -> list[int]:
        recent = target // 2 if self.method.window is None else min(self.method.window, target)
        older = kept[: len(kept) - recent]
        heavy = sorted(older, key=lambda p: -self.score[b][h][p])[: target - recent]
        return kept[len(kept) - recent :] + heavy


class MorphKVReference(Reference):
    """The last W real queries: group-summed logits, softmax over older tokens, fused by sum or max."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.queries: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(len(self.keys))]

    def observe(self, inputs) -> None:
        for b in range(len(self.keys)):
            for t, position in enumerate(inputs["positions"]):
                if inputs["valid"][b, t]:
                    self.queries[b].append((position, inputs["query"][b, :, t]))
            self.queries[b] = self.queries[b][-self.method.window :]
        self.scale = inputs["scale"]

    def choose(self, b, h, kept, target) -> list[int]:
        window = self.method.window
        older = kept[: len(kept) - window]
        keys = torch.stack([self.keys[b][h][p] for p in older])
        rows = []
        for _, query in self.queries[b]:
            logits = sum(keys @ query[h * self.group + g] for g in range(self.group)) * self.scale
            rows.append(torch.softmax(logits, dim=0))
        rows = torch.stack(rows)
        fused = rows.sum(dim=0) if self.method.aggregation == "sum" else rows.amax(dim=0)
        best = sorted(range(len(older)), key=lambda i: -fused[i].item())[: target - window]
        return kept[len(kept) - window :] + [older[i] for i in best]


class StreamingReference(Reference):
    """The first ``sinks`` real tokens and the most recent ones."""

    def choose(self, b, h, kept, target) -> list[int]:
        sinks = min(self.method.sinks, target)
        return kept[:sinks] + kept[len(kept) - (target - sinks) :]


REFERENCES = {"h2o": H2OReference, "morphkv": MorphKVReference, "streamingllm": StreamingReference}


@pytest.mark.parametrize(
    "spec",
    [
        "h2o:budget=12",
        "h2o:budget=12,window=3",
        "h2o:ratio=0.4",
        "morphkv:budget=12,window=4",
        "morphkv:budget=12,window=4,aggregation=max",
        "streamingllm:budget=12",
        "streamingllm:ratio=0.5,sinks=2,rolling=never",
    ],
)
def test_fast_path_keeps_what_the_slow_reference_keeps(spec):
    lengths, steps = [20, 13, 3], 24
    log, config = run_tapped(spec, lengths, steps)
    (method,) = parse(spec)
    references: dict[int, Reference] = {}
    compared = 0
    for entry in log:
        if entry[0] == "in":
            _, layer, inputs = entry
            if layer not in references:
                batch, kv_heads = inputs["keys"].shape[:2]
                references[layer] = REFERENCES[method.name](batch, kv_heads, config.num_attention_heads, method)
            references[layer].step(inputs)
            continue
        _, layer, positions, valid = entry
        reference = references[layer]
        for b in range(len(lengths)):
            for h in range(reference.kv_heads):
                got = sorted(positions[b, h][valid[b, h]].tolist())
                assert got == sorted(reference.keys[b][h]), f"{spec}: row {b}, KV head {h}"
                compared += 1
    assert compared == 3 * (steps + 1) * len(lengths) * 2  # layers x forwards x rows x KV heads
    # Eviction really happened: the long row holds its budget, not its history.
    assert len(positions[0, 0][valid[0, 0]]) < lengths[0] + steps


def test_h2o_prefill_scores_are_column_sums_in_any_chunking(monkeypatch):
    import kvopt.methods.scores as scores

    ids, mask = random_batch([40, 25])

    def prefill_scores():
        model = tiny_model("llama")
        cache = kvopt.cache("h2o:budget=64", model)  # over the prompt: nothing evicted
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
        return [layer.store.extra("h2o").clone() for layer in cache.layers]

    whole = prefill_scores()
    monkeypatch.setattr(scores, "CHUNK_ELEMENTS", 1)  # one query at a time
    chunked = prefill_scores()
    for a, b in zip(whole, chunked):
        assert (a - b).abs().max().item() <= 1e-5
        # Each real query hands out one unit of attention; padding queries and padding keys get none.
        assert torch.allclose(a.sum(dim=-1), mask.sum(dim=-1, keepdim=True).float().expand(-1, 2), atol=1e-4)
        assert (a[mask[:, None, :].expand_as(a) == 0] == 0).all()


# -- bounded memory ---------------------------------------------------------------------------
def decode(spec: str, prompt: int, steps: int, seed: int = 5):
    """Prefill ``prompt`` random tokens and decode ``steps`` more; per step: (lengths per layer, nbytes)."""
    model = tiny_model("llama")
    cache = kvopt.cache(spec, model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, prompt + steps), generator=generator)
    trace = []
    with torch.no_grad():
        model(ids[:, :prompt], past_key_values=cache)
        for t in range(prompt, prompt + steps):
            model(ids[:, t : t + 1], past_key_values=cache)
            trace.append(([len(layer.store) for layer in cache.layers], cache.nbytes()))
    return cache, trace


@pytest.mark.parametrize("spec", SPECS)
def test_generating_keeps_bytes_bounded(spec):
    prompt, steps, budget = 24, 220, 32
    cache, trace = decode(spec, prompt, steps)
    full, _ = decode("full", prompt, steps)
    assert all(length <= budget for lengths, _ in trace for length in lengths)
    assert all(stats.kept == budget and stats.seen == prompt + steps for stats in cache.stats())
    steady = [nbytes for _, nbytes in trace[budget:]]
    assert max(steady) <= 1.2 * min(steady), "bytes held should stay flat once the cache is full"
    assert cache.nbytes() < 0.3 * full.nbytes()


@pytest.mark.parametrize("spec", ["h2o:ratio=0.5", "streamingllm:ratio=0.5", "tova:ratio=0.5", "window:ratio=0.5"])
def test_a_ratio_removes_the_prompts_share_and_later_tokens_come_on_top(spec):
    """kvpress's convention: equal ratios hold equal tokens, whatever the method's schedule."""
    _, trace = decode(spec, 40, 12)
    assert [lengths for lengths, _ in trace] == [[20 + step] * 3 for step in range(1, 13)]


@pytest.mark.parametrize("spec", [s.replace("32", "16") + ",compress_every=8" for s in SPECS])
def test_compress_every_lets_the_cache_breathe(spec):
    budget = 16
    _, trace = decode(spec.replace("window=8", "window=4"), 10, 60)
    lengths = {length for layer_lengths, _ in trace[10:] for length in layer_lengths}
    assert lengths == set(range(budget, budget + 8))


# -- batches ----------------------------------------------------------------------------------
GENERATE = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)


@pytest.mark.parametrize("spec", ["h2o:budget=8", "morphkv:budget=8,window=3", "streamingllm:budget=8,sinks=2"])
def test_batch_rows_match_single_runs_and_padding_is_never_kept(spec):
    lengths = [19, 11, 5]
    model = tiny_model("llama")
    ids, mask = random_batch(lengths, seed=7)
    width = ids.shape[1]
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        batch_out = model.generate(ids, attention_mask=mask, past_key_values=cache, **GENERATE)
    for stats in cache.stats():
        assert stats.kept <= len(lengths) * 8
    singles_kept = [0] * len(cache.layers)
    for row, length in enumerate(lengths):
        alone = kvopt.cache(spec, model)
        with torch.no_grad():
            single_out = model.generate(ids[row : row + 1, width - length :], past_key_values=alone, **GENERATE)
        assert torch.equal(batch_out[row, width:], single_out[0, length:]), f"row {row} generated differently"
        for index, (ours, theirs) in enumerate(zip(cache.layers, alone.layers)):
            singles_kept[index] += alone.stats()[index].kept
            for head in range(ours.store.keys.shape[1]):
                in_batch = ours.store.positions[row, head][ours.store.valid[row, head]] - (width - length)
                single = theirs.store.positions[0, head][theirs.store.valid[0, head]]
                assert sorted(in_batch.tolist()) == sorted(single.tolist()), f"row {row}, layer {index}, head {head}"
    assert [stats.kept for stats in cache.stats()] == singles_kept


# -- streamingllm: positions within the cache ---------------------------------------------------
def short_context_llama(max_positions: int = 64, **overrides):
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "max_position_embeddings": max_positions, **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


def rotate(keys: torch.Tensor, positions: torch.Tensor, model) -> torch.Tensor:
    """RoPE by the model's own rotary embedding: ``keys [1, H, T, D]`` moved by ``positions [T]`` (may be < 0)."""
    cos, sin = model.model.rotary_emb(keys, positions[None])
    return keys * cos[:, None] + rotate_half(keys) * sin[:, None]


def streaming_reference(model, ids: torch.Tensor, chunks: list[int], budget: int, sinks: int, rolling: bool):
    """StreamingLLM on a plain DynamicCache, rebuilt for every forward pass.

    rolling: keys are kept *un-rotated* and rotated at their slot 0..T-1, the new tokens at
    T, T+1, ... (the paper's code). Otherwise: keys keep their absolute positions.
    """
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (keys, values)
    logits, seen = [], 0
    for size in chunks:
        held = kept[0][0].shape[2] if kept else 0
        start = held if rolling else seen
        positions = torch.arange(start, start + size)
        cache = DynamicCache(config=model.config)
        for index, (keys, values) in enumerate(kept):
            cache.update(rotate(keys, torch.arange(held), model) if rolling else keys, values, index)
        with torch.no_grad():
            out = model(ids[:, seen : seen + size], position_ids=positions[None], past_key_values=cache)
        logits.append(out.logits[0])
        updated = []
        for index, layer in enumerate(cache.layers):
            new_keys, new_values = layer.keys[:, :, -size:], layer.values[:, :, -size:]
            if rolling:
                new_keys = rotate(new_keys, -positions, model)  # back to un-rotated
            keys = torch.cat([kept[index][0], new_keys], dim=2) if kept else new_keys
            values = torch.cat([kept[index][1], new_values], dim=2) if kept else new_values
            if keys.shape[2] > budget:
                keep = list(range(sinks)) + list(range(keys.shape[2] - (budget - sinks), keys.shape[2]))
                keys, values = keys[:, :, keep], values[:, :, keep]
            updated.append((keys, values))
        kept, seen = updated, seen + size
    return torch.cat(logits)


def streaming_kvopt(model, ids, chunks, spec):
    cache = kvopt.cache(spec, model)
    logits, seen = [], 0
    with torch.no_grad():
        for size in chunks:
            logits.append(model(ids[:, seen : seen + size], past_key_values=cache).logits[0])
            seen += size
    return torch.cat(logits), cache


def test_rolling_streams_past_the_trained_context_like_the_paper():
    """150 tokens beyond a 64-position model: equal to StreamingLLM's slot positions, chunks included."""
    reference = short_context_llama()
    ours = copy.deepcopy(reference)
    chunks = [20] + [1] * 100 + [3] + [1] * 50  # 174 tokens; a 3-token chunk after eviction
    ids = torch.randint(3, VOCAB, (1, sum(chunks)), generator=torch.Generator().manual_seed(11))
    expected = streaming_reference(reference, ids, chunks, budget=16, sinks=4, rolling=True)
    got, cache = streaming_kvopt(ours, ids, chunks, "streamingllm:budget=16,rolling=always")
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max().item() <= 1e-4
    assert cache.get_seq_length() == sum(chunks) > ours.config.max_position_embeddings
    assert all(len(layer.store) == 16 for layer in cache.layers)
    assert cache.layers[0].store.positions[0, 0].tolist() == [0, 1, 2, 3, *range(sum(chunks) - 12, sum(chunks))]


def test_without_rolling_keys_keep_absolute_positions_and_the_context_limit_holds():
    reference = short_context_llama()
    ours = copy.deepcopy(reference)
    chunks = [20] + [1] * 40
    ids = torch.randint(3, VOCAB, (1, 80), generator=torch.Generator().manual_seed(12))
    expected = streaming_reference(reference, ids, chunks, budget=16, sinks=4, rolling=False)
    got, cache = streaming_kvopt(ours, ids, chunks, "streamingllm:budget=16,rolling=never")
    assert (got - expected).abs().max().item() <= 1e-4
    with pytest.raises(ContextTooLongError):
        for t in range(60, 80):
            ours(ids[:, t : t + 1], past_key_values=cache)


def test_auto_rolling_keeps_absolute_positions_inside_the_context_and_rolls_past_it():
    """The default: identical to absolute positions up to the model's limit, then streams on bounded."""
    reference = short_context_llama()
    ours = copy.deepcopy(reference)
    chunks = [20] + [1] * 150
    ids = torch.randint(3, VOCAB, (1, sum(chunks)), generator=torch.Generator().manual_seed(13))
    inside = 64  # logits rows of the positions below the 64-position limit
    expected = streaming_reference(reference, ids, chunks[: 1 + 44], budget=16, sinks=4, rolling=False)
    got, cache = streaming_kvopt(ours, ids, chunks, "streamingllm:budget=16")
    assert (got[:inside] - expected).abs().max().item() <= 1e-4
    always, _ = streaming_kvopt(copy.deepcopy(reference), ids, chunks, "streamingllm:budget=16,rolling=always")
    assert (got[:inside] - always[:inside]).abs().max().item() > 1e-3  # rolling from the start differs
    assert torch.isfinite(got).all() and cache.get_seq_length() == 170
    assert all(len(layer.store) == 16 for layer in cache.layers)


@pytest.mark.parametrize("rolling, tokens", [("always", 12), ("auto", 80)])
def test_rolling_rejects_length_dependent_rope_once_it_must_roll(rolling, tokens):
    model = short_context_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    cache = kvopt.cache(f"streamingllm:budget=8,rolling={rolling}", model)
    with pytest.raises(MethodParameterError, match="rolling=never"):
        for _ in range(tokens):
            model(torch.ones(1, 1, dtype=torch.long), past_key_values=cache)


# -- parameters -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("h2o:ratio=1.5", r"outside \(0, 1\)"),
        ("morphkv:ratio=0", r"outside \(0, 1\)"),
        ("streamingllm:ratio=-0.2", r"outside \(0, 1\)"),
        ("h2o:budget=8,window=8", "must be smaller than budget"),
        ("morphkv:budget=32", "window=32 must be smaller than budget=32"),
        ("streamingllm:budget=4", "sinks=4 must be smaller than budget=4"),
        ("h2o:budget=8,recent=2", "unknown parameter 'recent'"),
        ("morphkv:budget=16,heavy=2", "unknown parameter 'heavy'"),
        ("streamingllm:budget=16,sink=2", "unknown parameter 'sink'"),
        ("streamingllm:budget=16,rolling=true", "not one of auto, always, never"),
        ("streamingllm:budget=16,rolling=true", "not one of auto, always, never"),
        ("morphkv:budget=16,window=4,aggregation=mean", "use sum or max"),
        ("h2o", "exactly one of ratio"),
        ("h2o:budget=0", "positive"),
    ],
)
def test_bad_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)


@pytest.mark.parametrize("spec", [*SPECS, "h2o:ratio=0.5,window=4", "streamingllm:budget=64,sinks=1,rolling=never"])
def test_specs_round_trip(spec):
    (method,) = parse(spec)
    assert parse(method.spec())[0] == method
    assert method.schedule == "decode"
