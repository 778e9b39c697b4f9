"""``kvopt serve``'s API through the real ``openai`` client, against uvicorn on a loopback port.

Each server runs on a background thread of the test process with its own engine over the tiny
llama (real tokenizer and chat template), so requests take milliseconds; greedy results are
compared with the same engine driven in-process.
"""

import copy
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvopt.engine import LLM, SamplingParams
from kvopt.serving import ServerSettings, ThreadedServer

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog because"
#: Limits of the main test server, so refusals are quick to provoke.
LIMITS = dict(max_prompt_tokens=100, max_output_tokens=64, max_body_bytes=20_000)


def wait_until(check, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


@pytest.fixture(scope="module")
def make_server(tiny_with_tokenizer):
    """Start a server on the tiny model (engine options and server settings per call); all stop at the end."""
    model, tokenizer = tiny_with_tokenizer
    running = []

    def start(settings: ServerSettings | None = None, wait: bool = True, load=None, **engine_options) -> ThreadedServer:
        engine_options.setdefault("kv_memory", "8MB")
        load = load or (lambda: LLM(copy.deepcopy(model), tokenizer=tokenizer, **engine_options).engine)
        server = ThreadedServer(load, settings or ServerSettings(MODEL)).__enter__()
        running.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in running:
        server.__exit__()


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(ServerSettings(MODEL, **LIMITS))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_with_tokenizer):
    """The same model driven in-process, for the texts the server must reproduce."""
    model, tokenizer = tiny_with_tokenizer
    return LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB")


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **options)


def metrics(server) -> dict[str, dict[tuple, float]]:
    """``{sample name: {labels (sorted items, without model_name): value}}`` parsed with prometheus_client."""
    text = httpx.get(server.url + "/metrics").text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def test_completion_and_chat_equal_the_engine(client, reference):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    expected = reference.generate(PROMPT, greedy(12), use_tqdm=False)[0]
    assert completion.choices[0].text == expected.outputs[0].text
    assert completion.choices[0].finish_reason == "length" and completion.object == "text_completion"
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids) and completion.usage.completion_tokens == 12

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    expected = reference.chat(messages, greedy(10), use_tqdm=False)[0]
    assert chat.choices[0].message.content == expected.outputs[0].text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_stream_sends_one_token_per_event_and_adds_up_to_the_whole_text(client):
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    pieces = [chunk for chunk in chunks if chunk.choices]
    assert len(pieces) == 16 and all(len(chunk.choices[0].logprobs.tokens) == 1 for chunk in pieces)
    assert "".join(chunk.choices[0].text for chunk in pieces) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in pieces] == [None] * 15 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    tokens = [chunk.choices[0].logprobs.token_logprobs[0] for chunk in pieces]
    assert tokens == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_never_reaches_the_stream(client):
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**options).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # likely spans two tokens: held back, then cut
    assert stop.strip(), text
    whole = client.completions.create(**options, stop=[stop]).choices[0]
    assert whole.text == text[: text.index(stop)] and whole.finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**options, stop=stop, stream=True))
    assert streamed == whole.text


def test_usage_counts_prefix_cache_hits(client):
    system = "You are a careful assistant. " * 8  # several 16-token blocks shared by both requests
    first = client.completions.create(model=MODEL, prompt=system + "First question?", max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=system + "Another one?", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_n_samples_with_a_seed_are_reproducible(client):
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7)
    first, again = client.completions.create(**options), client.completions.create(**options)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 18 and len({c.text for c in first.choices}) > 1


def test_kv_method_per_request_is_checked_then_served_as_the_engine_serves_it(client, reference):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"kv_method": "full"})  # fmt: skip
    assert full.choices[0].text == plain.choices[0].text
    for spec, fragment in (("nope", "unknown method 'nope'"), ("snapkv:ratio=2", "ratio")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"kv_method": spec})
        assert refused.value.param == "kv_method" and fragment in refused.value.body["message"]
    # A valid compressed recipe: whatever the engine does with it (serve it, or fail the request), the server mirrors.
    spec = "snapkv:ratio=0.5"
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=8, kv_method=spec), use_tqdm=False)[0]
    if expected.error is not None:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"kv_method": spec})
        assert refused.value.body["message"] == expected.error
    else:
        served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"kv_method": spec})  # fmt: skip
        assert served.choices[0].text == expected.outputs[0].text


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/v1/completions", b"{bad", 400, None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("/v1/completions", b"", 400, None, "no body"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt", "a string or a list of token ids"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
        ("/v1/completions", {"prompt": "x", "temprature": 0.5}, 400, "temprature", "unknown field 'temprature'"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "max_tokens", "limit of 64 (--max-output-tokens)"),
        ("/v1/completions", {"prompt": " hi" * 150}, 400, "prompt", "at most 100 (--max-prompt-tokens"),
        ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, 400, None, "n=2 with temperature=0"),
        ("/v1/completions", {"prompt": []}, 400, None, "the prompt is empty"),
        ("/v1/completions", {"prompt": [10**6]}, 400, None, "token ids must lie in"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "use 'tiny'"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages",
         "messages[0].role"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs", "needs \"logprobs\": true"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt", "exactly one"),
        ("/v2/completions", {"prompt": "x"}, 404, None, "no endpoint /v2/completions"),
    ],
)
def test_bad_requests_get_4xx_in_openai_shape(server, path, body, status, param, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == status and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and fragment in error["message"], error
    assert "Traceback" not in response.text


def test_wrong_method_gets_405_in_openai_shape(server):
    response = httpx.get(server.url + "/v1/completions")
    assert response.status_code == 405 and "does not take GET" in response.json()["error"]["message"]


def test_body_over_the_limit_gets_413(client, server):
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=1)
    assert refused.value.status_code == 413 and "at most 20,000 (--max-body-bytes)" in refused.value.body["message"]

    def chunked():  # no Content-Length: cut off while it streams in
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    response = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_api_key_is_required_when_set(make_server):
    server = make_server(ServerSettings(MODEL, api_key="sesame"))
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert refused.value.code == "invalid_api_key" and "--api-key" in refused.value.body["message"]
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame").models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200 and httpx.get(server.url + "/metrics").status_code == 200


def test_full_queue_gets_429_and_a_disconnected_client_frees_its_blocks(make_server):
    server = make_server(ServerSettings(MODEL, max_waiting=0), max_num_seqs=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=long) as held:
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")  # running: it holds the only place
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert refused.value.response.headers["retry-after"] == "1" and "--max-waiting" in refused.value.body["message"]
    # The client left: the engine aborts the request and its blocks return to the pool.
    freed = lambda: (m := metrics(server))["kvopt:kv_cache_usage_perc"][()] == 0 and m["kvopt:num_requests_running"][()] == 0  # noqa: E731
    wait_until(freed, what="blocks freed after the disconnect")
    assert metrics(server)["kvopt:request_success_total"][(("finished_reason", "abort"),)] == 1
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_request_timeout_aborts_the_request(make_server):
    server = make_server(ServerSettings(MODEL, request_timeout=0.2))
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=long)
    assert response.status_code == 408 and "--request-timeout" in response.json()["error"]["message"]
    events = httpx.post(server.url + "/v1/completions", json=long | {"stream": True}).text.split("\n\n")
    assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert events[-2] == "data: [DONE]"
    wait_until(lambda: metrics(server)["kvopt:kv_cache_usage_perc"][()] == 0, what="blocks freed after the timeouts")


def test_metrics_parse_and_count_completed_requests(server, client):
    before = metrics(server)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    after = metrics(server)

    def grew(name: str, labels: tuple = ()) -> float:
        return after[name][labels] - before.get(name, {}).get(labels, 0)

    assert grew("kvopt:generation_tokens_total") == 5
    assert grew("kvopt:prompt_tokens_total") == completion.usage.prompt_tokens
    assert grew("kvopt:prefix_cache_queries_total") == completion.usage.prompt_tokens
    assert grew("kvopt:request_success_total", (("finished_reason", "length"),)) == 1
    assert grew("kvopt:time_to_first_token_seconds_count") == 1 and grew("kvopt:e2e_request_latency_seconds_count") == 1
    assert grew("kvopt:inter_token_latency_seconds_count") == 4
    assert after["kvopt:time_to_first_token_seconds_bucket"][(("le", "+Inf"),)] >= 1
    for gauge in ("kv_cache_usage_perc", "kv_bytes_held", "kv_bytes_saved_by_compression", "kv_memory_waste_perc",
                  "num_requests_running", "num_requests_waiting", "num_preemptions_total", "prefix_cache_hits_total"):
        assert () in after[f"kvopt:{gauge}"], gauge


def test_a_speculating_server_returns_what_plain_decoding_gives(make_server, reference):
    server = make_server(speculate="prompt_lookup:k=4,ngram=2")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = f"{PROMPT} {PROMPT}"
    expected = reference.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].text
    options = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**options).choices[0].text == expected
    streamed = client.completions.create(**options, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    counted = metrics(server)
    assert counted["kvopt:spec_decode_num_draft_tokens_total"][()] > 0
    assert counted["kvopt:generation_tokens_total"][()] == 48


def test_health_is_503_while_the_model_loads(make_server, tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    gate = threading.Event()

    def load():
        gate.wait(10)
        return LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB").engine

    server = make_server(wait=False, load=load)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    models = httpx.get(server.url + "/v1/models")
    assert models.status_code == 503 and models.headers["retry-after"] == "5"
    assert "kvopt:kv_cache_usage_perc" not in httpx.get(server.url + "/metrics").text
    gate.set()
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, what="/health 200 after loading")


def test_a_server_shutting_down_refuses_new_requests(make_server):
    server = make_server()
    server.app.state.server.draining = True  # what SIGTERM sets (the subprocess test sends the real signal)
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
    assert response.headers["connection"] == "close"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "shutting down"


def test_models_and_tokenize(server, client, reference):
    card = client.models.list().data[0]
    assert card.id == MODEL and card.model_extra["max_model_len"] == 2048 and card.model_extra["kv_method"] == "full"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == reference.tokenizer(PROMPT).input_ids and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    expected = reference.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat["tokens"] == reference.tokenizer(expected, add_special_tokens=False).input_ids


@pytest.mark.real_model
def test_the_default_model_answers_through_the_api(default_model):
    model, tokenizer = default_model
    with ThreadedServer(lambda: LLM(model, tokenizer=tokenizer, kv_memory="64MB", max_model_len=1024).engine,
                        ServerSettings("SmolLM2-135M-Instruct")) as server:  # fmt: skip
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=24,
                                                temperature=0)  # fmt: skip
        assert "Paris" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"
