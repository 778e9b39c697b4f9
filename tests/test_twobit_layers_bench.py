"""benchmarks/twobit_layers.py: a variant's cache holds the other spec's methods in the named layers only, the
layer groups cover the model, and the section pairs each variant's answers with full's on the same prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import twobit_layers  # noqa: E402


def test_layer_sets_and_groups_cover_the_model():
    assert twobit_layers.layer_set("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    groups = twobit_layers.group_variants("kivi:bits=2", 30, 10)
    assert groups == {"kivi:bits=2|full@10-29": "kivi:bits=2 in layers 0-9 only",
                      "kivi:bits=2|full@0-9,20-29": "kivi:bits=2 in layers 10-19 only",
                      "kivi:bits=2|full@0-19": "kivi:bits=2 in layers 20-29 only"}  # fmt: skip


def test_a_variant_holds_the_other_spec_in_its_layers_and_full_precision_where_named(tiny_with_tokenizer):
    from kvopt.eval.decoding import shared_prefill

    model, _ = tiny_with_tokenizer
    mixed = twobit_layers.variant_cache("kivi:bits=2,residual=0|kivi:bits=4,residual=0@1", model)
    assert [m.bits for m in mixed.layers[0].methods] == [2] and [m.bits for m in mixed.layers[1].methods] == [4]
    ids = torch.randint(0, 500, (64,)).tolist()
    shared = shared_prefill(model, ids)
    sizes = {}
    for variant in ("kivi:bits=2,residual=0", "kivi:bits=2,residual=0|full@1", "kivi:bits=2,residual=0|full@0-1"):
        cache = twobit_layers.variant_cache(variant, model)
        cache.replay_prefill(shared.cache)
        sizes[variant] = [layer.nbytes() for layer in cache.layers]
    plain, half, none = sizes.values()
    assert half[0] == plain[0] and half[1] > plain[1]  # layer 1 kept at full precision: more bytes
    assert none[0] > plain[0] and none[1] == half[1]
    logprob, _ = twobit_layers.answer_logprob(model, shared, "kivi:bits=2,residual=0|full@0-1", ids[:4], ids[4:8])
    reference, _ = twobit_layers.answer_logprob(model, shared, "full", ids[:4], ids[4:8])
    assert abs(logprob - reference) < 1e-4  # every layer at full precision: full's answer probability


def test_the_section_pairs_each_variant_with_full():
    def row(variant, depth, score, full_score, drop):
        return {"model": "m", "task": "prose_needle", "length": 2048, "depth": depth, "sample": 0, "seed": 0,
                "variant": variant, "label": variant, "logprob_drop": drop, "score": score, "full_score": full_score}

    rows = [row("kivi:bits=2", 0.0, 0, 1, -3.0), row("kivi:bits=2", 0.5, 1, 0, -1.0),  # answers only where full fails
            row("kvquant:bits=3", 0.0, 1, 1, -0.5), row("kvquant:bits=3", 0.5, 1, 0, 0.0),
            row("kivi:bits=2|kivi:bits=4@10-19", 0.0, 1, 1, -0.1)]
    text = twobit_layers.render(rows)
    assert "### m, 2,048-token prompts (2: prose_needle)" in text
    assert "| kivi:bits=2 | 2 | -2.00 | 0% [0–79] of 1 |" in text  # paired: never credit for full's misses
    assert "| kvquant:bits=3 | 2 | -0.25 | 100% [21–100] of 1 |" in text
    assert "| kivi:bits=2, layers 10-19 as kivi:bits=4 | 1 | -0.10 | 100% [21–100] of 1 |" in text  # no bare "|"
