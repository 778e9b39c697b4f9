"""kvopt.LLM: greedy outputs equal HF generate per prompt, under prefix caching, preemption and forks."""

import copy

import pytest
import torch

from kvopt.cache import attention
from kvopt.engine import LLM, EngineConfig, RequestError, SamplingParams, model_runner
from kvopt.engine.config import EngineConfigError, parse_memory
from kvopt.engine.sampling_params import SamplingParamsError
from tiny_models import VOCAB, tiny_model

NEW_TOKENS = 8


def mixed_prompts(count: int, seed: int = 3, shared: int = 0) -> list[list[int]]:
    """``count`` prompts of 2-60 tokens; with ``shared``, every prompt starts with the same tokens."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (shared,), generator=generator).tolist()
    lengths = torch.randint(2, 60, (count,), generator=generator).tolist()
    return [head + torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references():
    """Per architecture: (HF model, prompts, HF greedy continuations), computed once."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = tiny_model(arch)
            prompts = mixed_prompts(32, shared=0) + mixed_prompts(8, seed=5, shared=40)
            cache[arch] = (model, prompts, [hf_greedy(model, prompt) for prompt in prompts])
        return cache[arch]

    return get


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(model, **options) -> LLM:
    options.setdefault("kv_memory", "4MB")
    options.setdefault("max_num_batched_tokens", 96)
    return LLM(copy.deepcopy(model), **options)


def assert_pool_empty(llm: LLM) -> None:
    metrics = llm.metrics()
    assert metrics["kv_blocks_used"] == 0
    assert all(block.ref_count == 0 for block in llm.engine.block_manager.blocks)


#: Step budgets the equality tests run under: the token budget alone, and a latency target no step meets (every
#: prompt then progresses a minimum chunk per step beside the decodes): chunking changes when, never what.
TARGETS = [None, pytest.param(0.001, marks=pytest.mark.filterwarnings("ignore:kvopt. itl_target_ms"), id="target")]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("target", TARGETS)
def test_greedy_equals_hf_generate(arch, prefix_caching, target, references):
    model, prompts, expected = references(arch)
    llm = engine(model, enable_prefix_caching=prefix_caching, itl_target_ms=target)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    metrics = llm.metrics()
    if prefix_caching:  # the 8 prompts with a 40-token head share its 2 full blocks
        assert metrics["prefix_cache_hits_total"] >= 7 * 32
        assert sum(out.metrics.cached_tokens for out in outputs) == metrics["prefix_cache_hits_total"]
    else:
        assert metrics["prefix_cache_hits_total"] == 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("target", TARGETS)
def test_preemption_keeps_outputs(arch, mode, target, references):
    model, prompts, expected = references(arch)
    # 3 layers x 2 KV heads x 16 dims x fp32 x K/V = 768 bytes per token: room for ~2 sequences at a time.
    llm = engine(model, kv_memory=768 * 16 * 9, max_model_len=128, preemption_mode=mode, max_num_batched_tokens=256,
                 itl_target_ms=target)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    metrics = llm.metrics()
    assert metrics["num_preemptions_total"] > 0
    # Each prompt is looked up once, at its first admission, however often it is recomputed.
    assert metrics["prefix_cache_queries_total"] == metrics["prompt_tokens_total"] == sum(map(len, prompts))
    assert_pool_empty(llm)


def test_requests_sharing_a_prefix_compute_it_once(references):
    """Submitted together, requests with a common 40-token head: the first computes it, the others wait a
    step and find its 2 full blocks cached (not 8 copies computed side by side)."""
    model, prompts, expected = references("qwen2")
    llm = engine(model, max_num_batched_tokens=1024)
    outputs = llm.generate(prompts[32:], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected[32:]
    assert [out.metrics.cached_tokens for out in outputs] == [0] + [32] * 7
    assert llm.metrics()["prefix_cache_hits_total"] == 7 * 32


def test_parallel_samples_share_blocks_then_copy_on_write(references):
    model, prompts, expected = references("qwen2")
    llm = engine(model)
    copies = []
    original = llm.engine.runner.pool.copy_blocks
    llm.engine.runner.pool.copy_blocks = lambda pairs: (copies.extend(pairs), original(pairs))
    # top_k=1 sampling is greedy: every one of the n completions must equal HF's.
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    odd = [index for index, prompt in enumerate(prompts[:32]) if len(prompt) % 16][:6]
    outputs = llm.generate([prompts[i] for i in odd], params, use_tqdm=False)
    for index, output in zip(odd, outputs):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids == expected[index] for c in output.outputs)
    assert len(copies) >= 2 * len(odd)  # two siblings per request copied the shared last block
    assert_pool_empty(llm)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(references):
    model, prompts, _ = references("llama")
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=12, ignore_eos=True)
    alone = engine(model).generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    together = engine(model).generate(prompts[:6], [params] + [SamplingParams(temperature=1.0, max_tokens=12)] * 5,
                                      use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    assert alone == together
    assert len(alone) == 12


def test_bad_requests_fail_alone(references):
    model, prompts, expected = references("llama")
    llm = engine(model, max_model_len=64)
    batch = [prompts[0], list(range(3, 70)), [], [VOCAB + 5], prompts[1]]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == expected[0]
    assert outputs[4].outputs[0].token_ids == expected[1]
    assert "67 tokens" in outputs[1].error and "context is 64" in outputs[1].error
    assert "empty" in outputs[2].error
    assert f"[0, {VOCAB})" in outputs[3].error
    assert all(out.outputs[0].finish_reason == "error" for out in outputs[1:4])
    assert_pool_empty(llm)


def test_generation_stops_at_the_model_context(references):
    model, prompts, _ = references("llama")
    core = engine(model, max_model_len=40).engine  # LLM.generate refuses max_tokens past the context up front
    core.add_request("long", prompts[0][:30], SamplingParams(max_tokens=100, ignore_eos=True))
    outputs = [output for _ in range(20) for output in core.step()]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 10


def test_abort_frees_blocks_and_unknown_ids_are_ignored(references):
    model, prompts, _ = references("llama")
    llm = engine(model)
    core = llm.engine
    core.add_request("a", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", prompts[1], SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    assert llm.metrics()["kv_blocks_used"] > 0
    core.abort("a")
    core.abort("no-such-request")
    while core.has_unfinished_requests():
        core.step()
    assert_pool_empty(llm)


def test_too_small_pool_fails_at_start_naming_the_minimum():
    with pytest.raises(EngineConfigError, match=r"needs 32 \(393,216 bytes\).*raise kv_memory"):
        LLM(tiny_model("llama"), kv_memory="100kB")


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0), ("n", 0), ("logprobs", -2), ("stop", [""])],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}:"):
        SamplingParams(**{field: value})
    assert issubclass(SamplingParamsError, ValueError)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"kv_memory": "lots"}, "not a size"), ({"kv_memory": 1.5}, "fraction"), ({"block_size": 0}, "block_size"),
     ({"preemption_mode": "drop"}, "preemption_mode"), ({"policy": "lifo"}, "policy")],
)  # fmt: skip
def test_invalid_engine_settings(options, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(**options)


def test_memory_sizes():
    assert parse_memory("1GB", torch.device("cpu")) == 10**9
    assert parse_memory("512MiB", torch.device("cpu")) == 512 * 2**20
    assert parse_memory(4096, torch.device("cpu")) == 4096
    assert 0 < parse_memory(0.01, torch.device("cpu")) < parse_memory(0.02, torch.device("cpu"))


def test_priority_policy_runs_urgent_requests_first(references):
    model, prompts, _ = references("llama")
    llm = engine(model, policy="priority", max_num_seqs=1)
    outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False, priority=[3, 2, 1, 0])
    finished = sorted(range(4), key=lambda i: outputs[i].metrics.finished_time)
    assert finished == [3, 2, 1, 0]


def test_text_stops_streaming_chat_and_logprobs(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    llm = LLM(model, tokenizer=tokenizer, kv_memory="2MB")
    plain = llm.generate("The capital of France is", SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = plain.outputs[0].text
    assert text and text == tokenizer.decode(plain.outputs[0].token_ids, skip_special_tokens=True)
    stop = text.strip()[:3]
    stopped = llm.generate("The capital of France is", SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stop not in stopped.text and text.startswith(stopped.text)
    by_id = llm.generate("The capital of France is", SamplingParams(max_tokens=12, ignore_eos=True,
                         stop_token_ids=[plain.outputs[0].token_ids[2]]), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert by_id.token_ids == plain.outputs[0].token_ids[:3] and by_id.finish_reason == "stop"
    assert by_id.text == tokenizer.decode(plain.outputs[0].token_ids[:2], skip_special_tokens=True)  # stop text dropped
    steps = list(llm.stream("The capital of France is", SamplingParams(max_tokens=5, ignore_eos=True)))
    assert steps[-1].finished and steps[-1].outputs[0].token_ids == plain.outputs[0].token_ids[:5]
    assert [len(step.outputs[0].token_ids) for step in steps] == [1, 2, 3, 4, 5]
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, logprobs=2), use_tqdm=False)[0]
    logprobs = chat.outputs[0].logprobs
    assert len(logprobs) == len(chat.outputs[0].token_ids)
    assert all(len(entry) in (2, 3) and all(value <= 0 for value in entry.values()) for entry in logprobs)
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request("dup", "a")
        llm.engine.add_request("dup", "b")


def test_metrics_snapshot_names(references):
    model, prompts, _ = references("llama")
    llm = engine(model)
    llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    metrics = llm.metrics()
    for name in ("kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "num_requests_running", "num_requests_waiting", "kv_memory_waste_perc", "prompt_tokens_total",
                 "generation_tokens_total", "generation_tokens_per_second"):  # fmt: skip
        assert name in metrics
    assert metrics["generation_tokens_total"] == 4 * NEW_TOKENS
    assert metrics["prompt_tokens_total"] == sum(len(p) for p in prompts[:4])
    ttft = metrics["time_to_first_token_seconds"]
    assert ttft["count"] == 4 and ttft["buckets"][float("inf")] == 4 and ttft["p50"] <= ttft["p99"]
    assert metrics["inter_token_latency_seconds"]["count"] == 4 * (NEW_TOKENS - 1)


def test_long_prompt_in_chunks_smaller_than_a_block(references):
    """Steps where no sequence samples (a prompt mid-prefill) and chunks that end inside a block."""
    model, prompts, expected = references("mistral")
    llm = engine(model, max_num_batched_tokens=5)
    outputs = llm.generate(prompts[32:36], GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected[32:36]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_logprobs_equal_hf_within_1e5(arch, references):
    """fp32 numerics: the engine's log-probabilities equal HF generate's at every step (chunks, prefix hits)."""
    model, prompts, _ = references(arch)
    chosen = prompts[32:36] + prompts[:4]
    llm = engine(model, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(chosen, params, use_tqdm=False)
    for prompt, output in zip(chosen, outputs):
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        for step, (logits, entry) in enumerate(zip(result.logits, output.outputs[0].logprobs)):
            token = output.outputs[0].token_ids[step]
            expected = torch.log_softmax(logits[0].float(), dim=-1)[token].item()
            assert entry[token] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pieces", [2, 4])
def test_cpu_work_splits_keep_outputs(arch, pieces, monkeypatch, references):
    """The two ways a CPU step divides its work give HF's tokens and log-probabilities: decode keys cut into
    pieces (odd remainders go to the gathered tail, runs shorter than the pieces go there whole) and
    MLPs run over slices of rows."""
    monkeypatch.setattr(attention, "decode_pieces", lambda kv_heads: pieces)
    monkeypatch.setattr(model_runner, "MLP_ROWS", 5)
    model, prompts, expected = references(arch)
    llm = engine(model)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    for prompt, output in zip(prompts[:3] + prompts[32:34], outputs[:3] + outputs[32:34]):
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        for step, (logits, entry) in enumerate(zip(result.logits, output.outputs[0].logprobs)):
            token = output.outputs[0].token_ids[step]
            assert entry[token] == pytest.approx(torch.log_softmax(logits[0].float(), dim=-1)[token].item(), abs=1e-5)
    assert not any("forward" in vars(mlp) for mlp in llm.engine.runner.mlps)  # the slicing ends with the step
    assert_pool_empty(llm)


def test_half_precision_models_run(references):
    """A bf16 pool: same paths (fp32 attention math), outputs of the requested length."""
    model, prompts, _ = references("qwen2")
    llm = LLM(copy.deepcopy(model).to(torch.bfloat16), kv_memory="4MB", max_num_batched_tokens=64)
    outputs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == NEW_TOKENS for out in outputs)
    assert llm.engine.runner.pool.keys[0].dtype == torch.bfloat16


def test_seeded_parallel_samples_do_not_depend_on_the_batch(references):
    """Each sibling of a seeded n > 1 request draws from its own stream (seed + index)."""
    model, prompts, _ = references("llama")
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = engine(model).generate([prompts[3]], params, use_tqdm=False)[0]
    crowded = engine(model, kv_memory=768 * 16 * 12, max_model_len=128)  # preemptions shuffle who samples when
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    together = crowded.generate(prompts[:8], [others] * 3 + [params] + [others] * 4, use_tqdm=False)[3]
    assert [c.token_ids for c in together.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1


def test_max_num_seqs_counts_parallel_samples(references):
    model, prompts, _ = references("llama")
    llm = engine(model, max_num_seqs=3)
    core, params = llm.engine, SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True)
    for index in range(4):
        core.add_request(str(index), prompts[index], params if index < 2 else GREEDY)
    widest = 0
    while core.has_unfinished_requests():
        core.step()
        widest = max(widest, len(core.scheduler.running))
    assert widest == 3
    metrics = llm.metrics()
    assert metrics["request_success_total"] == {"length": 4}  # requests, not completions
    assert_pool_empty(llm)


def test_tiny_temperatures_are_greedy_and_the_global_generator_is_untouched(references):
    model, prompts, expected = references("llama")
    torch.manual_seed(0)
    reference_draw = torch.rand(1)
    torch.manual_seed(0)
    llm = engine(model)
    assert torch.equal(torch.rand(1), reference_draw)
    output = llm.generate([prompts[0]], SamplingParams(temperature=1e-40, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]  # fmt: skip
    assert output.outputs[0].token_ids == expected[0]


def test_a_swapped_sequence_returns_before_new_requests(references):
    model, prompts, expected = references("qwen2")
    llm = engine(model, kv_memory=768 * 16 * 9, max_model_len=128, preemption_mode="swap")
    core = llm.engine
    core.add_request("old", prompts[0], SamplingParams(max_tokens=40, ignore_eos=True))
    for index in range(1, 6):
        core.add_request(str(index), prompts[index], GREEDY)
    admitted_while_swapped = 0
    while core.has_unfinished_requests():
        waiting_before = len(core.scheduler.waiting)
        swapped_before = bool(core.scheduler.swapped)
        core.step()
        if swapped_before and core.scheduler.swapped and len(core.scheduler.waiting) < waiting_before:
            admitted_while_swapped += 1
    assert admitted_while_swapped == 0
    assert_pool_empty(llm)
