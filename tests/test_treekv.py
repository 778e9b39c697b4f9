"""treekv: the pairwise cyclic rule against a slow reference, sparse-far/dense-near density, bounded bytes, batches.

The reference replays each layer's tapped attention inputs (see ``test_eviction_decode``) through a
plain-Python TreeKV: per (row, KV head) a dictionary of tokens, accumulated attention S and the count N
of real queries that saw each token (counted, not derived), the block-level rule at the prefill and
one pair decision per token over budget while decoding, with one cyclic pointer per row.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_engine_compressed import (
    test_engine_equals_generate_with_the_same_cache as check_engine,
)
from test_eviction_decode import REFERENCES, Reference
from test_eviction_decode import test_bad_parameters_say_what_to_do as check_refused
from test_eviction_decode import (
    test_batch_rows_match_single_runs_and_padding_is_never_kept as check_batch,
)
from test_eviction_decode import (
    test_compress_every_lets_the_cache_breathe as check_breathing,
)
from test_eviction_decode import (
    test_fast_path_keeps_what_the_slow_reference_keeps as check_against_reference,
)
from test_eviction_decode import (
    test_generating_keeps_bytes_bounded as check_bounded_bytes,
)
from tiny_models import VOCAB, tiny_model

import kvopt


class TreeKVReference(Reference):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        rows = len(self.keys)
        self.s = [[{} for _ in range(self.kv_heads)] for _ in range(rows)]
        self.n = [[{} for _ in range(self.kv_heads)] for _ in range(rows)]
        self.pointer, self.next_pointer, self.budgets = [0] * rows, [0] * rows, None

    def new_token(self, b, h, position) -> None:
        self.s[b][h][position], self.n[b][h][position] = 0.0, 0

    def forget(self, b, h, position) -> None:
        del self.s[b][h][position], self.n[b][h][position]

    def observe(self, inputs) -> None:
        """Count the queries' attention (the prefill's last ``block`` ones, then every one), and let the tokens
        be chosen only when the store compacts: when its slots exceed the largest target by ``compress_every - 1``."""
        rows, new = len(self.keys), len(inputs["positions"])
        self.prefill, self.pointer = self.budgets is None, list(self.next_pointer)
        if self.prefill:
            self.budgets, self.slots = list(self.targets), 0
        elif self.method.ratio is not None:  # later tokens come on top of the prompt's share
            self.budgets = [budget + new for budget in self.budgets]
        self.slots += new
        compacts = self.slots > max(self.budgets) + self.method.compress_every - 1
        self.slots = min(self.slots, max(self.budgets)) if compacts else self.slots
        self.targets = self.budgets if compacts else [math.inf] * rows
        positions = inputs["positions"]
        counted = range(max(0, len(positions) - self.method.block) if self.prefill else 0, len(positions))
        for b in range(len(self.keys)):
            for t in counted:
                if not inputs["valid"][b, t]:
                    continue
                for h in range(self.kv_heads):
                    visible = [p for p in sorted(self.keys[b][h]) if p <= positions[t]]
                    keys = torch.stack([self.keys[b][h][p] for p in visible])
                    for g in range(self.group):
                        probs = torch.softmax(keys @ inputs["query"][b, h * self.group + g, t] * inputs["scale"], dim=0)
                        for p, prob in zip(visible, probs.tolist()):
                            self.s[b][h][p] += prob / self.group
                    for p in visible:
                        self.n[b][h][p] += 1

    def regions(self, target: int) -> tuple[int, int, int]:
        sinks = min(self.method.sinks, target)
        recent = max(target // 2 - self.method.sinks, 0) if self.method.window is None else self.method.window
        recent = min(recent, target - sinks)
        return sinks, recent, target - sinks - recent

    def importance(self, b, h, p) -> float:
        return self.s[b][h][p] / self.n[b][h][p]

    def choose(self, b, h, kept, target) -> list[int]:
        """Positions kept; the row's pointer after the decisions takes effect at the next step."""
        sinks, recent, tree = self.regions(target)
        if self.prefill:
            kept, self.next_pointer[b] = self.blocks(b, h, kept, sinks, recent, tree)
            return kept
        kept, pointer = list(kept), self.pointer[b]
        while len(kept) > target:
            region = kept[sinks : len(kept) - recent]
            left, right = region[pointer], region[pointer + 1]
            kept.remove(left if self.importance(b, h, left) <= self.importance(b, h, right) else right)
            pointer = (pointer + 1) % tree
        self.next_pointer[b] = pointer
        return kept

    def blocks(self, b, h, kept, sinks, recent, tree) -> tuple[list[int], int]:
        block = self.method.block
        candidates = kept[sinks : len(kept) - recent]
        blocks = [candidates[i : i + block] for i in range(0, len(candidates), block)]
        score = [sum(self.importance(b, h, p) for p in members) / len(members) for members in blocks]
        capacity, pointer = tree // block, 0
        region = list(range(capacity))
        for arriving in range(capacity, len(blocks) if capacity else 0):
            region.append(arriving)
            left, right = region[pointer], region[pointer + 1]
            region.remove(left if score[left] <= score[right] else right)
            pointer = (pointer + 1) % capacity
        in_tree = [p for index in region for p in blocks[index]]
        others = [p for p in candidates if p not in in_tree]
        fill = others[len(others) - (tree - len(in_tree)) :] if tree > len(in_tree) else []
        return kept[:sinks] + in_tree + fill + kept[len(kept) - recent :], (pointer * block % tree if tree else 0)


REFERENCES["treekv"] = TreeKVReference  # the shared replay compares every forward, row and KV head


@pytest.mark.parametrize(
    "spec",
    [
        "treekv:budget=16,sinks=2,window=4,block=3",  # prefill: 2 block decisions and a fill; decode: pointer mod 10
        "treekv:budget=12,block=2",  # default window (12 // 2 - 4 = 2), sinks 4, tree 6
        "treekv:budget=9,sinks=2,window=3,block=5,compress_every=3",  # block larger than the tree; 3 pairs at once
        "treekv:ratio=0.8,block=2",  # rows keep 4, 2 and 1 tokens at the prefill: sinks only, no tree
    ],
)
def test_fast_path_keeps_what_the_slow_reference_keeps(spec):
    check_against_reference(spec)


def test_density_falls_smoothly_from_near_to_far():
    """After a long generation the tree region is sparse far away and dense near (unlike a global top-k)."""
    model = tiny_model("llama")
    cache = kvopt.cache("treekv:budget=96,window=16,sinks=4", model)
    ids = torch.randint(3, VOCAB, (1, 500), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache)
        for t in range(40, 500):
            model(ids[:, t : t + 1], past_key_values=cache)
    for layer in cache.layers:
        for head in range(layer.store.keys.shape[1]):
            tree = layer.store.positions[0, head].tolist()[4:-16]
            assert len(tree) == 76
            gaps = [b - a for a, b in itertools.pairwise(tree)]
            thirds = len(gaps) // 3
            far, near = sum(gaps[:thirds]) / thirds, sum(gaps[-thirds:]) / thirds
            assert far > 2 * near, (far, near)


def test_generating_keeps_bytes_bounded():
    check_bounded_bytes("treekv:budget=32")


def test_compress_every_makes_several_pair_decisions_per_compaction():
    check_breathing("treekv:budget=16,sinks=2,compress_every=8")


def test_batch_rows_match_single_runs_and_padding_is_never_kept():
    check_batch("treekv:budget=8,sinks=2,block=2")


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("treekv", "exactly one of ratio"),
        ("treekv:budget=8,sinks=4,window=4", "must leave room for the tree"),
        ("treekv:budget=4", "must leave room for the tree"),
        ("treekv:budget=32,block=0", "block=0"),
        ("treekv:ratio=0.5,sinks=-1", "sinks=-1"),
    ],
)
def test_bad_parameters_say_what_to_do(spec, fragment):
    check_refused(spec, fragment)


def test_the_serving_engine_runs_it_unchanged():
    """Same tokens as generate with the same cache (the engine shows methods a one-sequence layer)."""
    check_engine("llama", "treekv:budget=40,block=4", {"llama": tiny_model("llama")})
