"""Layer- and head-wise budgets in the engine (pyramidkv, adakv): head blocks hold their total, swaps are exact.

Equality with ``generate`` for these specs is in tests/test_engine_compressed.py (``SERVED``).
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvopt.engine.kv.paged import PagedKVPool
from kvopt.engine.kv.cache_backed import CacheBackedKV
from kvopt.engine.kv.headwise import HeadwiseKV
from kvopt.engine import LLM, SamplingParams
from kvopt.models.info import ModelInfo
from test_engine_compressed import assert_pool_empty, generate_with_cache, prompts, run_until_decoding
from tiny_models import tiny_model

@pytest.fixture(scope="module")
def models():
    return {arch: tiny_model(arch) for arch in ("llama", "qwen2")}


def head_counts(llm: LLM) -> list[list[int]]:
    (seq,) = llm.engine.scheduler.running
    assert isinstance(seq.kv, HeadwiseKV)
    return [memo.counts() for memo in seq.kv.memos]


@pytest.mark.parametrize(
    ("spec", "uneven"),
    [("pyramidkv:ratio=0.75,window=8", "layers"), ("adakv:ratio=0.75,window=8", "heads")],
)
def test_budgets_that_differ_take_the_blocks_of_their_total(spec, uneven, models):
    """After a 200-token prefill the sequence holds the blocks of its *total* kept tokens (as uniform
    snapkv at the same ratio, + at most one for partly filled head blocks), not of its largest layer or head."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_memory="4MB")
    run_until_decoding(llm, prompts([200])[0], "snapkv:ratio=0.75,window=8")
    uniform = llm.metrics()["kv_blocks_used"]
    llm.engine.abort("r")
    run_until_decoding(llm, prompts([200])[0], spec)
    counts = head_counts(llm)
    largest = max(max(layer) for layer in counts)
    total = sum(map(sum, counts))
    assert total <= 3 * 2 * 50 + 3  # 3 layers x 2 KV heads x 50 kept on average (adakv's shares round)
    held = llm.metrics()["kv_blocks_used"]
    assert held <= uniform + 1
    if uneven == "layers":
        assert counts[0][0] > counts[-1][0]  # the pyramid: the first layer keeps the most
        assert held < -(-largest // 16)  # sized by the largest layer (90 tokens), it would take 6 blocks
    else:
        assert any(len(set(layer)) > 1 for layer in counts)  # heads of a layer keep different numbers
    assert llm.metrics()["kv_bytes_held"] == held * llm.engine.block_bytes
    llm.engine.abort("r")
    assert_pool_empty(llm)


def test_decoding_grows_head_blocks_block_by_block(models):
    """120 decoded tokens add about 120 / 16 blocks to adakv's prefill blocks; all return at the end."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_memory="4MB")
    llm.engine.add_request("r", prompts([150])[0], SamplingParams(max_tokens=120, ignore_eos=True,
                                                                   kv_method="adakv:ratio=0.8"))  # fmt: skip
    held = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        held.append(llm.metrics()["kv_blocks_used"])
    assert held[-1] == 0
    assert held[1] - held[0] <= 1  # one decode step adds at most one block
    assert held[-2] - held[0] in range(120 // 16 - 1, 120 // 16 + 2)


@pytest.mark.parametrize("spec", ["pyramidkv:ratio=0.5", "adakv:ratio=0.6", "snapkv:ratio=0.5+kivi:bits=4,residual=32",
                                  "h2o:budget=48"])  # fmt: skip
def test_swapped_out_compressed_sequences_continue_exactly(spec, models):
    """A pool too small for every sequence swaps some out to host memory; they come back at other block
    ids and every output still equals generate (recompute mode would compress prompt + output anew)."""
    model = models["llama"]
    block_bytes = PagedKVPool.block_bytes(ModelInfo.from_config(model.config), 16, torch.float32)
    llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory=10 * block_bytes, max_model_len=160,
              preemption_mode="swap")  # fmt: skip
    chosen = prompts([100, 120, 110, 90, 105])
    outputs = llm.generate(chosen, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert llm.metrics()["num_preemptions_total"] > 0
    expected = [generate_with_cache(model, spec, prompt, new_tokens=40) for prompt in chosen]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert_pool_empty(llm)


def test_headwise_budgets_with_a_quantizer_run_in_their_own_cache(models):
    """Head blocks hold full precision only: with a quantizer the sequence keeps its own cache (its outputs equal
    generate's: tests/test_engine_every_method.py)."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_method="pyramidkv:ratio=0.5+kivi:bits=4", kv_memory="4MB")
    assert isinstance(llm.engine._compression("pyramidkv:ratio=0.5+kivi:bits=4").new_kv(), CacheBackedKV)


@settings(max_examples=60, deadline=None)
@given(
    table=st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True),
    counts=st.lists(st.integers(0, 40), min_size=6, max_size=6),
)
def test_head_blocks_never_overlap_and_stay_in_their_blocks(table, counts):
    """Whatever each (layer, head) holds, its pool rows are distinct from every other's and lie in the
    sequence's own blocks; a table too small for them fails loudly, never overlaps."""
    info = ModelInfo(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8)
    pool = PagedKVPool(info, 12, 16, torch.float32, "cpu")
    kv = HeadwiseKV([], pool)
    kv.blocks.sync(table)
    needed = sum(-(-count // 16) for count in counts)
    if needed > 6 * len(table):
        with pytest.raises(Exception, match="ran out of head blocks"):
            for count in counts:
                [kv.blocks.take() for _ in range(-(-count // 16))]
        return
    rows = []
    for count in counts:
        head_blocks = [kv.blocks.take() for _ in range(-(-count // 16))]
        rows.append(kv._rows(head_blocks, 0, count))
    every = torch.cat(rows)
    assert every.numel() == sum(counts) == every.unique().numel()
    slot = every % pool.keys[0].shape[1]
    assert set((slot // 16).tolist()) <= set(table)
    kept, empty = kv.blocks.release_empty()
    assert len(kept) == -(-needed // 6) and sorted(kept + empty) == sorted(table)
