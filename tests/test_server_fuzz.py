"""Property: no payload makes the server answer 5xx; every refusal is OpenAI's error shape, every success well formed.

Payloads are hypothesis-generated: valid requests (every field drawn from the values the server
accepts), the same with one field broken (wrong type, out of range, NaN, unknown name), arbitrary
JSON documents and raw bytes. Per-request ``kv_method`` is lossless, compressed (in the engine's
compressed blocks or head blocks), in the sequence's own cache (kvzip), or broken.
"""

import copy
import json

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvopt.engine import LLM
from kvopt.serving import ServerSettings, ThreadedServer

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
PROMPT = st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 49_151), min_size=1, max_size=8)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={"content": st.text(max_size=40) | st.just([{"type": "text", "text": "hi"}]), "name": st.text(max_size=5)},
    ),
    min_size=1, max_size=3,
)  # fmt: skip
#: Values the server accepts, per endpoint (combinations may still be refused: n > 1 with temperature 0, ...).
SAMPLING = {
    "model": st.just("tiny"), "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50), "n": st.integers(1, 3), "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=3), "stream": st.booleans(), "user": st.text(max_size=5),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "kv_method": st.sampled_from(
        ["full", "snapkv:ratio=0.5", "kivi:bits=4,residual=32", "h2o:budget=8", "adakv:ratio=0.5", "kvzip:ratio=0.5"]
    ),
}  # fmt: skip
ENDPOINTS = {
    "/v1/completions": ({"prompt": PROMPT}, SAMPLING | {"logprobs": st.integers(0, 5)}),
    "/v1/chat/completions": (
        {"messages": MESSAGES},
        SAMPLING | {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 6)},
    ),
    "/tokenize": ({}, {"model": st.just("tiny"), "prompt": st.text(max_size=60), "messages": MESSAGES,
                       "add_special_tokens": st.booleans()}),
}  # fmt: skip


@st.composite
def payloads(draw, path: str) -> bytes:
    """A valid request, the same with one field broken (wrong type, out of range, unknown), arbitrary JSON or bytes."""
    kind = draw(st.sampled_from(["valid", "broken", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "json":
        return json.dumps(draw(ANY_JSON)).encode()
    required, optional = ENDPOINTS[path]
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if kind == "broken":
        field = draw(st.sampled_from(sorted({*required, *optional, "unknown_field"})))
        body[field] = draw(ANY_JSON | st.integers(-(2**70), 2**70) | st.sampled_from([-1, 0, 10**9, "", "nope", 1e308]))
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    settings = ServerSettings("tiny", max_output_tokens=6, max_body_bytes=4096)
    with ThreadedServer(lambda: LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB").engine, settings) as running:
        yield running.wait_ready()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@given(data=st.data())
@settings(max_examples=250, deadline=None, derandomize=True)
def test_no_payload_gets_a_5xx(http, data):
    path = data.draw(st.sampled_from(sorted(ENDPOINTS)))
    body = data.draw(payloads(path))
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    event(f"{path} {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert "Traceback" not in error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], response.text
        for chunk in events[:-2]:
            assert "error" not in json.loads(chunk.removeprefix("data: ")), chunk
    elif path == "/tokenize":
        assert response.json()["count"] == len(response.json()["tokens"])
    else:
        reply = response.json()
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= len(reply["choices"]), reply
