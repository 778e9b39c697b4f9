"""Compressed blocks in the engine: methods run unchanged, equal generate with the same cache, and free blocks."""

import copy

import pytest
import torch

import kvopt
from kvopt.engine.kv.paged import DecodeGroup, PagedKVPool
from kvopt.engine.kv import compressed
from kvopt.engine.kv.compressed import CodeFormat
from kvopt.cache import quantized
from kvopt.cache.quantized import QuantizedKV
from kvopt.engine import LLM, SamplingParams
from kvopt.errors import CacheUsageError
from kvopt.models.info import ModelInfo
from tiny_models import VOCAB, tiny_model

NEW_TOKENS = 12
LENGTHS = [40, 90, 130, 200, 17, 64, 1]  # a one-token prompt too: its one query attends to its own key
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
SERVED = [
    "snapkv:ratio=0.5",
    "kivi:bits=4,residual=32",
    "kivi:bits=2",
    "snapkv:ratio=0.75+kivi:bits=4,residual=32",
    "h2o:budget=48",
    "tova:budget=40",
    "streamingllm:budget=40",
    "window:size=50",
    "knorm:ratio=0.5",
    "morphkv:budget=40",
    # budgets per layer or head, in head blocks (tests/test_engine_headwise.py)
    "pyramidkv:ratio=0.5",
    "adakv:ratio=0.5",
    "adakv:ratio=0.9,scorer=tova",
    "h2o:budget=50+pyramidkv:ratio=0.6,window=8",  # decode-time eviction rewrites a layer's head blocks
]


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def generate_with_cache(model, spec: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """The reference: HF generate with kvopt's cache for ``spec``, one prompt at a time."""
    output = model.generate(
        torch.tensor([prompt]), past_key_values=kvopt.cache(spec, model), max_new_tokens=new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_model(arch) for arch in ("llama", "qwen2")}


def assert_pool_empty(llm: LLM) -> None:
    assert llm.metrics()["kv_blocks_used"] == 0
    assert all(block.ref_count == 0 for block in llm.engine.block_manager.blocks)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", SERVED)
def test_engine_equals_generate_with_the_same_cache(arch, spec, models):
    """Six prompts together, prefills beside decodes: every output equals generate with ``kvopt.cache(spec)``."""
    model = models[arch]
    llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory="4MB", max_num_batched_tokens=96)
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [generate_with_cache(model, spec, p) for p in prompts()]
    assert_pool_empty(llm)


def test_decode_steps_where_kivi_has_nothing_to_quantize_build_no_layer(models, monkeypatch):
    """KIVI acts when its residual fills: on the other decode steps the engine asks it (idle_after_attention) and
    skips its after_attention; the outputs still equal generate's (above), and it still quantizes on time."""
    from kvopt.methods.kivi import KIVI

    calls = []
    original = KIVI.after_attention
    def counted(self, layer, step) -> None:
        calls.append(len(layer.store))
        original(self, layer, step)

    monkeypatch.setattr(KIVI, "after_attention", counted)
    spec = "kivi:bits=4,residual=32"
    model = models["llama"]
    llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory="4MB")
    new_tokens = 40
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    prompt = prompts([50])[0]
    output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine_calls = list(calls)
    assert output == generate_with_cache(model, spec, prompt, new_tokens)
    layers = model.config.num_hidden_layers
    decode_calls = engine_calls[layers:]  # after the prompt's pass, one per layer
    assert decode_calls and all(held >= 32 for held in decode_calls)  # only where the residual filled
    assert len(decode_calls) < layers * (new_tokens - 1) // 4


def test_methods_chosen_per_request(models):
    """One lossless engine serves requests naming their own methods; each equals its own reference."""
    model = models["llama"]
    llm = LLM(copy.deepcopy(model), kv_memory="4MB", max_num_batched_tokens=128)
    specs = ["full", "snapkv:ratio=0.75+kivi:bits=4,residual=32", "h2o:budget=48", None, "kivi:bits=2,residual=32"]
    chosen = prompts([120, 70, 150, 33, 96])
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, kv_method=spec) for spec in specs]
    outputs = llm.generate(chosen, params, use_tqdm=False)
    for spec, prompt, output in zip(specs, chosen, outputs):
        assert output.outputs[0].token_ids == generate_with_cache(model, spec or "full", prompt), spec
    assert_pool_empty(llm)


@pytest.mark.parametrize("blocks", ["one", "group-sized"])
def test_quantized_groups_of_two_formats_and_ragged_lengths_are_read_together(models, monkeypatch, blocks):
    """Decoding sequences' quantized groups are read in one batch per code format, padded to the longest: 4-bit
    and 2-bit kivi requests of different lengths, decoding together, each equal generate (also when attention
    dequantizes them a group at a time, so that some blocks are all padding for the shorter sequence)."""
    model = models["llama"]
    if blocks == "group-sized":
        monkeypatch.setattr(quantized, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(compressed, "MAX_PADDING", 10.0)  # one read per format, however ragged
    batched: list[list[int]] = []
    of = DecodeGroup.of

    def recorded(*args, **kwargs):
        group = of(*args, **kwargs)
        if group is not None:
            batched.append(sorted(len(members) for members, _ in group.coded))
        return group

    monkeypatch.setattr(DecodeGroup, "of", staticmethod(recorded))
    llm = LLM(copy.deepcopy(model), kv_memory="4MB", max_num_batched_tokens=512)
    specs = ["kivi:bits=4,residual=32", "kivi:bits=2,residual=32"] * 2
    chosen = prompts([70, 130, 200, 96])
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, kv_method=spec) for spec in specs]
    outputs = llm.generate(chosen, params, use_tqdm=False)
    for spec, prompt, output in zip(specs, chosen, outputs):
        assert output.outputs[0].token_ids == generate_with_cache(model, spec, prompt), spec
    assert [2, 2] in batched  # both formats, two sequences each, in one decode step
    assert_pool_empty(llm)


def test_batched_reads_of_quantized_groups_pad_little_and_stay_bounded(monkeypatch):
    """Sequences are read together only within one code format, when the longest is at most MAX_PADDING times the
    shortest, and up to MAX_BATCH_GROUPS padded groups a read."""
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    four, two = (CodeFormat.probe(info, torch.float32, 16, bits, 32, "channel") for bits in (4, 2))

    def coded(fmt: CodeFormat, groups: int) -> compressed.CodedTokens:
        return compressed.CodedTokens(None, fmt, (torch.zeros(groups, dtype=torch.long),) * 2)

    codes = [coded(four, 10), coded(two, 10), coded(four, 30), coded(four, 12), coded(four, 36)]
    assert sorted(indices for indices, _ in compressed.CodedTokens.batches(codes)) == [[0, 3], [1], [2, 4]]
    monkeypatch.setattr(compressed, "MAX_BATCH_GROUPS", 40)
    assert sorted(indices for indices, _ in compressed.CodedTokens.batches(codes)) == [[0, 3], [1], [2], [4]]
    (_, read), = compressed.CodedTokens.batches([codes[0], codes[3]])
    assert read.where[0].shape == (2, 12) and read.valid[:, 0].sum(-1).tolist() == [320, 384]


def run_until_decoding(llm: LLM, prompt: list[int], spec: str) -> None:
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=200, ignore_eos=True, kv_method=spec))
    llm.engine.step()  # the prefill


@pytest.mark.parametrize(
    ("spec", "blocks"),
    [
        ("full", 13),  # 200 tokens in blocks of 16
        ("snapkv:ratio=0.75", 4),  # 50 kept
        ("kivi:bits=4,residual=32", 4),  # 6 groups of 32 (2 per block at head_dim 16) + 8 full-precision tokens
        ("snapkv:ratio=0.75+kivi:bits=4,residual=32", 3),  # 50 kept: 1 group (1 block) + 18 tokens (2 blocks)
    ],
)
def test_compressed_prompt_takes_fewer_blocks(spec, blocks, models):
    """After the prefill the pool holds what the method keeps: exactly the blocks its layout needs."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_memory="4MB")
    run_until_decoding(llm, prompts([200])[0], spec)
    metrics = llm.metrics()
    assert metrics["kv_blocks_used"] == blocks
    assert metrics["kv_bytes_held"] == blocks * llm.engine.block_bytes
    saved = 0 if spec == "full" else 200 * llm.engine.block_bytes // 16 - blocks * llm.engine.block_bytes
    assert metrics["kv_bytes_saved_by_compression"] == saved
    llm.engine.abort("r")
    assert_pool_empty(llm)


def test_decode_time_eviction_frees_blocks_as_it_goes(models):
    """h2o with a 40-token budget decodes 120 tokens in at most 3 blocks (40 kept + the newest)."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_memory="4MB")
    llm.engine.add_request("r", prompts([30])[0], SamplingParams(max_tokens=120, ignore_eos=True, kv_method="h2o:budget=40"))
    held = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        held.append(llm.metrics()["kv_blocks_used"])
    assert max(held) == 3 and held[-1] == 0
    assert len(held) == 120


def test_compressed_sequences_fit_more_per_pool(models):
    """The same pool runs 3x as many snapkv:ratio=0.75 or 4-bit kivi sequences at once as lossless ones."""
    model = models["llama"]
    block_bytes = PagedKVPool.block_bytes(ModelInfo.from_config(model.config), 16, torch.float32)
    concurrency = {}
    for spec in ("full", "snapkv:ratio=0.75", "kivi:bits=4,residual=32"):
        llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory=30 * block_bytes, max_model_len=256)
        for index, prompt in enumerate(prompts([208] * 8)):
            llm.engine.add_request(str(index), prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        most = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            most = max(most, llm.metrics()["num_requests_running"])
        concurrency[spec] = most
        assert_pool_empty(llm)
    assert concurrency["full"] == 2  # 14 blocks each (with the decoded tokens) in 30
    assert concurrency["snapkv:ratio=0.75"] >= 3 * concurrency["full"]
    # 208 tokens: 6 groups in 3 code blocks (2 per block at head_dim 16) + 16 tokens, + 24 decoded
    assert concurrency["kivi:bits=4,residual=32"] >= 3 * concurrency["full"]


@pytest.mark.parametrize("spec", ["h2o:budget=64", "pyramidkv:ratio=0.5"])  # uniform and head-wise budgets
def test_preemption_of_compressed_sequences(spec, models):
    """A pool too small for every sequence preempts some (recomputed); all finish, nothing leaks."""
    model = models["llama"]
    block_bytes = PagedKVPool.block_bytes(ModelInfo.from_config(model.config), 16, torch.float32)
    llm = LLM(copy.deepcopy(model), kv_method=spec, kv_memory=16 * block_bytes, max_model_len=250)
    outputs = llm.generate(prompts([100, 120, 140, 90, 110]), SamplingParams(max_tokens=100, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
    assert llm.metrics()["num_preemptions_total"] > 0
    assert all(len(out.outputs[0].token_ids) == 100 and out.error is None for out in outputs)
    assert_pool_empty(llm)


def test_an_unknown_method_is_refused_where_the_request_is_written():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        SamplingParams(max_tokens=4, kv_method="nope")


def test_code_blocks_round_trip_groups_exactly():
    """Groups written into code blocks read back bit for bit, several per block, at any group index."""
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    pool = PagedKVPool(info, 12, 16, torch.float32, "cpu")
    code_format = CodeFormat.probe(info, torch.float32, 16, 4, 32, "channel")
    assert code_format.groups_per_block == 2  # 320 key bytes and 320 value bytes per group in 1,024-byte blocks
    keys, values = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    positions = torch.arange(96, dtype=torch.int32).expand(1, 2, 96)
    part = QuantizedKV.encode(keys, values, positions, torch.ones(1, 2, 96, dtype=torch.bool), 4, 32, "channel")
    table = [7, 3]
    code_format.write(pool, 1, part, code_format.locate(table, 1, 3, "cpu"))  # groups 1-3: block 7 slot 1, block 3
    back = code_format.read(pool, 1, code_format.locate(table, 1, 3, "cpu"))
    for original, read in zip(part.dequantize(), back.dequantize()):
        assert torch.equal(original, read)
    assert not pool.keys[0].any()  # other layers untouched


def test_code_format_needs_groups_aligned_with_blocks():
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(CacheUsageError, match="block_size that divides the group"):
        CodeFormat.probe(info, torch.float32, 64, 4, 32, "channel")
