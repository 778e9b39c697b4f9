"""A kv_method's one-time preparation (a calibration: minutes on a CPU) runs off the engine's step (issue 64).

The request that needs it waits alone while the others decode; one preparation serves every request that asked for
it; its failure refuses those requests only (a 400 naming ``kv_method``) and is tried anew by the next; and an
engine-wide ``kv_method`` is prepared while the model loads, before ``/health`` says ready. A method whose
``prepare`` blocks on an event stands for a slow calibration, so nothing here waits on a clock.
"""

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvopt.engine import LLM, SamplingParams
from kvopt.errors import MethodParameterError
from kvopt.methods.kivi import KIVI
from kvopt.serving import ServerSettings, ThreadedServer

SPEC = "kivi:bits=4,residual=32"
#: Generous bounds for work that takes milliseconds: reached only when something hangs.
PATIENCE_S = 60


class SlowPreparation:
    """:meth:`prepare` stands in for ``KIVI.prepare``: records each call's thread and model, blocks until released."""

    def __init__(self, failures: int = 0) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.calls: list[tuple[str, object]] = []
        self.failures = failures

    def prepare(self, model, calibration_text) -> None:
        self.calls.append((threading.current_thread().name, model))
        self.started.set()
        assert self.release.wait(PATIENCE_S), "the test never released the preparation"
        if self.failures:
            self.failures -= 1
            raise MethodParameterError("kivi: the calibration text ran out; pass more text")

    def off_step(self) -> int:
        """Calls made on the preparation thread (the others are the engine's quick hand-over)."""
        return sum(thread == "kvopt-prepare" for thread, _ in self.calls)


@pytest.fixture
def serve(tiny_with_tokenizer):
    """Start a server on the tiny model (engine options per call); it stops at the end of the test."""
    model, tokenizer = tiny_with_tokenizer
    running = []

    def start(wait: bool = True, **options) -> ThreadedServer:
        load = lambda: LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB", **options).engine  # noqa: E731
        server = ThreadedServer(load, ServerSettings("tiny")).__enter__()
        running.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in running:
        server.__exit__()


def wait_until(check) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        assert time.monotonic() < deadline, "never reached"
        time.sleep(0.01)


def complete(server: ThreadedServer, **body) -> httpx.Response:
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True, "temperature": 0} | body
    return httpx.post(server.url + "/v1/completions", json=body, timeout=PATIENCE_S)


def test_a_slow_preparation_holds_up_only_the_requests_that_need_it(serve, monkeypatch):
    preparation = SlowPreparation()
    monkeypatch.setattr(KIVI, "prepare", preparation.prepare)
    server = serve()
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(complete, server, kv_method=SPEC) for _ in range(2)]
        try:
            assert preparation.started.wait(PATIENCE_S), "the preparation never started"
            wait_until(lambda: len(server.client.streams) == 2)  # both asked for it (the lossless one is added after)
            lossless = complete(server)  # an engine preparing in its step would hold this one up until the release
            assert lossless.status_code == 200 and lossless.json()["usage"]["completion_tokens"] == 4
            assert not any(request.done() for request in waiting)
        finally:
            preparation.release.set()
        compressed = [request.result() for request in waiting]
    assert [response.status_code for response in compressed] == [200, 200]
    assert all(response.json()["usage"]["completion_tokens"] == 4 for response in compressed)
    assert preparation.off_step() == 1  # once for both requests
    engine = server.client.engine
    twin = next(model for thread, model in preparation.calls if thread == "kvopt-prepare")
    assert twin is not engine.model and next(twin.parameters()) is next(engine.model.parameters())
    assert complete(server, kv_method=SPEC).status_code == 200 and preparation.off_step() == 1  # prepared for good


def test_a_failed_preparation_refuses_its_requests_alone_and_is_tried_again(serve, monkeypatch):
    preparation = SlowPreparation(failures=1)
    monkeypatch.setattr(KIVI, "prepare", preparation.prepare)
    server = serve()
    with ThreadPoolExecutor(1) as pool:
        failing = pool.submit(complete, server, kv_method=SPEC)
        try:
            assert preparation.started.wait(PATIENCE_S), "the preparation never started"
            assert complete(server).status_code == 200
        finally:
            preparation.release.set()
        refused = failing.result()
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "kv_method"
    assert error["message"] == (f"kv_method={SPEC!r} cannot run on this model: kivi: the calibration text ran out; "
                                "pass more text")  # fmt: skip
    assert complete(server, kv_method=SPEC).status_code == 200  # not kept as prepared: prepared again, and served
    assert preparation.off_step() == 2


def test_the_engine_kv_method_is_prepared_before_the_server_is_ready(serve, monkeypatch):
    preparation = SlowPreparation()
    monkeypatch.setattr(KIVI, "prepare", preparation.prepare)
    server = serve(wait=False, kv_method=SPEC)
    try:
        assert preparation.started.wait(PATIENCE_S), "the preparation never started"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
    finally:
        preparation.release.set()
    server.wait_ready()
    assert complete(server).status_code == 200 and complete(server, kv_method=SPEC).status_code == 200
    assert [thread for thread, _ in preparation.calls] == ["kvopt-engine"]  # no request waited for it


def test_a_preparation_off_the_step_hooks_nothing_the_engine_runs(tiny_with_tokenizer, monkeypatch):
    """What a calibration hooks onto modules (here: a forward hook on the final norm) lands on a twin of the model
    that computes what the model computes, never on the model the engine steps meanwhile."""
    model, tokenizer = tiny_with_tokenizer
    engine = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB").engine
    prepared, seen = [], []

    def hook(method, model, calibration_text) -> None:
        prepared.append(model)
        model.model.norm.register_forward_hook(lambda *_: seen.append(model))

    monkeypatch.setattr(KIVI, "prepare", hook)
    assert engine.preparation("full") is None and engine.preparation("window:size=64") is None
    work = engine.preparation(SPEC)
    assert work is not None and len(work()) == 1 and len(prepared) == 1
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == []  # the engine's forward passes met no hook of the preparation
    twin, ids = prepared[0], torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, engine.model(ids).logits) and seen == [twin]


@pytest.mark.parametrize(
    ("spec", "state"),
    [
        ("kvquant:bits=2", lambda method: method.calibration_state()),  # hooks the projections, backpropagates
        ("minikv", lambda method: method.layer_bits),  # recorded prefills, probe caches
        ("fastkv:ratio=0.5,budgets=xkv", lambda method: method.retention),  # fastkv measured none before issue 64
    ],
    ids=["kvquant", "minikv", "fastkv-xkv"],
)
def test_the_twin_calibrates_as_the_model_itself(model_folder, tmp_path, monkeypatch, spec, state):
    import kvopt

    model, tokenizer = kvopt.load_model(model_folder)
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "off-step"))
    engine = LLM(copy.deepcopy(model), tokenizer=tokenizer, kv_memory="8MB").engine
    (off_step,) = engine.preparation(spec)()
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path / "inline"))  # calibrated again, not read back
    (inline,) = kvopt.cache(spec, model).methods
    assert state(off_step) is not None
    assert_same(state(off_step), state(inline))


def assert_same(left, right) -> None:
    """Equal nested dicts, lists and tensors (bit for bit)."""
    if isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right)
        for one, other in zip(left, right):
            assert_same(one, other)
    elif isinstance(left, torch.Tensor):
        assert torch.equal(left, right)
    else:
        assert left == right
