"""Stall-free steps (issue 72): the budget arithmetic on a synthetic clock, the scheduler's use of it, the knobs'
checks, and greedy outputs that do not depend on the budget."""

import copy
import json
import re

import openai
import pytest
from test_batch_cli import run as run_batch
from test_engine_compressed import generate_with_cache
from test_engine_compressed import prompts as compressed_prompts
from test_engine import NEW_TOKENS, hf_greedy, mixed_prompts
from test_hardening_cli import run_main
from test_server import MODEL, PROMPT, make_server, metrics  # noqa: F401 - make_server is a fixture
from tiny_models import tiny_model

from kvopt.engine import LLM, SamplingParams
from kvopt.engine.config import EngineConfig, EngineConfigError
from kvopt.engine.step_budget import (
    AUTO_TARGET_STEPS, IDLE_TARGET_STEPS, MIN_PREFILL_CHUNK, REFIT_EVERY, WINDOW, StepClock, StepTimeModel, StepWork,
    chunk_work,
)
from kvopt.serving import ServerSettings

pytestmark = pytest.mark.usefixtures("one_thread")
#: The synthetic machine: 20 ms a step, 1 ms a token, 2 us a (query, key) pair.
FIXED, PER_TOKEN, PER_PAIR = 0.020, 0.001, 2e-6


def synthetic_seconds(work: StepWork, slowdown: float = 1.0) -> float:
    return slowdown * (FIXED + PER_TOKEN * work.tokens + PER_PAIR * work.pairs)


def fitted(slowdown: float = 1.0) -> StepTimeModel:
    """A model fitted to a few decode-only and prompt steps of the synthetic machine."""
    model = StepTimeModel()
    for tokens, position in [(1, 100), (4, 400), (8, 900), (2, 2000)]:
        work = StepWork(tokens, tokens * position)
        model.observe(work, synthetic_seconds(work, slowdown), computed_prompt=False)
    for tokens, position in [(256, 0), (512, 256), (64, 1024), (1024, 0)]:
        work = chunk_work(position, tokens) + StepWork(4, 2000)
        model.observe(work, synthetic_seconds(work, slowdown), computed_prompt=True)
    return model


def test_the_fit_recovers_the_machine_and_predicts_unseen_steps():
    model = fitted()
    assert model.coefficients == pytest.approx([FIXED, PER_TOKEN, PER_PAIR], rel=1e-6)
    unseen = chunk_work(3000, 700) + StepWork(16, 16 * 500)
    assert model.predict(unseen) == pytest.approx(synthetic_seconds(unseen), rel=1e-6)


def test_a_full_decode_window_refits_every_few_steps_and_a_prompt_step_at_once():
    """Decode-only steps refit the model every REFIT_EVERY once the window is full (a fit costs a few percent of a
    single request's step); until then, and after any step with prompt tokens, every step refits."""
    model = fitted()
    while len(model.decode_steps) < WINDOW:  # filling the decode window: every step refits
        work = StepWork(1, 100 + len(model.decode_steps))
        model.observe(work, synthetic_seconds(work, 2.0), computed_prompt=False)
        assert model.unfitted == 0 or len(model.decode_steps) == WINDOW
    for _ in range(REFIT_EVERY):  # the window full: a refit comes within REFIT_EVERY steps
        model.observe(StepWork(1, 150), synthetic_seconds(StepWork(1, 150), 2.0), computed_prompt=False)
        if model.unfitted == 0:
            break
    assert model.unfitted == 0
    before = model.coefficients.copy()
    for step in range(REFIT_EVERY - 1):
        model.observe(StepWork(1, 200), synthetic_seconds(StepWork(1, 200), 3.0), computed_prompt=False)
    assert (model.coefficients == before).all() and model.unfitted == REFIT_EVERY - 1
    model.observe(StepWork(1, 200), synthetic_seconds(StepWork(1, 200), 3.0), computed_prompt=False)
    assert model.unfitted == 0 and not (model.coefficients == before).all()
    model.observe(StepWork(1, 200), synthetic_seconds(StepWork(1, 200), 3.0), computed_prompt=False)
    work = chunk_work(0, 300)
    model.observe(work, synthetic_seconds(work, 3.0), computed_prompt=True)
    assert model.unfitted == 0


def test_the_most_tokens_fill_the_target_and_no_more():
    model = fitted()
    decodes = StepWork(4, 4 * 1000)
    for position in (0, 500, 3000):
        n = model.most_tokens(decodes, position, 0.3)
        assert synthetic_seconds(decodes + chunk_work(position, n)) <= 0.3 < synthetic_seconds(
            decodes + chunk_work(position, n + 1))  # fmt: skip
    assert model.most_tokens(decodes, 0, 0.01) == 0  # the decodes alone overrun it


def clock_with(model: StepTimeModel, target_ms: float | None) -> StepClock:
    clock = StepClock(target_ms)
    clock.models = {threads: model for threads in range(1, 257)}
    return clock


def test_decodes_are_always_admitted_and_prompts_get_at_least_the_minimum_chunk():
    clock = clock_with(fitted(), target_ms=25)  # barely above the decodes' own step
    budget = clock.budget(4096, None, [2000] * 8)
    assert budget.tokens == 8 and budget.decoding  # decodes are counted whatever the target
    assert budget.grant_prompt(0, 3000) == 0  # over the target
    assert budget.grant_prompt(0, 3000, floor=MIN_PREFILL_CHUNK) == MIN_PREFILL_CHUNK  # yet a prompt may progress
    assert clock.budget(6, None, [2000] * 8).tokens == 6  # beyond the token cap, decodes wait for the next step


def test_alone_a_prompt_takes_nearly_the_whole_budget_and_a_threshold_caps_its_chunk():
    assert clock_with(fitted(), target_ms=None).budget(4096, None, []).grant_prompt(0, 3000) == 3000
    clock = clock_with(fitted(), target_ms=100)
    alone = clock.budget(4096, None, []).grant_prompt(0, 3000)  # ten times the target: ~1 s of prompt
    assert synthetic_seconds(chunk_work(0, alone)) <= IDLE_TARGET_STEPS * 0.1 < synthetic_seconds(chunk_work(0, alone + 1))
    beside = clock.budget(4096, None, [1000]).grant_prompt(0, 3000)
    assert MIN_PREFILL_CHUNK < beside < alone / 5
    assert clock_with(fitted(), None).budget(4096, 512, []).grant_prompt(0, 3000) == 512
    assert clock_with(fitted(), None).budget(1024, None, []).grant_prompt(0, 3000) == 1024


def test_the_budget_grows_when_the_target_allows_and_shrinks_when_steps_run_slow():
    def granted(model, target_ms):
        return clock_with(model, target_ms).budget(4096, None, [1000]).grant_prompt(0, 4000)

    assert MIN_PREFILL_CHUNK < granted(fitted(), 100) < granted(fitted(), 400) < 4000
    slow = fitted(slowdown=3.0)  # the machine got busy: the same target buys fewer tokens
    assert granted(slow, 400) < granted(fitted(), 400) / 2
    model = fitted()  # and the fit follows it as slow steps arrive
    before = granted(model, 400)
    for tokens, position in [(1, 100), (4, 400), (128, 0), (256, 256)] * 12:
        work = chunk_work(position, tokens)
        model.observe(work, synthetic_seconds(work, 3.0), computed_prompt=tokens > 4)
    assert granted(model, 400) < before / 2


def test_auto_follows_the_decoding_batch_from_its_start_up_floor():
    clock = StepClock("auto")
    clock.models = {threads: fitted() for threads in range(1, 257)}
    clock.set_auto_target(0.030)  # one sequence's decode step at start-up
    assert clock.budget(4096, None, [100]).target == pytest.approx(AUTO_TARGET_STEPS * 0.030)  # the floor
    many = clock.budget(4096, None, [3000] * 16)  # sixteen long decodes: a slower step, a larger target
    assert many.target == pytest.approx(AUTO_TARGET_STEPS * synthetic_seconds(StepWork(16, 16 * 3001)))  # each attends itself too
    assert clock.last_target == many.target
    assert clock.budget(4096, None, []).target == pytest.approx(IDLE_TARGET_STEPS * AUTO_TARGET_STEPS * 0.030)


def test_the_clock_counts_missed_steps_and_the_prediction_ratio():
    clock = clock_with(fitted(), target_ms=100)
    budget = clock.budget(4096, None, [1000])
    budget.grant_prompt(0, 4000)
    clock.observe(budget, synthetic_seconds(budget.work))
    clock.observe(budget, 2 * synthetic_seconds(budget.work))  # a step twice as slow as predicted
    alone = clock.budget(4096, None, [])
    clock.observe(alone, 0.5)  # past the decoding target, but nothing decoded: no miss
    assert clock.missed == 1
    assert list(clock.prediction_ratio.recent)[:2] == pytest.approx([1.0, 0.5])


@pytest.mark.parametrize("settings, message", [
    (dict(itl_target_ms=0), "itl_target_ms=0 must be a positive number"),
    (dict(itl_target_ms=-5.0), "itl_target_ms=-5.0 must be a positive number"),
    (dict(itl_target_ms=float("nan")), "itl_target_ms=nan must be a positive number"),
    (dict(itl_target_ms="fast"), "itl_target_ms='fast' must be a positive number"),
    (dict(long_prefill_token_threshold=5000), "long_prefill_token_threshold=5000 is more than max_num_batched_tok"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills=0 must be a positive integer"),
])  # fmt: skip
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(EngineConfigError, match=message) as error:
        EngineConfig(**settings)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=64, long_prefill_token_threshold=24),
    dict(max_num_batched_tokens=256, max_num_partial_prefills=1),
    dict(max_num_batched_tokens=256, itl_target_ms=0.001),  # no step meets it (a warning): the minimum chunk a step
    dict(max_num_batched_tokens=256, itl_target_ms="auto"),
])  # fmt: skip
@pytest.mark.filterwarnings("ignore:kvopt. itl_target_ms")
def test_greedy_outputs_do_not_depend_on_the_budget(arch, settings):
    """Chunking changes when tokens are computed, never what they are: the engine equals HF generate per prompt."""
    model = tiny_model(arch)
    prompts = mixed_prompts(10) + mixed_prompts(3, seed=5, shared=40)
    outputs = LLM(model, kv_memory="4MB", **settings).generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_a_long_prompt_never_stalls_the_decodes_beside_it():
    """With a target no step meets, a 300-token prompt arriving beside decoding sequences is computed a minimum
    chunk per step while every decode advances every step."""
    with pytest.warns(UserWarning, match=r"itl_target_ms=0.001 is below one decode step of this engine \(.* ms measured"):
        engine = LLM(tiny_model("llama"), kv_memory="4MB", max_num_batched_tokens=512, itl_target_ms=0.001).engine
    assert engine.metrics()["request_success_total"] == {} and engine.metrics()["prefix_cache_queries_total"] == 0
    assert engine.metrics()["step_target_missed_total"] == 0  # the warm-up's steps are not the load's
    assert engine.metrics()["step_time_predicted_over_measured"]["count"] == 0
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for index, prompt in enumerate(mixed_prompts(3)):
        engine.add_request(f"chat{index}", prompt, params)
    while any(seq.num_uncomputed_tokens > 1 for seq in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()  # the chat prompts' prefill (in minimum chunks: the target binds alone too); then they decode
    engine.add_request("document", [3 + index % 120 for index in range(300)], SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    while any(seq.request_id == "document" for seq in [*engine.scheduler.waiting, *engine.scheduler.running]):
        before = {seq.request_id: seq.num_computed_tokens for seq in engine.scheduler.running}
        engine.step()
        after = {seq.request_id: seq.num_computed_tokens for seq in engine.scheduler.running}
        assert all(after[name] == before[name] + 1 for name in before if name.startswith("chat") and name in after)
        chunks.append(after.get("document", 0) - before.get("document", 0))
        if after.get("document", 0) >= 300:
            break
    assert max(chunks) == MIN_PREFILL_CHUNK and len(chunks) >= 300 // MIN_PREFILL_CHUNK


def test_the_server_exports_the_target_the_budget_and_the_prediction(make_server):
    """``/metrics``: the target ``auto`` set at start-up, the prefill budget, missed steps and predicted/measured."""
    server = make_server(ServerSettings(MODEL), itl_target_ms="auto", max_num_batched_tokens=256)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    found = metrics(server)
    assert found["kvopt:step_itl_target_seconds"][()] > 0
    assert 0 < found["kvopt:step_prefill_budget_tokens"][()] <= 256
    assert () in found["kvopt:step_target_missed_total"]
    assert found["kvopt:step_time_predicted_over_measured_count"][()] >= 6
    assert found["kvopt:step_time_predicted_over_measured_bucket"][(("le", "+Inf"),)] >= 6


@pytest.mark.parametrize("options, message", [
    (["--itl-target-ms", "0"], "itl_target_ms='0' must be a positive number of milliseconds"),
    (["--itl-target-ms", "nan"], "itl_target_ms='nan' must be a positive number"),
    (["--itl-target-ms", "fast"], "itl_target_ms='fast' must be a positive number"),
    (["--long-prefill-token-threshold", "5000"], "long_prefill_token_threshold=5000 is more than max_num_batched_tokens"),
    (["--max-num-partial-prefills", "0"], "'--max-num-partial-prefills'"),
])  # fmt: skip
def test_serve_refuses_bad_step_settings_in_one_line_before_the_port(options, message, monkeypatch, capsys):
    code, stderr = run_main(["serve", "--port", "1", *options], monkeypatch, capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1


def test_a_question_arriving_mid_document_is_admitted_before_the_documents_next_chunk():
    """Under a target, a short prompt that arrives while a long one is part-way through is computed in the very next
    step, and the long one still gets its minimum chunk in that step."""
    with pytest.warns(UserWarning, match="below one decode step"):
        engine = LLM(tiny_model("llama"), kv_memory="4MB", max_num_batched_tokens=512, itl_target_ms=0.001).engine
    engine.add_request("chat", mixed_prompts(1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.running[0].num_uncomputed_tokens > 1:
        engine.step()
    engine.add_request("document", [3 + index % 120 for index in range(300)], SamplingParams(max_tokens=2))
    engine.step()
    engine.step()
    engine.add_request("question", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    computed = {seq.request_id: seq.num_computed_tokens for seq in engine.scheduler.running}
    engine.step()
    after = {seq.request_id: seq.num_computed_tokens for seq in engine.scheduler.running}
    assert after["question"] == 6 and after["chat"] == computed["chat"] + 1
    assert after["document"] == computed["document"] + MIN_PREFILL_CHUNK


def test_batch_takes_the_knobs_and_prints_the_budget_it_used(model_folder, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Question {index}: why?", "max_tokens": 3}) + "\n"
                              for index in range(3)))  # fmt: skip
    out = tmp_path / "out.jsonl"
    code, stderr = run_batch([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB",
                              "--no-metrics", "--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "16",
                              "--max-num-partial-prefills", "1", "--itl-target-ms", "auto"], monkeypatch, capsys)  # fmt: skip
    assert code == 0, stderr
    assert re.search(r"step budget: at most 64 tokens a step, prompt chunks of at most 16, at most 1 prompts "
                     r"part-way through, latency target \d+ ms \(auto: at least this", stderr)  # fmt: skip
    assert len(out.read_text().splitlines()) == 3
    code, stderr = run_batch([str(source), "-o", str(out), "--model", str(model_folder), "--itl-target-ms", "-3"],
                             monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "itl_target_ms='-3' must be a positive number" in stderr


@pytest.mark.filterwarnings("ignore:kvopt. itl_target_ms")
@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "kivi:bits=4,residual=32", "streamingllm:budget=48"])
def test_compressed_sequences_under_a_target_equal_generate_with_the_same_cache(spec):
    """A compressed prompt's one-pass prefill counts as prompt work; beside minimum chunks its outputs are unchanged."""
    model = tiny_model("llama")
    outputs = LLM(copy.deepcopy(model), kv_method=spec, kv_memory="4MB", max_num_batched_tokens=96,
                  itl_target_ms=0.001).generate(
        compressed_prompts(), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)  # fmt: skip
    expected = [generate_with_cache(model, spec, prompt, NEW_TOKENS) for prompt in compressed_prompts()]
    assert [output.outputs[0].token_ids for output in outputs] == expected


@pytest.mark.filterwarnings("ignore:kvopt. itl_target_ms")
def test_speculation_under_a_target_keeps_plain_greedy_outputs():
    model = tiny_model("qwen2")
    prompts = mixed_prompts(10) + mixed_prompts(3, seed=5, shared=40)
    for target in (0.001, 10_000.0):  # drafts get no room / all the room the token budget leaves
        llm = LLM(model, kv_memory="4MB", max_num_batched_tokens=128, speculate="prompt_lookup:k=4,ngram=2",
                  speculate_max_batch=64, itl_target_ms=target)  # fmt: skip
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert llm.metrics()["spec_decode_num_draft_tokens_total"] > 0  # the generous target left drafts their room
