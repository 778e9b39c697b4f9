"""Speculative decoding in the engine (prompt lookup): greedy outputs equal HF generate per prompt, drafts are
verified in the same pass as the newest token, rejected drafts give their blocks back, and sampled tokens keep
plain sampling's distribution."""

import copy
import functools

import pytest
import torch

from kvopt.engine import LLM, EngineConfig, SamplingParams, sampler
from kvopt.engine.config import CPU_SPECULATE_MAX_BATCH, EngineConfigError
from kvopt.engine.sequence import Sequence
from test_engine import assert_pool_empty, hf_greedy
from tiny_models import VOCAB, tiny_model

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def repetitive_prompts(count: int, seed: int = 11) -> list[list[int]]:
    """Prompts that repeat a random phrase (what prompt lookup finds), of several lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for index in range(count):
        phrase = torch.randint(3, VOCAB, (5 + index % 7,), generator=generator).tolist()
        noise = torch.randint(3, VOCAB, (3 + index,), generator=generator).tolist()
        prompts.append(noise + phrase * (2 + index % 3))
    return prompts


@functools.cache
def references(arch: str) -> tuple:
    """(tiny model, repetitive prompts, HF's greedy continuations) of an architecture, computed once."""
    model = tiny_model(arch)
    prompts = repetitive_prompts(12)
    return model, prompts, [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]


def engine(model, **options) -> LLM:
    options.setdefault("kv_memory", "4MB")
    options.setdefault("max_num_batched_tokens", 128)
    options.setdefault("speculate", "prompt_lookup:k=4,ngram=2")
    options.setdefault("speculate_max_batch", 64)  # every running sequence drafts (the CPU's default stops at 2)
    return LLM(copy.deepcopy(model), **options)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
def test_greedy_with_drafts_equals_hf_generate(arch):
    model, prompts, expected = references(arch)
    for prefix_caching in (True, False):
        llm = engine(model, enable_prefix_caching=prefix_caching)
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        counted = llm.metrics()
        # Drafts were made, some accepted (else verification would go untested) and some rejected.
        assert 0 < counted["spec_decode_num_accepted_tokens_total"] < counted["spec_decode_num_draft_tokens_total"]
        assert counted["generation_tokens_total"] == len(prompts) * NEW_TOKENS
        assert_pool_empty(llm)


def counted_steps(llm: LLM) -> list[int]:
    """A list that gets one entry per forward pass ``llm`` runs from now on."""
    steps, run = [], llm.engine.runner.run

    def counting(*args):
        steps.append(1)
        return run(*args)

    llm.engine.runner.run = counting
    return steps


def test_each_accepted_draft_saves_a_step():
    model, prompts, expected = references("llama")
    plain, drafted = engine(model, speculate=None), engine(model)
    plain_steps, drafted_steps = counted_steps(plain), counted_steps(drafted)
    outputs = [llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0] for llm in (plain, drafted)]
    assert [output.outputs[0].token_ids for output in outputs] == [expected[0]] * 2
    accepted = drafted.metrics()["spec_decode_num_accepted_tokens_total"]
    assert accepted > 0 and len(drafted_steps) == len(plain_steps) - accepted
    # Inter-token latency: one gap per step after the first token (a step's tokens arrive together).
    gaps = [len(output.metrics.inter_token_latencies) for output in outputs]
    assert gaps == [NEW_TOKENS - 1, NEW_TOKENS - 1 - accepted]


def test_on_a_cpu_only_few_running_sequences_draft_by_default():
    model, prompts, expected = references("qwen2")
    llm = engine(model, speculate_max_batch=None)
    core = llm.engine
    assert core.scheduler.drafting.max_batch == CPU_SPECULATE_MAX_BATCH == 2
    running_when_drafting, run = [], core.runner.run

    def recording(batch, copies):
        if any(seq.draft_token_ids for seq in batch.seqs):
            running_when_drafting.append(len(core.scheduler.running))
        return run(batch, copies)

    core.runner.run = recording
    params = [SamplingParams(max_tokens=count, ignore_eos=True) for count in (3, 6, NEW_TOKENS, NEW_TOKENS)]
    outputs = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[: p.max_tokens] for e, p in zip(expected, params)]
    assert running_when_drafting and max(running_when_drafting) == 2  # drafting began once two had finished
    with pytest.raises(EngineConfigError, match="speculate_max_batch=0 must be a positive integer"):
        EngineConfig(speculate="prompt_lookup", speculate_max_batch=0)


def test_drafts_take_only_what_every_scheduled_token_left():
    """With a budget of 6 tokens per step and 4 sequences decoding, every running sequence still decodes in every
    step (drafts fill the 2 tokens left over); with 6 blocks for 4 sequences, drafts never preempt one."""
    model, prompts, expected = references("llama")
    llm = engine(model, max_num_batched_tokens=6, kv_memory=768 * 16 * 8, max_model_len=64)
    core, run = llm.engine, llm.engine.runner.run
    starved = []

    def checking(batch, copies):
        decoding = [seq for seq in core.scheduler.running if seq.num_uncomputed_tokens == 1]
        starved.extend(seq.seq_id for seq in decoding if seq not in batch.seqs)
        assert batch.total_tokens <= 6
        return run(batch, copies)

    core.runner.run = checking
    short = [prompt[:5] for prompt in prompts[:4]]
    outputs = llm.generate(short, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(model, prompt, NEW_TOKENS) for prompt in short]
    assert not starved and llm.metrics()["num_preemptions_total"] == 0
    assert llm.metrics()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts_keeps_outputs(mode):
    model, prompts, expected = references("qwen2")
    # 3 layers x 2 KV heads x 16 dims x fp32 x K/V = 768 bytes per token: room for ~2 sequences at a time.
    llm = engine(model, kv_memory=768 * 16 * 12, max_model_len=128, preemption_mode=mode)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert llm.metrics()["num_preemptions_total"] > 0
    assert_pool_empty(llm)


def test_drafts_respect_max_tokens_context_and_stop_tokens():
    model, prompts, expected = references("llama")
    llm = engine(model, max_model_len=len(prompts[5]) + 9)
    limits = [SamplingParams(max_tokens=count, ignore_eos=True) for count in (1, 2, 5, 7)]
    for params, output in zip(limits, llm.generate(prompts[:4], limits, use_tqdm=False)):
        assert output.outputs[0].token_ids == expected[prompts.index(output.prompt_token_ids)][: params.max_tokens]
        assert output.outputs[0].finish_reason == "length"
    llm.engine.add_request("context", prompts[5], GREEDY)  # LLM.generate refuses max_tokens past the context
    context = [output for _ in range(30) for output in llm.engine.step()][-1].outputs[0]
    assert context.token_ids == expected[5][:9] and context.finish_reason == "length"
    # A stop token that arrives inside a run of accepted drafts ends the output there.
    stop_at = expected[0][10]
    stopped = llm.generate([prompts[0]], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                        stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    first = expected[0].index(stop_at)
    assert stopped.token_ids == expected[0][: first + 1] and stopped.finish_reason == "stop"
    assert_pool_empty(llm)


def test_blocks_filled_by_drafts_in_the_last_step_are_cached():
    """A request's last step may fill blocks with accepted drafts; they are named for the prefix cache before the
    request's blocks are freed, so a follow-up prompt (prompt + answer + more) finds all of them."""
    model, prompts, expected = references("llama")
    llm = engine(model, block_size=4)
    for prompt, answer in zip(prompts[:6], expected):
        output = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        assert output.token_ids == answer
        follow_up = llm.generate([prompt + answer + [5]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert follow_up.metrics.cached_tokens == (len(prompt) + NEW_TOKENS - 1) // 4 * 4


def test_logprobs_of_accepted_drafts_are_the_models():
    model, prompts, _ = references("llama")
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    plain = engine(model, speculate=None).generate(prompts[:3], params, use_tqdm=False)
    drafted = engine(model).generate(prompts[:3], params, use_tqdm=False)
    for one, other in zip(plain, drafted):
        assert one.outputs[0].token_ids == other.outputs[0].token_ids
        for mine, theirs in zip(one.outputs[0].logprobs, other.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[token] - theirs[token]) < 1e-4 for token in mine)


def test_compressed_sequences_decode_without_drafts():
    model, prompts, expected = references("llama")
    spec = "kivi:bits=4,group=16,residual=16"
    params = SamplingParams(max_tokens=12, ignore_eos=True, kv_method=spec)
    plain = engine(model, speculate=None).generate(prompts[:4], params, use_tqdm=False)
    llm = engine(model)
    drafted = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.metrics()["spec_decode_num_drafts_total"] == 0
    # An engine whose default method compresses says so at start; a request naming 'full' still drafts.
    with pytest.warns(UserWarning, match="only requests with SamplingParams\\(kv_method='full'\\) will draft"):
        llm = engine(model, kv_method=spec)
    lossless = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, kv_method="full")
    assert llm.generate(prompts[:1], lossless, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
    assert llm.metrics()["spec_decode_num_drafts_total"] > 0


def test_seeded_samples_do_not_depend_on_the_batch():
    """A seeded sampled request does not draft (whether it would depends on the batch, and drafting changes which
    random numbers it draws), so it samples alone what it samples beside greedy requests that draft."""
    model, prompts, expected = references("mistral")
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, ignore_eos=True)
    alone = engine(model).generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    llm = engine(model)
    together = llm.generate(prompts[:4], [seeded, GREEDY, GREEDY, GREEDY], use_tqdm=False)
    assert together[0].outputs[0].token_ids == alone and len(alone) == 16
    assert [out.outputs[0].token_ids for out in together[1:]] == expected[1:4]
    assert llm.metrics()["spec_decode_num_drafts_total"] > 0
    assert_pool_empty(llm)


def test_sampled_tokens_with_drafts_score_as_a_full_forward_pass_does():
    """Each emitted token's log-probability equals the model's over prompt + output in one pass: what every step
    attended to was the sequence's own keys and values, for parallel samples too (their last prefill chunk is one
    token, so a request could draft before it forks) and for drafts written across blocks."""
    model, prompts, _ = references("llama")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True, logprobs=0)
    for length in (16, 32):
        prompt = (prompts[3] * 8)[:length]
        llm = engine(model, max_num_batched_tokens=length - 1)
        for completion in llm.generate([prompt], params, use_tqdm=False)[0].outputs:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, length - 1 : -1]
            expected = torch.log_softmax(logits.float(), dim=-1)
            scored = [step[token] for step, token in zip(completion.logprobs, completion.token_ids)]
            reference = expected[torch.arange(len(scored)), completion.token_ids].tolist()
            assert scored == pytest.approx(reference, abs=1e-4)
        assert llm.metrics()["spec_decode_num_drafts_total"] > 0
        assert_pool_empty(llm)


def test_verified_samples_keep_the_models_distribution():
    """Whatever the draft, the first token a step emits is distributed as plain sampling draws it (chi-square
    over a small vocabulary, a draft the model finds likely and one it finds unlikely)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=4)
    expected = sampler._filtered_probs(logits[0], 0.7, 5, 1.0)
    trials = 6000
    for draft in (int(expected.argmax()), int(expected.argmin())):
        seq = Sequence(0, "r", [1, 2], 2, params, 0.0, draft_token_ids=[draft, 1],
                       generator=torch.Generator().manual_seed(draft))  # fmt: skip
        counts = torch.zeros(6)
        for _ in range(trials):
            counts[sampler.verify_drafts(logits, seq, torch.Generator())[0]] += 1
        kept = expected > 0
        observed, wanted = counts[kept], expected[kept] * trials
        chi_square = float(((observed - wanted) ** 2 / wanted).sum())
        assert counts[~kept].sum() == 0
        assert chi_square < 20.5  # 99.9% quantile for 4 degrees of freedom (5 tokens kept by top_k)


@pytest.mark.parametrize(
    ("speculate", "message"),
    [("self:layers=2", "engine drafts with prompt_lookup"), ("prompt_lookup:k=0", "must be >= 1"),
     ("lookahead", "unknown speculation"), ("prompt_lookup:depth=3", "bad parameter")],
)  # fmt: skip
def test_invalid_speculation_names_the_fix(speculate, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(speculate=speculate)
