"""``kvopt batch`` never loses finished work (issue #35, findings 6-8, 15, 16): lines and the output path are checked
before the model loads, results are written as requests finish, and ``--resume`` completes an interrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_batch_cli import run

from kvopt.cli import batch as batch_module


def lines_file(path, lines: list[dict]):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def choices(path) -> dict[str, list]:
    """Each result's completions by custom_id (what must not depend on how the run was split)."""
    results = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["custom_id"]: [(c["text"], c["token_ids"]) for c in r["response"]["choices"]] for r in results}


def test_a_killed_batch_keeps_its_results_and_resume_completes_it(model_folder, tmp_path):
    words = ["red", "green", "blue", "one", "two", "three", "cat", "dog"]
    source = lines_file(tmp_path / "in.jsonl", [
        {"prompt": f"{words[i % 8]} {words[(i * 3) % 8]} {i}", "max_tokens": 24 + i % 5, "ignore_eos": True}
        for i in range(40)
    ])  # fmt: skip
    command = [sys.executable, "-m", "kvopt.cli.main", "batch", str(source), "--model", str(model_folder),
               "--kv-memory", "8MB", "--max-num-seqs", "1", "--no-metrics", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole.jsonl"
    subprocess.run([*command, "-o", str(whole)], env=env, check=True, capture_output=True, timeout=300)
    assert len(choices(whole)) == 40

    cut = tmp_path / "cut.jsonl"
    process = subprocess.Popen([*command, "-o", str(cut)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (cut.exists() and len(cut.read_text().splitlines()) >= 10):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    kept = cut.read_text().splitlines()
    assert 10 <= len(kept) < 40, "the kill should land halfway"
    kept_choices = {json.loads(line)["custom_id"]: line for line in kept if line.endswith("}")}
    assert len(kept_choices) >= 10

    resumed = subprocess.run([*command, "-o", str(cut), "--resume"], env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "already in" in resumed.stderr
    assert list(choices(cut)) == [f"line-{n}" for n in range(1, 41)]  # input order
    assert choices(cut) == choices(whole)
    for line in cut.read_text().splitlines():  # the kept results were not run again
        custom_id = json.loads(line)["custom_id"]
        if custom_id in kept_choices and kept_choices[custom_id].endswith("}"):
            assert json.loads(line) == json.loads(kept_choices[custom_id])


def test_a_late_failure_keeps_the_finished_results(model_folder, tmp_path, monkeypatch, capsys):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": f"hello {i}", "max_tokens": 3} for i in range(4)])
    finishing = batch_module._results

    def failing(*args):
        for count, item in enumerate(finishing(*args)):
            if count == 2:
                raise OSError("disk gone")
            yield item

    monkeypatch.setattr(batch_module, "_results", failing)
    out = tmp_path / "out.jsonl"
    with pytest.raises(OSError):
        run([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB"], monkeypatch, capsys)
    assert len(out.read_text().splitlines()) == 2


def test_max_tokens_beyond_the_context_fails_that_line_like_the_server(model_folder, tmp_path, monkeypatch, capsys):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 10**9}, {"prompt": "hi", "max_tokens": 3}])
    out = tmp_path / "out.jsonl"
    code, stderr = run([str(source), "-o", str(out), "--model", str(model_folder), "--kv-memory", "8MB"],
                       monkeypatch, capsys)  # fmt: skip
    assert code == 0, stderr
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["response"] is None and "in.jsonl:1: max_tokens=1000000000" in first["error"]
    assert "ask for at most" in first["error"]
    assert second["response"]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"prompt": "a", "seed": "abc"}\n', "in.jsonl:1: seed: input should be a valid integer"),
        ('{"messages": "hi"}\n', "in.jsonl:1: messages: input should be a valid list"),
        ('{"prompt": "a", "max_tokens": "abc"}\n', "in.jsonl:1: max_tokens: input should be a valid integer"),
        ('{"prompt": "a", "temperature": "hot"}\n', "in.jsonl:1: temperature: input should be a valid number"),
        ('{"prompt": "a", "stop": 5}\n', "in.jsonl:1: stop: must be a non-empty string"),
        ('{"prompt": "a", "logprobs": 100000}\n', "in.jsonl:1: logprobs: input should be less than or equal to 20"),
        ('{"prompt": "a\\ud800b"}\n', "in.jsonl:1: prompt: holds a lone surrogate"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}\n', "in.jsonl:1: messages[0].role: input should be"),
        ('{"messages": [{"role": "user"}]}\n', "in.jsonl:1: messages[0].content is required"),
        ('{"messages": [{"role": "user", "content": null}]}\n', "in.jsonl:1: messages[0].content: must be a string"),
        ('{"prompt": "a", "kv_method": "full+full"}\n', "in.jsonl:1: kv_method: names full more than once"),
        ('{"prompt": "a", "n": 2}\n', "in.jsonl:1: SamplingParams.n=2 with temperature=0"),
        ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", "top_k": -1}\n', "in.jsonl:3: top_k"),
        ('{"custom_id": "x", "body": {"prompt": "a"}}\n{"custom_id": "x", "body": {"prompt": "b"}}\n',
         "in.jsonl:2: custom_id 'x' is already used on line 1"),
    ],
)
def test_bad_lines_name_the_line_and_the_field(content, fragment, tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    code, stderr = run([str(source), "-o", str(tmp_path / "out.jsonl")], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and fragment in stderr and "Traceback" not in stderr, stderr


def test_a_file_that_is_not_utf8_names_the_line(tmp_path, monkeypatch, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    code, stderr = run([str(source), "-o", str(tmp_path / "out.jsonl")], monkeypatch, capsys)
    assert code == 2 and "in.jsonl:2: not UTF-8 text (byte 0xff" in stderr, stderr


@pytest.mark.parametrize(
    ("target", "fragment"),
    [("in.jsonl", "is the input file"), ("afile/x.jsonl", "afile is a file, not a folder"),
     ("locked/x.jsonl", "is not writable")],
)  # fmt: skip
def test_outputs_the_run_could_not_write_are_refused_before_loading(target, fragment, tmp_path, monkeypatch, capsys):
    source = lines_file(tmp_path / "in.jsonl", [{"prompt": "a"}])
    (tmp_path / "afile").write_text("")
    (tmp_path / "locked").mkdir(mode=0o500)
    if fragment == "is not writable" and os.access(tmp_path / "locked", os.W_OK):
        pytest.skip("running as a user who may write anywhere")
    loaded = []
    monkeypatch.setattr("kvopt.engine.LLM", lambda *a, **k: loaded.append(1))
    code, stderr = run([str(source), "-o", str(tmp_path / target)], monkeypatch, capsys)
    assert code == 2 and fragment in stderr and not loaded, stderr
    assert source.read_text() == '{"prompt": "a"}\n'
