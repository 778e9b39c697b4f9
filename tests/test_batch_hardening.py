"""``kvopt batch`` hardening (issue #64): an output that is no regular file (``/dev/null``, ``/dev/full``, a FIFO) is
written straight and never replaced, an output that cannot be written is refused before the model loads and a write
error is one line (exit 2) saying where the results are, a line the server refuses is refused by batch with the same
verdict, and ``--resume`` never deletes lines that are no result of its input."""

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading

import pytest

from test_batch_cli import run

from kvopt.cli import batch as batch_module

pytestmark = pytest.mark.usefixtures("one_thread")
EPICACHE = "epicache:ratio=0.5,episodes=3,utterances=1,block=64"
USER = [{"role": "user", "content": "Where does the river rise?"}]


def lines_file(path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def device_node(tmp_path, name: str, minor: int):
    """A private character device (1, ``minor``: 3 is /dev/null's, 7 /dev/full's), never the system's; skipped where
    this user may not make one or the folder's filesystem does not open devices (nodev)."""
    node = tmp_path / name
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        os.close(os.open(node, os.O_WRONLY))
    except (PermissionError, OSError) as error:
        pytest.skip(f"cannot make and open a device node here: {error}")
    return node


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the engine (the model) is built: what is refused must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvopt.engine.LLM", refuse)


def model_args(model_folder) -> list[str]:
    return ["--model", str(model_folder), "--kv-memory", "8MB", "--no-metrics"]


# -- outputs that are no regular file are written straight, never replaced -------------------------------------------
def test_a_character_device_output_stays_the_device(model_folder, tmp_path, monkeypatch, capsys):
    null = device_node(tmp_path, "nulldev", 3)
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "Hello", "max_tokens": 2}, {"prompt": "Hi"}])
    code, stderr = run([source, "-o", str(null), *model_args(model_folder)], monkeypatch, capsys)
    assert code == 0, stderr
    assert stat.S_ISCHR(os.stat(null).st_mode) and "wrote 2 results" in stderr
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_a_full_device_is_one_line_and_exit_2(model_folder, tmp_path, monkeypatch, capsys):
    full = device_node(tmp_path, "fulldev", 7)
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "Hello", "max_tokens": 2}])
    code, stderr = run([source, "-o", str(full), *model_args(model_folder)], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"could not write to {full} (No space left on device)" in stderr
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_a_fifo_gets_the_results_in_input_order(model_folder, tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "results"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    # The first line runs longest: it finishes last but comes out first.
    lines = [{"prompt": "one two", "max_tokens": 12, "ignore_eos": True},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": "three", "max_tokens": 1}},
             {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": USER}}]  # fmt: skip
    source = lines_file(tmp_path / "in.jsonl", lines)
    code, stderr = run([source, "-o", str(fifo), "--served-model-name", "tiny", *model_args(model_folder)],
                       monkeypatch, capsys)  # fmt: skip
    reader.join(60)
    assert code == 0, stderr
    results = [json.loads(line) for line in received[0].splitlines()]
    assert [r["custom_id"] for r in results] == ["line-1", "b", "c"] and all(r["error"] is None for r in results)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_resume_onto_a_device_is_refused(tmp_path, monkeypatch, capsys, no_loading):
    null = device_node(tmp_path, "nulldev", 3)  # not a FIFO: reading one without a writer would wait for ever
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "a"}])
    code, stderr = run([source, "-o", str(null), "--resume"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "is a character device, not a file" in stderr, stderr


# -- outputs that cannot be written are refused before the model loads; a late failure keeps the results ------------
def test_an_output_that_cannot_be_created_is_refused_before_loading(tmp_path, monkeypatch, capsys, no_loading):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "a"}])
    code, stderr = run([source, "-o", "/proc/x.jsonl"], monkeypatch, capsys)  # root's os.access says yes here
    assert code == 2 and stderr.count("\n") == 1 and "--output /proc/x.jsonl is not writable" in stderr, stderr


def test_a_folder_where_the_rewrite_cannot_go_is_refused_before_loading(tmp_path, monkeypatch, capsys, no_loading):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "a"}])
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(batch_module.ResultsOutput, "_temporary", lambda self: tmp_path / "gone" / "x.tmp")
    code, stderr = run([source, "-o", str(out)], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "temporary file" in stderr, stderr
    assert not out.exists()  # the file the check created goes again


def test_a_failed_final_rewrite_keeps_every_result(model_folder, tmp_path, monkeypatch, capsys):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": f"hello {i}", "max_tokens": 2} for i in range(3)])
    out = tmp_path / "out.jsonl"

    def no_rename(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(batch_module.os, "replace", no_rename)
    code, stderr = run([source, "-o", str(out), *model_args(model_folder)], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert "all 3 results are there, in the order they finished" in stderr
    finished = sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines())
    assert finished == ["line-1", "line-2", "line-3"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_a_symlinked_output_keeps_its_link(model_folder, tmp_path, monkeypatch, capsys):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "Hello", "max_tokens": 2}])
    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("old\n")
    link.symlink_to(real)
    code, stderr = run([source, "-o", str(link), *model_args(model_folder)], monkeypatch, capsys)
    assert code == 0, stderr
    assert link.is_symlink() and [json.loads(line)["custom_id"] for line in real.read_text().splitlines()] == ["line-1"]


def test_a_write_error_mid_run_keeps_what_was_written_and_resume_completes_it(model_folder, tmp_path, monkeypatch,
                                                                             capsys):  # fmt: skip
    """A file size limit (as a full disk would) stops the writes halfway, a line cut short: exit 2 in one line; then
    ``--resume`` drops the cut line and completes the file in input order."""
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": f"word {i}", "max_tokens": 3, "ignore_eos": True}
                                                for i in range(12)])  # fmt: skip
    out = tmp_path / "out.jsonl"

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1500, resource.RLIM_INFINITY))

    command = [sys.executable, "-m", "kvopt.cli.main", "batch", source, "-o", str(out), *model_args(model_folder),
               "--device", "cpu", "--max-num-seqs", "1"]  # fmt: skip
    failed = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=limited,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1, failed.stderr
    assert f"could not write to {out} (File too large)" in failed.stderr and "rerun with --resume" in failed.stderr
    kept = out.read_text()
    assert 0 < kept.count("\n") < 12  # the writes stopped halfway
    last = kept.rsplit("\n", 1)[1]  # "" where the limit fell right after a line's newline (line lengths vary)
    try:
        json.loads(last)
        cut = False  # cut just before its newline: a whole result, kept
    except ValueError:
        cut = bool(last)
    code, stderr = run([source, "-o", str(out), "--resume", *model_args(model_folder)], monkeypatch, capsys)
    assert code == 0 and ("dropping the last line" in stderr) == cut, stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"line-{i}" for i in range(1, 13)]


# -- --resume never deletes what is no result of this input ------------------------------------------------------------
@pytest.mark.parametrize(
    ("earlier", "fragment"),
    [(['{"custom_id": "other", "error": null, "response": {}}'], "line 1 holds no result of this input"),
     (['{"custom_id": "line-1", "error": null, "response": {}}', "notes I keep here", '{"custom_id": "x"}'],
      "lines 2, 3 hold no result")],
)  # fmt: skip
def test_resume_refuses_lines_that_are_no_results_of_this_input(earlier, fragment, tmp_path, monkeypatch, capsys,
                                                                 no_loading):  # fmt: skip
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out.jsonl"
    lines_file(out, earlier)
    before = out.read_text()
    code, stderr = run([source, "-o", str(out), "--resume"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and fragment in stderr and "remove those lines" in stderr, stderr
    assert out.read_text() == before


# -- a line the server refuses, batch refuses: one schema, one verdict -------------------------------------------------
REFUSED = {
    "another model": ({"prompt": "a", "model": "gpt-4"}, "/v1/completions", "model 'gpt-4' is not served here"),
    "session, lossless": ({"prompt": "a", "session": "notes"}, "/v1/completions", "sessions keep epicache's episodes"),
    "documents": ({"messages": USER, "documents": ["The river rises in the hills."]}, "/v1/chat/completions",
                  "documents need an engine that reuses them"),
    "an empty document": ({"messages": USER, "documents": [""]}, "/v1/chat/completions",
                          "documents[0]: must not be empty"),
    "documents and session": ({"messages": USER, "documents": ["d"], "session": "s", "kv_method": EPICACHE},
                              "/v1/chat/completions", "documents: cannot be combined with session"),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
    import kvopt
    from kvopt.serving import ServerSettings, ThreadedServer

    model, tokenizer = tiny_with_tokenizer
    llm = kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB")
    with ThreadedServer(lambda: llm.engine, ServerSettings("tiny")) as running:
        running.wait_ready()
        yield running


@pytest.mark.parametrize("case", list(REFUSED))
def test_batch_refuses_what_the_server_refuses(case, server, tmp_path, monkeypatch, capsys, no_loading):
    import httpx

    body, url, fragment = REFUSED[case]
    reply = httpx.post(server.url + url, json={**body, "max_tokens": 2}, timeout=60)
    assert reply.status_code in (400, 404), reply.text
    source = lines_file(tmp_path / "in.jsonl", [{"custom_id": "x", "url": url, "body": body}])
    code, stderr = run([source, "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "tiny"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "in.jsonl:1: " in stderr and fragment in stderr, stderr
    server_message = reply.json()["error"]["message"]
    if case != "documents":  # the server without --chunk-caching names the engine's option; batch has none
        assert fragment in server_message, server_message


@pytest.mark.parametrize(
    ("line", "fragment"),
    [({"custom_id": "x", "url": "/v1/embeddings", "body": {"prompt": "a"}},
      "url: input should be '/v1/completions' or '/v1/chat/completions'"),
     ({"custom_id": "x", "url": "/v1/completions", "body": {"messages": USER}},
      'url /v1/completions takes a body with "prompt", and this one has "messages"; send it to /v1/chat/completions'),
     ({"custom_id": "x", "method": "GET", "body": {"prompt": "a"}}, "method: input should be 'POST'"),
     ({"custom_id": "x", "body": {"prompt": "a"}, "priority": 1}, "unknown field 'priority'"),
     ({"custom_id": "x", "prompt": "a"}, '"body" must be a JSON object'),
     ({"body": {"prompt": "a"}}, "custom_id is required"),
     ([{"prompt": "a", "session": "s", "kv_method": EPICACHE}, {"prompt": "b", "session": "s", "kv_method": EPICACHE}],
      "in.jsonl:2: session 's' has a turn on line 1 already"),
     ({"prompt": "a", "session": "s", "kv_method": EPICACHE, "n": 2, "temperature": 1}, "give n=1"),
     ({"prompt": "a", "model": "SmolLM2-135M-Instruct"}, "use 'tiny' or leave model out (--served-model-name)")],
)  # fmt: skip
def test_batch_envelopes_and_sessions_are_checked_before_loading(line, fragment, tmp_path, monkeypatch, capsys,
                                                                 no_loading):  # fmt: skip
    source = lines_file(tmp_path / "in.jsonl", line if isinstance(line, list) else [line])
    code, stderr = run([source, "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "tiny"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and fragment in stderr, stderr


def test_lines_the_server_would_serve_pass(tmp_path):
    """The served model's name, --model as given by default; a session's turn under an engine-wide epicache."""
    source = tmp_path / "in.jsonl"
    lines_file(source, [{"prompt": "a", "model": "/models/x"}, {"prompt": "b", "session": "notes"}])
    requests = batch_module.read_requests(source, 4, batch_module.Serving("/models/x", EPICACHE))
    assert [request.body.session for request in requests] == [None, "notes"]
