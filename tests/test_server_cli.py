"""``kvopt serve`` as a command: settings refused before listening, a model that fails to load, SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvopt.cli.main import main


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kvopt", "serve", "--port", str(free_port()), *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--kv-method", "nope"], "unknown method 'nope'"),
        (["--kv-memory", "lots"], "kv_memory='lots' is not a size"),
        (["--port", "70000"], "--port"),
        (["--threads", "0"], "--threads"),
        (["--device", "cuda:99"], "device 'cuda:99' is not on this machine"),
        (["--speculate", "self:layers=2"], "the engine drafts with prompt_lookup"),
        (["--chunk-caching", "--blend-ratio", "1.5"], "blend_ratio=1.5 is outside [0, 1]"),
        (["--chunk-caching", "--blend-strategy", "lego"], "unknown blend strategy 'lego'"),
        (["--chunk-caching", "--blend-check-layer", "-1"], "--blend-check-layer"),
        (["--blend-ratio", "0.3"], "add --chunk-caching"),
    ],
)
def test_bad_settings_fail_before_listening(args, fragment, monkeypatch, capsys):
    code, stderr = run(args, monkeypatch, capsys)
    assert code == 2 and fragment in stderr and "Uvicorn running" not in stderr, stderr


def test_a_model_that_fails_to_load_stops_the_server_with_one_line(tmp_path, monkeypatch, capsys):
    code, stderr = run(["--model", str(tmp_path / "missing")], monkeypatch, capsys)
    assert code == 2 and stderr.splitlines()[-1].startswith("error: model path") and "Traceback" not in stderr


def start_server(model_folder, *options: str) -> tuple[subprocess.Popen, str]:
    """``kvopt serve`` on ``model_folder`` (an HF folder) as a process, one torch thread; ``(process, url)``."""
    port = free_port()
    command = [sys.executable, "-m", "kvopt.cli.main", "serve", "--model", str(model_folder), "--port", str(port),
               "--kv-memory", "8MB", "--served-model-name", "tiny", "--no-access-log", "--threads", "1", *options]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a tiny model on a shared CI machine, as conftest does
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen, url: str, seconds: float = 180) -> None:
    """Until ``/health`` answers 200 (the model loaded); fails with the server's output if it exits."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not become ready in {seconds} s")


def test_sigterm_finishes_open_streams_and_refuses_new_requests(tiny_with_tokenizer, tmp_path):
    for part in tiny_with_tokenizer:  # the tiny llama and the real tokenizer as an HF folder
        part.save_pretrained(tmp_path)
    process, url = start_server(tmp_path)
    try:
        wait_ready(process, url)
        started, events = threading.Event(), []

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    events.append(line)
                    started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30), process.stdout.read() if process.poll() is not None else "no first event"
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            late = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code
        except httpx.TransportError:
            late = "refused"
        reader.join(60)
        status = process.wait(60)
    finally:
        process.kill()
    assert status in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert late in ("refused", 503)
    chunks = [json.loads(line.removeprefix("data: ")) for line in events if line.startswith("data: {")]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 1000
    assert [line for line in events if line][-1] == "data: [DONE]"
