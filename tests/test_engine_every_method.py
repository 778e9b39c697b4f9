"""Every registered method, and every composition the parser accepts, served by the engine: token for token what
``generate`` gives with the same cache, on models with and without sliding windows, under preemption, beside
drafting lossless requests; the pool empty afterwards."""

import copy

import pytest
import torch
from test_composition_bounds import COMPOSABLE, EVICTIONS, MOVERS
from tiny_models import CONFIGS, VOCAB
from transformers import AutoModelForCausalLM

import kvopt
from kvopt.engine import LLM, SamplingParams
from kvopt.engine.config import EngineConfigError
from kvopt.engine.kv.cache_backed import CacheBackedKV
from kvopt.methods import available
from kvopt.models import load_tokenizer
from kvopt.models.forward import cache_kwargs
from kvopt.models.loading import resolve_model_dir

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
EVERY_METHOD = ["full", *EVICTIONS, *MOVERS]
#: One spec per kind of storage the block layouts cannot hold, for the architectures checked beside llama.
OTHER_ARCHS = [
    "kvzip:ratio=0.5", "aquakv:residual=32,group=16,calibration=96", "rocketkv:ratio=0.5", "minicache:start=0.3",
    "snapkv:ratio=0.5+kivi:bits=4,residual=32", "pyramidkv:ratio=0.5", "fastkv:ratio=0.5", "surprisal:ratio=0.5",
]  # fmt: skip


def test_every_registered_method_is_in_the_list():
    assert {spec.partition(":")[0] for spec in EVERY_METHOD} == {cls.name for cls in available()}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    """Tiny models of each family sized to the default model's tokenizer (kvzip builds its reconstruction prompt
    with it), named after the default model's folder so calibrating methods find that tokenizer."""
    built = {}
    for arch in ("llama", "qwen2", "mistral", "gemma2"):
        config = CONFIGS[arch]()
        config.vocab_size = len(tokenizer)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.name_or_path = str(resolve_model_dir(None))
        built[arch] = model
    return built


def prompts(lengths=(90, 140, 60), seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def generate_with_cache(model, tokenizer, spec: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """The reference: ``generate`` with ``kvopt.cache(spec)`` one prompt at a time, a whole-prompt pass first where
    the spec needs one (as :func:`kvopt.generate` runs it)."""
    cache = kvopt.cache(spec, model)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        if cache.needs_prefill_pass:
            cache.prefill(model, ids[:, :-1], tokenizer=tokenizer)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return output[0, len(prompt) :].tolist()


def assert_pool_empty(llm: LLM) -> None:
    assert llm.metrics()["kv_blocks_used"] == 0
    assert all(block.ref_count == 0 for block in llm.engine.block_manager.blocks)


def served_equal(model, tokenizer, spec: str, **options) -> LLM:
    llm = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_method=spec, kv_memory="4MB", max_num_batched_tokens=96,
              **options)  # fmt: skip
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [out.error for out in outputs] == [None] * 3
    expected = [generate_with_cache(model, tokenizer, spec, prompt) for prompt in prompts()]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert_pool_empty(llm)
    return llm


@pytest.mark.parametrize("spec", EVERY_METHOD)
def test_every_method_equals_generate(spec, models, tokenizer):
    served_equal(models["llama"], tokenizer, spec)


@pytest.mark.parametrize("pair", sorted(COMPOSABLE))
def test_every_accepted_composition_equals_generate(pair, models, tokenizer):
    served_equal(models["llama"], tokenizer, "+".join(pair))


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("spec", OTHER_ARCHS)
def test_other_families_and_sliding_windows(arch, spec, models, tokenizer):
    """Sliding-window layers (mistral, gemma2) and soft-capping (gemma2) included; a method the model cannot run
    (merging needs two adjacent full-attention layers: these tiny models' are all sliding) says why."""
    if spec.startswith("minicache") and arch != "qwen2":
        with pytest.raises(EngineConfigError, match="no adjacent full-attention layer pair"):
            LLM(copy.deepcopy(models[arch]), tokenizer=tokenizer, kv_method=spec, kv_memory="4MB")
        return
    served_equal(models[arch], tokenizer, spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_beside_drafting_lossless_requests(mode, models, tokenizer):
    """A pool too small for all: sequences of their own caches are preempted and come back; lossless requests in the
    same batches draft (prompt lookup) with prefix caching on; every output equals its reference."""
    model = models["llama"]
    specs = ["kvzip:ratio=0.5", "full", "rocketkv:ratio=0.5", "aquakv:residual=32,group=16,calibration=96", "full"]
    chosen = prompts([120, 100, 140, 90, 110], seed=1)
    llm = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory=20 * llm_block_bytes(model), max_model_len=256,
              preemption_mode=mode, speculate="prompt_lookup:k=3,ngram=2", speculate_max_batch=8)  # fmt: skip
    params = [SamplingParams(max_tokens=40, ignore_eos=True, kv_method=spec) for spec in specs]
    outputs = llm.generate(chosen, params, use_tqdm=False)
    assert llm.metrics()["num_preemptions_total"] > 0 and llm.metrics()["spec_decode_num_drafts_total"] > 0
    for spec, prompt, out in zip(specs, chosen, outputs):
        assert out.outputs[0].token_ids == generate_with_cache(model, tokenizer, spec, prompt, 40), spec
    assert_pool_empty(llm)


def llm_block_bytes(model) -> int:
    from kvopt.engine.kv.paged import PagedKVPool
    from kvopt.models.info import ModelInfo

    return PagedKVPool.block_bytes(ModelInfo.from_config(model.config), 16, torch.float32)


@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5", "snapkv:ratio=0.5+kivi:bits=4,residual=32", "pyramidkv:ratio=0.5"])
def test_parallel_samples_of_a_compressed_request_hold_their_own_prompt(spec, models, tokenizer):
    """n > 1 with a compressed method: each completion holds its own compressed prompt, seeded as a fork is, so
    completion i equals a one-completion request seeded ``seed + i``."""
    llm = LLM(copy.deepcopy(models["llama"]), tokenizer=tokenizer, kv_method=spec, kv_memory="4MB")
    prompt = prompts([120])[0]
    sampled = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    (together,) = llm.generate([prompt], SamplingParams(n=3, seed=5, **sampled), use_tqdm=False)
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=5 + i, **sampled) for i in range(3)], use_tqdm=False)
    assert [c.index for c in together.outputs] == [0, 1, 2]
    assert [c.token_ids for c in together.outputs] == [out.outputs[0].token_ids for out in alone]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1
    assert_pool_empty(llm)


def test_own_cache_waits_in_its_blocks(models, tokenizer):
    """Between steps a sequence's own cache is in its blocks: its tensors hold no memory of their own, and it holds
    the blocks its packed bytes fill, no more (half the prompt evicted: the charge fell with it)."""
    model = models["llama"]
    llm = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_method="kvzip:ratio=0.5", kv_memory="4MB")
    engine = llm.engine
    engine.add_request("a", prompts([200])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(2):  # the prompt, then a decode step
        engine.step()
        (seq,) = engine.scheduler.running
        assert isinstance(seq.kv, CacheBackedKV) and seq.kv.parked is not None
        assert seq.kv.cache.nbytes() == 0
        assert len(seq.block_table) == -(-seq.kv.packed_bytes // engine.block_bytes)
        assert seq.kv.packed_bytes < 0.6 * 200 * engine.block_bytes // engine.config.block_size
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(llm)


@pytest.mark.parametrize("spec", ["kvzip:ratio=0.5", "shallowzip:ratio=0.5", "epicache:ratio=0.5"])
def test_a_method_that_needs_the_tokenizer_is_refused_by_an_engine_without_one(spec, models):
    """Refused when the request arrives, with the fix (not failed mid-prompt); a lossless request beside it runs."""
    llm = LLM(copy.deepcopy(models["llama"]), kv_memory="4MB")
    refused, served = llm.generate(
        prompts((90, 60)), [SamplingParams(max_tokens=2, kv_method=spec), GREEDY], use_tqdm=False
    )
    assert refused.error.startswith(f"{spec.split(':')[0]} needs the model's tokenizer")
    assert "pass tokenizer= to kvopt.LLM" in refused.error and refused.outputs[0].token_ids == []
    assert served.error is None and len(served.outputs[0].token_ids) == NEW_TOKENS
    assert_pool_empty(llm)
