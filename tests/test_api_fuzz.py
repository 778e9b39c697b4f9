"""Property (issue #35): no argument makes the Python API or a ``kvopt batch`` line raise anything but a ``ValueError``
(or end one request with an ``error`` output), and after every case a normal request succeeds on an empty pool.

Arguments are hypothesis-generated in the style of ``test_server_fuzz.py``: ``SamplingParams`` with every field
valid or of any type (NaN, huge integers, lone surrogates, containers), prompts of every shape, ``kv_method``
strings (runnable, malformed, not for this model), ``LLM(...)`` options, and batch files of valid, broken and
arbitrary lines (non-UTF-8 bytes included).
"""

import copy
import json

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvopt
from kvopt.cli.batch import _results, read_requests

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 49_152
NORMAL = kvopt.SamplingParams(max_tokens=3, ignore_eos=True)
FUZZ = settings(max_examples=100, deadline=None, derandomize=True)
TEXT = st.text(max_size=12) | st.sampled_from(["", "a\ud800b", "\udfff", "Hello"])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner) | st.dictionaries(TEXT, inner, max_size=2)
    | st.frozensets(st.integers(0, 9), max_size=2),
    max_leaves=6,
)  # fmt: skip
RUNNABLE_METHODS = st.sampled_from(["full", "snapkv:ratio=0.5", "kivi:bits=4,residual=32", "h2o:budget=8",
                                    "streamingllm:budget=16,sinks=4"])  # fmt: skip
KV_METHOD = RUNNABLE_METHODS | st.sampled_from([
    "window:size=5000", "fastkv:ratio=0.5,tsp_layer=5", "snapkv+snapkv", "nope", "snapkv:ratio=2", "", "full+full",
]) | TEXT  # fmt: skip
#: Values SamplingParams accepts, per field (combinations may still be refused: n > 1 with temperature 0, ...).
FIELDS = {
    "n": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1), "max_tokens": st.integers(1, 5),
    "stop": st.text("ab .", min_size=1, max_size=2) | st.lists(st.text("ab .", min_size=1, max_size=2), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "logprobs": st.none() | st.integers(0, 5), "kv_method": RUNNABLE_METHODS,
}  # fmt: skip
BROKEN_FIELDS = {"kv_method": KV_METHOD} | {name: ANY for name in FIELDS}
VALID_PROMPT = st.text(min_size=1, max_size=12) | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
PROMPT = VALID_PROMPT | TEXT | st.lists(st.integers(-2, VOCAB + 2), max_size=6) | ANY
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=12)}), min_size=1, max_size=2)  # fmt: skip
MESSAGES = VALID_MESSAGES | st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "wizard"])},
                          optional={"content": TEXT | ANY, "name": TEXT}),
    max_size=2,
) | ANY  # fmt: skip
#: What a case breaks (most cases break nothing, so most reach the engine).
KINDS = ["valid", "valid", "valid", "a field", "the prompt", "the sampling_params argument"]


@pytest.fixture(scope="module")
def llm(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    return kvopt.LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB")


def assert_usable(llm) -> None:
    (output,) = llm.generate("Hello there", NORMAL, use_tqdm=False)
    assert output.error is None and len(output.outputs[0].token_ids) == NORMAL.max_tokens
    assert llm.metrics()["kv_blocks_used"] == 0


def only_value_errors(call) -> None:
    """Run ``call``; a ValueError is a refusal (recorded), any other exception fails the case."""
    try:
        outputs = call()
    except ValueError as error:
        event(f"refused: {type(error).__name__}")
        assert str(error) and "Traceback" not in str(error)
        return
    for output in outputs or ():
        event("error output" if output.error else "ran")
        assert output.error is None or output.outputs[0].finish_reason == "error"


@st.composite
def sampling_params(draw, broken: bool) -> dict:
    """Keyword arguments for SamplingParams: valid values, or one field of any type (an unknown keyword is Python's
    TypeError, as for any function)."""
    kwargs = draw(st.fixed_dictionaries({}, optional=FIELDS))
    if broken:
        name = draw(st.sampled_from(sorted(BROKEN_FIELDS)))
        kwargs[name] = draw(BROKEN_FIELDS[name])
    return kwargs


CALLS = {
    "generate": lambda llm, prompt, params: llm.generate(prompt, params, use_tqdm=False),
    "generate a list": lambda llm, prompt, params: llm.generate([prompt, "Hi"], params, use_tqdm=False),
    "stream": lambda llm, prompt, params: list(llm.stream(prompt, params))[-1:],
    "chat": lambda llm, messages, params: llm.chat(messages, params, use_tqdm=False),
}


@given(data=st.data())
@FUZZ
def test_the_python_api_raises_only_value_errors(llm, data):
    name, kind = data.draw(st.sampled_from(sorted(CALLS))), data.draw(st.sampled_from(KINDS))
    chat = name == "chat"
    argument = data.draw((MESSAGES if chat else PROMPT) if kind == "the prompt" else
                         (VALID_MESSAGES if chat else VALID_PROMPT))  # fmt: skip
    kwargs = data.draw(sampling_params(broken=kind == "a field"))
    event(f"{name}, {kind}")

    def call():
        params = kvopt.SamplingParams(**kwargs)
        return CALLS[name](llm, argument, data.draw(ANY) if kind == "the sampling_params argument" else params)

    only_value_errors(call)
    assert_usable(llm)


#: Options LLM accepts, and what a case may give one of them instead (the KV pool stays small: a fraction of free
#: memory would take the machine's).
OPTIONS = {
    "kv_method": RUNNABLE_METHODS, "block_size": st.sampled_from([8, 16]), "kv_memory": st.sampled_from(["8MB", 6_000_000]),
    "max_model_len": st.none() | st.integers(64, 2048), "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(64, 512), "enable_prefix_caching": st.booleans(),
    "kv_tiers": st.sampled_from(["cpu:1MB", ["cpu:1MB"], []]), "kv_tier_encoding": st.sampled_from(["raw", "int8"]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]), "policy": st.sampled_from(["fcfs", "priority"]),
    "speculate": st.sampled_from([None, "prompt_lookup:k=2"]),
}  # fmt: skip
BROKEN_OPTIONS = {name: ANY for name in OPTIONS if name != "kv_memory"} | {
    "kv_method": KV_METHOD, "kv_memory": st.sampled_from(["lots", 0, -5, None, [1], "0", True]),
    "max_model_len": st.integers(-3, 10**6), "kv_tiers": st.sampled_from(["cpu:lots", "nowhere", "disk:", ["cpu"]]),
}  # fmt: skip


@given(data=st.data())
@FUZZ
def test_llm_options_raise_only_value_errors(tiny_with_tokenizer, data):
    model, tokenizer = tiny_with_tokenizer
    options = data.draw(st.fixed_dictionaries({}, optional=OPTIONS))
    if data.draw(st.booleans()):
        name = data.draw(st.sampled_from(sorted(BROKEN_OPTIONS)))
        options[name] = data.draw(BROKEN_OPTIONS[name])
    try:
        llm = kvopt.LLM(model, tokenizer=tokenizer, **({"kv_memory": "8MB"} | options))
    except ValueError as error:
        event(f"refused: {type(error).__name__}")
        assert str(error) and "\n" not in str(error)
        return
    event("built")
    with llm:
        assert_usable(llm)


@st.composite
def batch_line(draw) -> object:
    """A valid body (bare or in vLLM's envelope), the same with one field broken, or any JSON value."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "broken", "any"]))
    if kind == "any":
        return draw(ANY)
    prompt = draw(st.sampled_from(["prompt", "messages"]))
    body = {prompt: draw(VALID_PROMPT if prompt == "prompt" else VALID_MESSAGES)} | draw(
        st.fixed_dictionaries({}, optional=FIELDS)
    )
    if kind == "broken":
        name = draw(st.sampled_from(sorted({*BROKEN_FIELDS, "prompt", "messages", "stream", "unknown_field"})))
        body[name] = draw(BROKEN_FIELDS.get(name, ANY) | PROMPT | MESSAGES)
    return draw(st.sampled_from([body, {"custom_id": str(draw(st.integers(0, 5))), "body": body}]))


LINES = st.lists(batch_line(), min_size=1, max_size=3).map(
    lambda lines: [json.dumps(line, default=repr) for line in lines]  # bytes and sets as their repr
)
RAW_TAIL = st.sampled_from([b"", b"", b"\n"]) | st.binary(max_size=8)  # mostly nothing; else bytes, UTF-8 or not


@given(lines=LINES, raw=RAW_TAIL)
@FUZZ
def test_batch_lines_raise_only_value_errors(llm, tmp_path_factory, lines, raw):
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + raw)
    try:
        requests = read_requests(path, 3)
    except ValueError as error:
        event(f"refused: {type(error).__name__}")
        assert str(error).startswith(str(path)) and "\n" not in str(error)
        return
    results = dict(_results(llm, requests, 3))
    assert sorted(results) == sorted(request.custom_id for request in requests)
    for result in results.values():
        event("error line" if result["error"] else "ran")
        assert (result["error"] is None) != (result["response"] is None)
    assert_usable(llm)
