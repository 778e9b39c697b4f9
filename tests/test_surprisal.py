"""surprisal: the kept tokens against a slow reference (full HF logits), real savings, batches, replay, errors."""

import pytest
import torch

import kvopt
from kvopt.errors import CacheUsageError
from kvopt.methods.recording import record_prefill
from bounds import prefill_and_decode
from conftest import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_information(reference, ids: torch.Tensor, pool: int, pooling: str = "max") -> torch.Tensor:
    """Per token ``[n]``: -log p(x_s | x_<s) within ``pool`` tokens, from the plain HF model's full logits, pooled by
    max or mean (the first token, which nothing predicts, counts 0; a mean pads the ends with zeros)."""
    with torch.no_grad():
        logits = reference(ids).logits[0].float()  # [n, vocab], softcapping included where the family has it
    n = ids.shape[1]
    surprisal = [0.0] + [float(torch.logsumexp(logits[t - 1], -1) - logits[t - 1, ids[0, t]]) for t in range(1, n)]
    windows = [surprisal[max(0, t - pool) : t + pool + 1] for t in range(n)]
    if pooling == "max":
        return torch.tensor([max(window) for window in windows])
    return torch.tensor([sum(window) / (2 * pool + 1) for window in windows])


@pytest.mark.parametrize("pooling, window", [("max", 3), ("mean", 3), ("max", 10)])
def test_surprisal_keeps_the_tokens_the_reference_finds_least_predictable(model_pair, pooling, window):
    """Every family (softcapped logits, sliding layers): in each full-attention layer the kept tokens are the
    sinks, the window (at most a quarter of the budget: 4 of 16) and the best-scored others, scored from HF's
    own logits."""
    reference, model = model_pair
    n, keep, sinks = 40, 16, 2
    ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(7))
    spec = f"surprisal:budget={keep},sinks={sinks},window={window},pool=2,pooling={pooling},chunk=16"
    cache = kvopt.cache(spec, model)
    cache.prefill(model, ids)
    scores = reference_information(reference, ids, pool=2, pooling=pooling)
    protected = set(range(sinks)) | set(range(n - min(window, keep // 4), n))
    for layer in cache.layers:
        if layer.sliding_window is not None:  # holds only what its window still attends to
            assert set(layer.store.positions[0, 0].tolist()) <= set(range(n - layer.sliding_window, n))
            continue
        kept = layer.store.positions[0, 0].tolist()
        assert len(kept) == keep and protected <= set(kept)
        assert all(torch.equal(layer.store.positions[0, h], layer.store.positions[0, 0]) for h in range(2))
        chosen, dropped = set(kept) - protected, set(range(n)) - set(kept)
        # The worst kept token scores at least as high as the best dropped one (up to float noise between
        # HF's attention and kvopt's: near-ties may swap).
        assert min(scores[t] for t in chosen) >= max(scores[t] for t in dropped) - 1e-4


def test_surprisal_frees_memory(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, 400), generator=torch.Generator().manual_seed(2))
    full, cache = kvopt.cache("full", model), kvopt.cache("surprisal:ratio=0.75", model)
    full.prefill(model, context)
    cache.prefill(model, context)
    assert [s.kept for s in cache.stats()] == [100] * len(cache.layers)
    assert cache.get_seq_length() == 400 and cache.prompt_states is None  # the hidden states are not kept
    assert cache.nbytes() < 0.3 * full.nbytes()


def test_surprisal_batch_rows_keep_what_they_keep_alone():
    from tiny_models import tiny_model

    model = tiny_model("llama")
    kvopt.prepare(model)
    lengths = [48, 30]
    ids, mask = random_batch(lengths, seed=3)
    spec = "surprisal:ratio=0.5,window=4"
    batch = kvopt.cache(spec, model)
    batch.prefill(model, ids, attention_mask=mask)
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        alone = kvopt.cache(spec, model)
        alone.prefill(model, ids[row : row + 1, width - length :])
        for ours, theirs in zip(batch.layers, alone.layers):
            valid = ours.store.valid[row, 0]
            assert valid.sum() == length // 2
            shifted = ours.store.positions[row, 0][valid] - (width - length)  # slots count the row's padding
            assert shifted.tolist() == theirs.store.positions[0, 0].tolist()


def test_surprisal_replayed_equals_direct_and_decodes(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (1, 120), generator=torch.Generator().manual_seed(4))
    direct = kvopt.cache("surprisal:ratio=0.5", model)
    direct.prefill(model, ids)
    recorded, _ = record_prefill(model, ids)
    replayed = kvopt.cache("surprisal:ratio=0.5", model)
    replayed.replay_prefill(recorded)
    replayed.after_prefill(model, ids)
    for ours, theirs in zip(replayed.layers, direct.layers):
        assert torch.equal(ours.store.positions, theirs.store.positions)
    assert kvopt.cache("full", model).prompt_states is None  # only a cache whose methods read the states gets them
    prefill_and_decode(model, kvopt.cache("surprisal:ratio=0.5", model), ids, new_tokens=4, tokenizer=tokenizer)


def test_surprisal_prefill_returns_the_last_logits_only(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (1, 50), generator=torch.Generator().manual_seed(5))
    assert kvopt.cache("surprisal:ratio=0.5", model).prefill(model, ids).logits.shape[1] == 1


def test_surprisal_needs_the_prefill_states_and_an_empty_cache(tiny_with_tokenizer):
    model, _ = tiny_with_tokenizer
    ids = torch.randint(100, 5000, (1, 50), generator=torch.Generator().manual_seed(6))
    cache = kvopt.cache("surprisal:ratio=0.5", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)  # a plain forward captures no hidden states
    with pytest.raises(CacheUsageError, match="cache.prefill"):
        cache.after_prefill(model, ids)
    with pytest.raises(CacheUsageError, match="empty cache"):
        cache.prefill(model, ids[:, :10])


@pytest.mark.parametrize(
    "spec",
    [
        "surprisal:ratio=0.5,sinks=-1",
        "surprisal:ratio=0.5,pool=-2",
        "surprisal:ratio=0.5,pooling=median",
        "surprisal:ratio=2",
    ],
)
def test_surprisal_rejects_bad_parameters(spec):
    with pytest.raises(kvopt.errors.MethodParameterError, match="surprisal"):
        kvopt.methods.parse(spec)

