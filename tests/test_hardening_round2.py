"""Issue #35, "Hardening, round two": one bad request never poisons the engine; ``LLM`` is safe from several threads;
``stream`` and ``abort`` always end a request; the API checks requests with the server's schema."""

import json
import re
import threading
import time

import pytest
import torch

import kvopt
from kvopt.engine import sampler
from kvopt.engine.detokenizer import IncrementalDetokenizer
from kvopt.engine.requests import RequestSchemaError
from kvopt.engine.sampling_params import SamplingParamsError
from kvopt.errors import KVOptError

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = kvopt.SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "One two three four"]


@pytest.fixture(scope="module")
def llm(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    return kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB")


def assert_idle(llm) -> None:
    """No request left in the engine and every block back in the pool."""
    engine = llm.engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_used_blocks == 0
    assert not llm._owned and not llm._mailbox


def assert_usable(llm) -> None:
    """A normal request after the case succeeds and leaves the pool empty."""
    (output,) = llm.generate("Hello there", GREEDY, use_tqdm=False)
    assert output.error is None and output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
    assert_idle(llm)


# -- finding 1: logprobs beyond the vocabulary ------------------------------------------------------------
def test_logprobs_are_bounded_like_the_servers():
    with pytest.raises(SamplingParamsError, match=r"SamplingParams\.logprobs: .*less than or equal to 20"):
        kvopt.SamplingParams(max_tokens=4, logprobs=100000)


def test_logprobs_past_the_vocabulary_do_not_break_a_step():
    logits = torch.randn(2, 10)
    entries = sampler.logprobs(logits, [3, 4], 1000)
    assert [len(entry) for entry in entries] == [10, 10]


# -- finding 2: lone surrogates ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda llm: llm.generate("a\ud800b", GREEDY, use_tqdm=False),
        lambda llm: llm.generate(["fine", "a\udfffb"], GREEDY, use_tqdm=False),
        lambda llm: llm.chat([{"role": "user", "content": "a\ud800b"}], GREEDY, use_tqdm=False),
        lambda llm: list(llm.stream("x\ud800", GREEDY)),
        lambda llm: llm.generate("fine", kvopt.SamplingParams(stop=["\ud800"]), use_tqdm=False),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(llm, call):
    with pytest.raises(RequestSchemaError, match="lone surrogate"):
        call(llm)
    assert_usable(llm)


# -- finding 3: abort always ends a request ---------------------------------------------------------------
def test_abort_between_stream_yields_ends_the_stream(llm):
    outputs = []
    for output in llm.stream("Once upon a time", kvopt.SamplingParams(max_tokens=50, ignore_eos=True)):
        outputs.append(output)
        if len(outputs) == 2:
            llm.abort(output.request_id)
        assert len(outputs) < 10, "the stream went on after its request was aborted"
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert_usable(llm)


def test_abort_from_another_thread_during_generate(llm):
    params = kvopt.SamplingParams(max_tokens=400, ignore_eos=True)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("out", llm.generate(PROMPTS, params, use_tqdm=False)))
    worker.start()
    deadline = time.monotonic() + 30
    while len(llm._owned) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.001)
    victim = sorted(llm._owned)[1]
    time.sleep(0.05)
    llm.abort(victim)
    worker.join(120)
    reasons = {output.request_id: output.outputs[0].finish_reason for output in results["out"]}
    assert reasons[victim] == "abort"
    assert [reason for key, reason in reasons.items() if key != victim] == ["length", "length"]
    assert_usable(llm)


# -- finding 4: closing a stream aborts its request -------------------------------------------------------
def test_breaking_out_of_a_stream_aborts_its_request(llm):
    for output in llm.stream("Once upon a time", kvopt.SamplingParams(max_tokens=200, ignore_eos=True)):
        assert output.request_id in llm.engine.requests
        break
    assert_idle(llm)
    assert_usable(llm)


# -- finding 5: two threads on one LLM --------------------------------------------------------------------
def test_two_threads_get_their_own_correct_outputs(llm):
    expected = {prompt: llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for prompt in PROMPTS}
    results, errors = {}, []

    def work(name: str, prompts: list[str]) -> None:
        try:
            for _ in range(3):
                results.setdefault(name, []).append(
                    [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                )
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=("a", PROMPTS)), threading.Thread(target=work, args=("b", PROMPTS[::-1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert results["a"] == [[expected[p] for p in PROMPTS]] * 3
    assert results["b"] == [[expected[p] for p in PROMPTS[::-1]]] * 3
    assert_usable(llm)


# -- failure isolation: each stage of a step raising ------------------------------------------------------
class Boom(RuntimeError):
    pass


def raising(original, when=lambda *args, **kwargs: True):
    """``original`` that raises :class:`Boom` whenever ``when(*args)`` holds."""

    def patched(*args, **kwargs):
        if when(*args, **kwargs):
            raise Boom("injected fault")
        return original(*args, **kwargs)

    return patched


STAGES = {
    # the whole step: every request of it fails
    "schedule": lambda llm, mp: mp.setattr(llm.engine.scheduler, "schedule", raising(llm.engine.scheduler.schedule)),
    "forward pass": lambda llm, mp: mp.setattr(llm.engine.runner, "run", raising(llm.engine.runner.run)),
    "sampling": lambda llm, mp: mp.setattr(sampler, "sample", raising(sampler.sample)),
    # one request's tokens
    "detokenizing": lambda llm, mp: mp.setattr(IncrementalDetokenizer, "add", raising(IncrementalDetokenizer.add)),
    "logprobs": lambda llm, mp: mp.setattr(sampler, "logprobs", raising(sampler.logprobs)),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_raising_fails_its_requests_and_leaves_the_engine_usable(llm, stage, monkeypatch):
    with monkeypatch.context() as patch:
        STAGES[stage](llm, patch)
        outputs = llm.generate(PROMPTS, kvopt.SamplingParams(max_tokens=4, logprobs=1), use_tqdm=False)
    assert [output.outputs[0].finish_reason for output in outputs] == ["error"] * len(PROMPTS)
    assert all("Boom: injected fault" in output.error for output in outputs)
    assert_usable(llm)
    assert llm.metrics()["request_success_total"]["error"] >= len(PROMPTS)


def test_a_failing_request_does_not_fail_its_batch(llm, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "logprobs", raising(sampler.logprobs))
        outputs = llm.generate(PROMPTS, [GREEDY, kvopt.SamplingParams(max_tokens=6, logprobs=2), GREEDY],
                               use_tqdm=False)  # fmt: skip
    assert [output.outputs[0].finish_reason for output in outputs] == ["length", "error", "length"]
    assert outputs[1].error is not None and outputs[0].error is None
    assert_usable(llm)


# -- finding 14: Python API types ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda llm: kvopt.SamplingParams(temperature="x"), "temperature"),
        (lambda llm: kvopt.SamplingParams(max_tokens="5"), "max_tokens"),
        (lambda llm: kvopt.SamplingParams(max_tokens=1.5), "max_tokens"),
        (lambda llm: kvopt.SamplingParams(stop=5), "stop"),
        (lambda llm: kvopt.SamplingParams(seed="abc"), "seed"),
        (lambda llm: llm.generate(None, use_tqdm=False), "prompts"),
        (lambda llm: llm.generate(5, use_tqdm=False), "prompts"),
        (lambda llm: llm.generate({"a"}, use_tqdm=False), "prompts"),
        (lambda llm: llm.generate([None], use_tqdm=False), "prompts[0]"),
        (lambda llm: llm.generate([[1, 2.5]], use_tqdm=False), "prompts[0]"),
        (lambda llm: llm.generate("hi", {"max_tokens": 3}, use_tqdm=False), "sampling_params"),
        (lambda llm: llm.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False), "messages[0].role"),
        (lambda llm: llm.chat([{"role": "user"}], use_tqdm=False), "messages[0].content"),
        (lambda llm: llm.chat([{"role": "user", "content": None}], use_tqdm=False), "messages[0].content"),
        (lambda llm: llm.chat("hi", use_tqdm=False), "messages"),
        (lambda llm: kvopt.SamplingParams(kv_method="full+full"), "kv_method"),
        (lambda llm: llm.save_session([], "/tmp/never.kvc"), "save_session"),
    ],
)
def test_bad_api_arguments_raise_a_value_error_naming_the_field(llm, call, field):
    with pytest.raises(KVOptError) as caught:
        call(llm)
    assert field in str(caught.value)
    assert_usable(llm)


# -- finding 9: the disk tier rewrites a damaged entry -----------------------------------------------------
def test_disk_tier_overwrites_an_entry_it_still_indexes(tmp_path):
    from kvopt.tiers.disk import DiskTier

    key = "raw-" + "ab" * 16
    DiskTier(tmp_path, 10**6).put(key, b"good bytes")
    file = next(tmp_path.glob(f"*/{key}.kvb"))
    file.write_bytes(b"damaged!!!")  # a flipped byte the codec's checksum would catch when read
    restarted = DiskTier(tmp_path, 10**6)
    assert restarted.contains(key)
    restarted.put(key, b"recomputed bytes")
    assert file.read_bytes() == b"recomputed bytes"
    assert restarted.stats.bytes_stored == len(b"recomputed bytes") == restarted.disk_bytes()


# -- findings 10, 11: a cache file as a chat session, a tier path under a file ------------------------------
def test_chat_session_that_is_a_saved_cache_is_one_line(model_folder, tiny_with_tokenizer, tmp_path, monkeypatch,
                                                         capsys):  # fmt: skip
    import io
    import sys

    from kvopt.cli.main import main
    from kvopt.codec import save_cache

    model, _ = tiny_with_tokenizer
    cache = kvopt.cache("full", model)
    model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
    save_cache(cache, tmp_path / "x.kvc", model=model)  # what cache.save writes: no conversation
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    monkeypatch.setattr(sys, "argv", ["kvopt", "chat", "--session", "x", "--sessions-dir", str(tmp_path), "--model",
                                      str(model_folder), "--device", "cpu"])  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main()
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and "is a saved cache, not a chat session" in stderr
    assert "Traceback" not in stderr and stderr.count("\n") == 1


def test_a_disk_tier_under_a_file_is_a_kvopt_error(tiny_with_tokenizer, tmp_path):
    model, tokenizer = tiny_with_tokenizer
    (tmp_path / "afile").write_text("")
    with pytest.raises(KVOptError, match=r"disk tier .*afile/tier: cannot use it as a folder"):
        kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB", kv_tiers=[f"disk:{tmp_path}/afile/tier:1MB"])


# -- finding 13 (and 14's kvopt.generate ids): a tokenizer's output as the prompt ----------------------------
def test_kvopt_generate_takes_a_batch_encoding(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    encoding = tokenizer("The capital of France is", return_tensors="pt")
    from_encoding = kvopt.generate(model, encoding, max_new_tokens=4)
    from_ids = kvopt.generate(model, encoding.input_ids, max_new_tokens=4)
    assert from_encoding.tokens == from_ids.tokens and len(from_ids.tokens) == 4


@pytest.mark.parametrize("ids", [[[-1, 5]], [[5, 10**6]], [[1.5, 2.0]], None, "hello", [[True, False]]])
def test_kvopt_generate_refuses_ids_outside_the_vocabulary(tiny_with_tokenizer, ids):
    model, _ = tiny_with_tokenizer
    with pytest.raises(KVOptError, match="kvopt.generate"):
        kvopt.generate(model, ids, max_new_tokens=2)


# -- finding 16: LLM options the engine used to bend -------------------------------------------------------
def test_max_model_len_beyond_the_models_positions_is_refused(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    with pytest.raises(KVOptError, match=r"^max_model_len=1000000000 is more than the model's maximum of 2048 "):
        kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB", max_model_len=10**9)


def test_one_tier_given_as_a_string_is_one_tier(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    llm = kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB", kv_tiers="cpu:1MB")
    assert list(llm.metrics()["kv_tiers"]) == ["cpu"]
    assert_usable(llm)


@pytest.mark.parametrize(("options", "fragment"), [
    ({"kv_tiers": 5}, "kv_tiers=5 must be a tier spec or a list of them"),
    ({"kv_tiers": ["cpu:1MB", None]}, "kv_tiers=['cpu:1MB', None] must be a tier spec"),
    ({"max_model_len": "4096"}, "max_model_len='4096' must be an integer"),
])  # fmt: skip
def test_llm_options_of_the_wrong_type_are_one_line(tiny_with_tokenizer, options, fragment):
    model, tokenizer = tiny_with_tokenizer
    with pytest.raises(KVOptError, match=re.escape(fragment)):
        kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB", **options)


# -- finding 7 in the Python API: max_tokens beyond the context is refused as batch and the server refuse it --------
TEN_IDS = list(range(100, 110))


@pytest.mark.parametrize(("max_tokens", "message"), [
    (2039, "prompt: the prompt's 10 tokens plus max_tokens=2039 exceed the model's context of 2048 tokens; ask for at "
           "most 2038 or shorten the prompt"),
    (10**9, "prompt: max_tokens=1000000000 is more than the limit of 2047; ask for at most 2047"),
])  # fmt: skip
def test_max_tokens_beyond_the_context_is_refused(llm, max_tokens, message):
    params = kvopt.SamplingParams(max_tokens=max_tokens)
    for call in (lambda: llm.generate(TEN_IDS, params, use_tqdm=False), lambda: list(llm.stream(TEN_IDS, params))):
        with pytest.raises(RequestSchemaError) as caught:
            call()
        assert str(caught.value) == message and caught.value.param == "max_tokens"
    with pytest.raises(RequestSchemaError, match=r"^prompts\[1\]: the prompt's 10 tokens plus max_tokens=2039 "):
        llm.generate([TEN_IDS, TEN_IDS], [GREEDY, kvopt.SamplingParams(max_tokens=2039)], use_tqdm=False)
    assert_usable(llm)
    (fits,) = llm.generate([5] * 2040, kvopt.SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(fits.outputs[0].token_ids) == 8  # up to the last position


def test_the_batch_refuses_the_same_line_with_the_same_message(llm, model_folder, tmp_path, monkeypatch, capsys):
    from test_batch_cli import run

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": TEN_IDS, "max_tokens": 2039}) + "\n")
    run([str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(model_folder), "--kv-memory", "8MB"],
        monkeypatch, capsys)  # fmt: skip
    (line,) = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    with pytest.raises(RequestSchemaError) as caught:
        llm.generate(TEN_IDS, kvopt.SamplingParams(max_tokens=2039), use_tqdm=False)
    assert line["error"].endswith(str(caught.value).removeprefix("prompt: ")), line
