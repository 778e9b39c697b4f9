"""Speculative decoding over kvopt caches: greedy equality, exact rollback, the sampling rule, bad input.

Greedy equality runs every proposer (prompt lookup, self-speculation, a draft model) over
representative methods on tiny random models, with a fixed draft length so many drafts are
rejected and rolled back: the tokens must equal ``model.generate`` with the same kvopt cache,
and the cache must then hold what the plain run holds (positions, bytes, scores, values).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt.errors import CacheUsageError, KVOptError
from kvopt.speculative import DraftModel, PromptLookup, Sampler, parse_proposer
from kvopt.speculative.control import MAX_PAUSE, DraftControl, DraftPace
from kvopt.speculative.restore import speculate
from kvopt.speculative.verify import verify

SPECS = [
    "full", "window:size=16", "streamingllm:budget=16", "h2o:budget=16", "tova:budget=16",
    "snapkv:budget=16,window=4", "kivi:bits=4,group=8,residual=8", "minicache:start=0,residual=8",
]  # fmt: skip
NEW_TOKENS = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama")
    kvopt.prepare(model)
    return model


@pytest.fixture(scope="module")
def draft():
    model = tiny_model("llama", seed=1)
    kvopt.prepare(model)
    return model


def repetitive_prompt(seed: int = 3) -> torch.Tensor:
    """50 ids with repeated spans, so prompt lookup finds matches."""
    base = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base[:, :10], base], dim=1)


def plain(model, spec: str, ids: torch.Tensor) -> tuple[list[int], kvopt.KVCache]:
    cache = kvopt.cache(spec, model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[-1] :].tolist(), cache


def part_positions(part) -> list:
    index = part.pair.index if hasattr(part, "pair") else part
    return index.positions.tolist()


def assert_same_state(cache: kvopt.KVCache, reference: kvopt.KVCache) -> None:
    """Same tokens seen and kept (positions per head, in every part), same bytes, same values and scores."""
    assert cache.nbytes() == reference.nbytes()
    for layer, expected in zip(cache.layers, reference.layers):
        assert (layer.seen, layer.seen_real) == (expected.seen, expected.seen_real)
        assert layer.nbytes() == expected.nbytes()
        assert [part_positions(p) for p in layer.parts] == [part_positions(p) for p in expected.parts]
        store, other = layer.store, expected.store
        assert len(store) == len(other)
        if len(store):
            assert torch.equal(store.positions, other.positions)
            torch.testing.assert_close(store.keys, other.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(store.values, other.values, atol=1e-5, rtol=1e-5)
            assert store.extras().keys() == other.extras().keys()
            for name, scores in store.extras().items():  # h2o's accumulated attention
                torch.testing.assert_close(scores, other.extras()[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("proposer", ["prompt_lookup:k=4", "self:layers=1,k=3", "draft"])
def test_greedy_output_and_cache_equal_plain_decoding(target, draft, spec, proposer):
    ids = repetitive_prompt()
    expected, reference = plain(target, spec, ids)
    speculate = DraftModel(draft, cache="window:size=12", k=3) if proposer == "draft" else proposer
    cache = kvopt.cache(spec, target)
    out = kvopt.generate(target, ids, cache=cache, speculate=speculate, max_new_tokens=NEW_TOKENS, adaptive=False, eos_token_id=[])
    assert out.tokens == expected
    assert out.stats.rounds > 0 and out.stats.proposed > out.stats.accepted  # drafts were rolled back
    assert_same_state(cache, reference)


@pytest.mark.parametrize("spec", ["full", "h2o:budget=16", "kivi:bits=4,group=8,residual=8"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])  # mistral: sliding-window layers forget as they go
def test_greedy_equality_on_other_families(spec, arch):
    model = tiny_model(arch)
    kvopt.prepare(model)
    ids = repetitive_prompt(seed=5)
    expected, reference = plain(model, spec, ids)
    cache = kvopt.cache(spec, model)
    out = kvopt.generate(model, ids, cache=cache, speculate="prompt_lookup:k=5,ngram=2", max_new_tokens=NEW_TOKENS,
                         adaptive=False, eos_token_id=[])  # fmt: skip
    assert out.tokens == expected
    assert_same_state(cache, reference)


@pytest.mark.parametrize("spec", ["full", "h2o:budget=16", "kivi:bits=4,group=8,residual=8", "minicache:start=0,residual=8"])
def test_a_block_left_without_commit_leaves_no_trace(target, spec):
    ids = repetitive_prompt()
    cache, untouched = kvopt.cache(spec, target), kvopt.cache(spec, target)
    for each in (cache, untouched):
        target(input_ids=ids, past_key_values=each, use_cache=True)
    with speculate(cache):
        target(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), past_key_values=cache, use_cache=True)
    assert_same_state(cache, untouched)


@pytest.mark.parametrize("spec", ["kivi:bits=4,group=8,residual=8", "minicache:start=0,residual=8", "h2o:budget=16"])
@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_commit_keeps_what_plain_steps_of_the_accepted_tokens_hold(target, spec, accepted):
    """A block of 7 tokens through the cache API (beyond kivi's and minicache's block limit: then one
    token at a time), committed partly or wholly, equals feeding the accepted tokens one by one."""
    ids, block = repetitive_prompt(), [5, 6, 7, 8, 9, 10, 11]
    cache, reference = kvopt.cache(spec, target), kvopt.cache(spec, target)
    for each in (cache, reference):
        target(input_ids=ids, past_key_values=each, use_cache=True)
    for token in block[:accepted]:
        target(input_ids=torch.tensor([[token]]), past_key_values=reference, use_cache=True)
    with speculate(cache) as opened:
        target(input_ids=torch.tensor([block]), past_key_values=cache, use_cache=True)
        opened.commit(accepted)
    assert_same_state(cache, reference)


def test_a_draft_model_equal_to_the_target_is_always_accepted(target):
    out = kvopt.generate(target, repetitive_prompt(), speculate=DraftModel(target, k=4), max_new_tokens=21,
                         adaptive=False, eos_token_id=[])  # fmt: skip
    stats = out.stats
    assert len(out.tokens) == 21
    assert stats.proposed == stats.accepted == 16 and stats.rounds == 4  # 4 rounds of 4 drafts + 1 token each
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 4.0


def test_prompt_lookup_copies_the_latest_match():
    lookup = PromptLookup(k=3, ngram=2)
    assert lookup.propose([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], 3) == ([5, 6, 2], None)  # the bigram 2 3, latest
    assert lookup.propose([1, 2, 3, 4, 7], 3) == ([], None)
    assert lookup.propose([4, 8, 8, 4], 3) == ([8, 8, 4], None)  # a unigram when no bigram matches


# -- the sampling rule ---------------------------------------------------------------------------------
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (bins expected below 5 are pooled)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def next_token_probs(model, ids: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    with torch.no_grad():
        return sampler.probs(model(input_ids=ids).logits[0, -1:])[0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_verification_emits_the_targets_distribution(target, draft, deterministic):
    sampler = Sampler(temperature=1.5, seed=0)
    ids = repetitive_prompt()
    p, q = next_token_probs(target, ids, sampler), next_token_probs(draft, ids, sampler)
    draws = 20000
    counts, drafted = torch.zeros(VOCAB), torch.zeros(VOCAB)
    likely = int(p.argmax())
    for _ in range(draws):
        token = likely if deterministic else sampler.draw(q)
        accepted, following = verify(sampler, torch.stack([p, p]), [token], None if deterministic else q[None])
        counts[token if accepted else following] += 1
        drafted[token] += 1
    assert chi_square_p_value(counts, p) > 1e-3
    if not deterministic:  # the test has power: the drafts alone do not pass as the target's distribution
        assert chi_square_p_value(drafted, p) < 1e-6


def test_sampler_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    torch.testing.assert_close(Sampler(temperature=1.0).probs(logits), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(Sampler(temperature=1.0, top_k=2).probs(logits), torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(Sampler(temperature=1.0, top_p=0.7).probs(logits), torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(Sampler(temperature=1.0, top_p=0.5).probs(logits), torch.tensor([[1.0, 0, 0, 0]]))
    assert Sampler().probs(logits).tolist() == [[1.0, 0, 0, 0]]  # greedy: one-hot on the argmax
    with pytest.raises(KVOptError, match="top_p=1.5"):
        Sampler(temperature=1.0, top_p=1.5)


def test_speculative_sampling_matches_the_target_end_to_end(target, draft):
    """The first two tokens (the second from a verified round) follow the target's joint distribution."""
    sampler = Sampler(temperature=1.0, top_k=4)
    ids = repetitive_prompt()
    first = next_token_probs(target, ids, sampler)
    joint = torch.zeros(VOCAB, VOCAB)
    for token in first.nonzero().flatten().tolist():
        joint[token] = first[token] * next_token_probs(target, torch.cat([ids, torch.tensor([[token]])], 1), sampler)
    counts = torch.zeros(VOCAB * VOCAB)
    speculate = DraftModel(draft, k=2)
    for seed in range(1500):
        out = kvopt.generate(target, ids, speculate=speculate, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed,
                             adaptive=False, eos_token_id=[])  # fmt: skip
        counts[out.tokens[0] * VOCAB + out.tokens[1]] += 1
    assert chi_square_p_value(counts, joint.flatten()) > 1e-3


# -- adaptive control --------------------------------------------------------------------------------
def test_speculation_pauses_while_rounds_are_slower_than_plain_steps():
    control = DraftControl(k=4)
    assert control.next_length(10) == 0  # a plain step is timed first
    control.after_step(0.010)
    assert control.next_length(10) == 4
    control.after_round(proposed=4, accepted=0, seconds=0.012)  # 1 token in 12 ms: 0.2 steps' time lost
    assert [control.next_length(10) for _ in range(5)] == [0, 0, 0, 0, 3]  # paused 0.2 / 5% = 4 steps, shorter probe
    control.after_round(proposed=3, accepted=3, seconds=0.014)  # 4 tokens in 14 ms: speculation pays
    assert control.next_length(10) == 4 and control.next_length(2) == 2
    control.after_round(proposed=4, accepted=0, seconds=0.016)  # one poor round among good ones: averaged
    assert control.pause == 0
    costly = DraftControl(k=3)
    costly.after_step(0.010)
    costly.after_round(proposed=3, accepted=0, seconds=0.0349)  # a deep self-speculative draft: ~2.5 steps lost
    assert costly.pause == 50  # probes again after 50 plain steps: 2.5 / 50 = 5% overhead


def test_a_batched_sequence_pauses_drafting_after_wholly_rejected_drafts():
    """The engine's per-sequence rule: length follows acceptance; a draft rejected whole pauses 1, 2, 4, ... steps
    (at most MAX_PAUSE), and any accepted token ends the backoff."""
    pace = DraftPace(4)
    assert pace.next_length() == 4
    pace.after_verification(4, proposed=4, accepted=2)  # partly accepted: one shorter, no pause
    assert pace.next_length() == 3
    pauses = []
    for _ in range(10):  # nothing accepted, again and again
        pace.after_verification(4, proposed=pace.length, accepted=0)
        steps = 0
        while pace.next_length() == 0:
            steps += 1
        pauses.append(steps)
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 128, MAX_PAUSE, MAX_PAUSE] and pace.length == 1
    pace.after_verification(4, proposed=1, accepted=1)  # accepted whole: one longer, the backoff starts over
    assert (pace.next_length(), pace.backoff) == (2, 1)


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lookahead:k=4", "unknown speculation 'lookahead'"),
        ("prompt_lookup:k=four", "integers"),
        ("prompt_lookup:depth=3", "bad parameter 'depth=3'"),
        ("prompt_lookup:k=0", "must be >= 1"),
        ("draft:k=4", "name the draft model"),
    ],
)
def test_bad_speculation_specs_name_the_fix(spec, message):
    with pytest.raises(KVOptError, match=message):
        parse_proposer(spec)


def test_draft_cache_spec_may_hold_commas():
    proposer = parse_proposer("draft:model=some/path,k=2,cache=snapkv:budget=64,window=8")
    assert (proposer.model, proposer.k, proposer.cache) == ("some/path", 2, "snapkv:budget=64,window=8")


def test_misuse_is_refused(target):
    ids = repetitive_prompt()
    with pytest.raises(KVOptError, match="one non-empty prompt"):
        kvopt.generate(target, ids.repeat(2, 1))
    with pytest.raises(KVOptError, match="below the model's 3 layers"):
        kvopt.generate(target, ids, speculate="self:layers=3")
    used = kvopt.cache("full", target)
    target(input_ids=ids, past_key_values=used, use_cache=True)
    with pytest.raises(KVOptError, match="fresh kvopt cache"):
        kvopt.generate(target, ids, cache=used)
    other = tiny_model("llama")
    other.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(KVOptError, match="same family"):
        kvopt.generate(target, ids, speculate=DraftModel(other))
    cache = kvopt.cache("full", target)
    with speculate(cache) as opened:
        with pytest.raises(CacheUsageError, match="already open"), speculate(cache):
            pass
        target(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
        with pytest.raises(CacheUsageError, match="holds 3 provisional tokens"):
            opened.commit(4)
    assert cache.get_seq_length() == 0  # left without a commit: none kept
    with pytest.raises(CacheUsageError, match="needs an open speculative block"):
        opened.commit(1)
    batch = kvopt.cache("full", target)
    with pytest.raises(CacheUsageError, match="batch of 1"), speculate(batch):
        target(input_ids=ids[:, :3].repeat(2, 1), past_key_values=batch, use_cache=True)
    assert batch.get_seq_length() == 0  # the failed block left nothing behind


def test_only_methods_that_never_read_queries_while_decoding_verify_a_block_at_once(target):
    """The others (decode-time eviction) attend a block one token at a time."""
    for spec, at_once in [("full", True), ("snapkv:ratio=0.5", True), ("window:ratio=0.5", True), ("kivi:bits=4", True),
                          ("minicache:start=0", True), ("window:size=16", False), ("h2o:budget=16", False)]:  # fmt: skip
        assert kvopt.cache(spec, target).methods[0].verifies_at_once is at_once
