"""``kvopt serve --shutdown-timeout`` past its timeout (issue #35, finding 12): requests still open end with a 503 in
OpenAI's error shape (non-streamed) or an ``error`` event then ``[DONE]`` (streamed), and the log has no traceback."""

import json
import signal
import threading

import httpx
import openai
from test_server_cli import start_server, wait_ready

#: More tokens than the tiny model decodes in the shutdown timeout, and within its context of 2048.
LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}
ENDED = "shut down before this request finished"


def test_requests_open_past_the_shutdown_timeout_end_with_a_503(tiny_with_tokenizer, tmp_path):
    for part in tiny_with_tokenizer:
        part.save_pretrained(tmp_path)
    process, url = start_server(tmp_path, "--shutdown-timeout", "1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    outcomes: dict[str, object] = {}
    raw_events: list[str] = []
    streaming = threading.Barrier(3, timeout=60)  # both streams have their first chunk, and the test thread

    def plain(name: str) -> None:
        try:
            outcomes[name] = client.completions.create(model="tiny", prompt=f"Once upon a time {name}", **LONG)
        except openai.APIStatusError as error:
            outcomes[name] = error

    def streamed_with_openai() -> None:
        stream = client.completions.create(model="tiny", prompt="One two three", stream=True, **LONG)
        try:
            for count, _ in enumerate(stream):
                if count == 0:
                    streaming.wait()
        except openai.APIError as error:
            outcomes["openai stream"] = error
        else:
            outcomes["openai stream"] = "ended without an error"

    def streamed_raw() -> None:
        body = {"model": "tiny", "prompt": "Red green blue", "stream": True, "max_tokens": 2000, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    raw_events.append(line)
                    if len(raw_events) == 1:
                        streaming.wait()

    try:
        wait_ready(process, url)
        workers = [threading.Thread(target=plain, args=(f"plain {n}",)) for n in range(2)]
        workers += [threading.Thread(target=streamed_with_openai), threading.Thread(target=streamed_raw)]
        for worker in workers:
            worker.start()
        streaming.wait()  # the plain requests were sent first and are decoding beside the streams
        process.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.join(60)
        assert not any(worker.is_alive() for worker in workers)
        status = process.wait(60)
        log = process.stdout.read()
    finally:
        process.kill()
    assert status in (0, -signal.SIGTERM), log
    assert "Traceback" not in log and "CancelledError" not in log, log
    for name in ("plain 0", "plain 1"):
        error = outcomes[name]
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, (name, error)
        assert error.response.headers["content-type"] == "application/json"
        assert set(error.body) == {"message", "type", "param", "code"} and error.body["type"] == "server_error"
        assert ENDED in error.body["message"]
    stream_error = outcomes["openai stream"]
    assert isinstance(stream_error, openai.APIError) and ENDED in stream_error.message, stream_error
    *chunks, error_event, done = raw_events
    assert done == "data: [DONE]" and chunks, raw_events
    error = json.loads(error_event.removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and ENDED in error["message"]
    assert all("error" not in json.loads(chunk.removeprefix("data: ")) for chunk in chunks)

