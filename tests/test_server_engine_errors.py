"""The server tells a refusal from its engine's own failure (issue #35, finding 17): every ``kv_method`` error names
the field (``param: "kv_method"``, from the schema or the engine's check of the spec on the model), and a request
the engine fails on once queued (its failure isolation: ``finish_reason="error"``) is a 500, not a 400."""

import copy
import json

import httpx
import openai
import pytest

from kvopt.engine import LLM
from kvopt.engine.detokenizer import IncrementalDetokenizer
from kvopt.serving import ServerSettings, ThreadedServer


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    load = lambda: LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB").engine
    with ThreadedServer(load, ServerSettings("tiny")) as running:
        yield running.wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nope", "unknown method 'nope'"),  # the schema: does not parse
        ("snapkv:ratio=0.5+snapkv:ratio=0.3", "appears twice"),  # the schema: a method named twice
        ("window:size=5000", "larger than the model's context"),  # the engine's check on this model (2048 positions)
        ("fastkv:ratio=0.5,tsp_layer=5", "leaves no later layer"),  # the tiny llama has 2 layers
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_every_kv_method_error_names_the_field(client, spec, fragment, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, stream=stream,
                                  extra_body={"kv_method": spec})  # fmt: skip
    assert caught.value.body["param"] == "kv_method" and fragment in caught.value.body["message"], caught.value.body


def test_a_refusal_the_engine_makes_stays_a_400(client):
    with pytest.raises(openai.BadRequestError, match=r"prompt token ids must lie in \[0, 49152\)"):
        client.completions.create(model="tiny", prompt=[5, 10**6], max_tokens=2)


def raising_detokenizer(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(IncrementalDetokenizer, "add", boom)


def test_an_engine_failure_on_one_request_is_a_500(client, monkeypatch):
    with monkeypatch.context() as patch:
        raising_detokenizer(patch)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    error = caught.value
    assert error.status_code == 500 and error.body["type"] == "server_error"
    assert "the engine failed on this request (RuntimeError: injected fault)" in error.body["message"]
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=4).choices[0].finish_reason == "length"


def test_an_engine_failure_mid_stream_is_a_server_error_event_then_done(server, client, monkeypatch):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response, \
            monkeypatch.context() as patch:  # fmt: skip
        for line in response.iter_lines():
            if line:
                events.append(line)
                raising_detokenizer(patch)  # from the second step on
    *chunks, error_event, done = events
    assert done == "data: [DONE]" and chunks
    error = json.loads(error_event.removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"], error
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=4).choices[0].finish_reason == "length"
