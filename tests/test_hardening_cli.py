"""Every bad CLI input: exit code 2 and one line on stderr that names the problem and the fix, no
traceback (issue "Hardening" #2, #5, #6, #7, #9); Ctrl-C stops with 130 (#3).

Commands run in-process through ``main()`` (a subprocess each would cost seconds of imports);
one test sends a real SIGINT to a real ``kvopt`` process.
"""

import signal
import subprocess
import sys

import numpy as np
import pytest
from test_model_cache import write_gguf

from kvopt.cli.main import main

SHAPE = ["--kv-heads", "2", "--head-dim", "8"]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Paths of bad inputs: GGUF files, model folders, result folders, plain files."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.gguf").write_bytes(b"")
    (root / "random.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    whole = write_gguf(root / "whole.gguf").read_bytes()
    (root / "truncated.gguf").write_bytes(whole[: len(whole) - 64])
    for name, config in (("only-config", '{"model_type": "llama"}'), ("unknown-type", '{"model_type": "nosuch"}')):
        (root / name).mkdir()
        (root / name / "config.json").write_text(config)
    (root / "notes.txt").write_text("not a model")
    (root / "empty-row").mkdir()
    (root / "empty-row" / "eval.jsonl").write_text("{}\n")
    return root


def run_main(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kvopt", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


ROWS = [
    # usage errors (typer's own exceptions)
    (["generate", "Hi", "--max-new-tokens", "0"], "'--max-new-tokens'"),
    (["generate", "Hi", "--max-new-tokens", "abc"], "'--max-new-tokens'"),
    (["generate"], "Missing argument 'prompt'"),
    (["generate", "Hi", "--no-such-option"], "No such option: --no-such-option"),
    (["no-such-command"], "No such command 'no-such-command'"),
    ([], "no command given"),
    (["bench", "--new-tokens", "1"], "'--new-tokens'"),
    (["memory", "--seq-len", "0"], "'--seq-len'"),
    # impossible shapes
    (["memory", "--layers", "0", *SHAPE], "'--layers'"),
    (["memory", "--layers", "-4", *SHAPE], "'--layers'"),
    (["memory", "--layers", "4", "--kv-heads", "-8", "--head-dim", "-128"], "'--kv-heads'"),
    # specs that cannot work
    (["memory", "--layers", "4", *SHAPE, "--method", "kivi:bits=4+kivi:bits=2"], "kivi appears twice"),
    (["generate", "Hi", "--method", "kivi:bits=2+snapkv:ratio=0.5"], "must come before kivi:bits=2"),
    (["generate", "Hi", "--method", "snapkv:ratio=0.5,ratio=0.7"], "'ratio' is given twice"),
    (["generate", "Hi", "--method", "snapkv++kivi"], "empty method in spec 'snapkv++kivi'"),
    (["generate", "Hi", "--method", "window:size=64+kivi:bits=2,residual=0"], "evicts while decoding"),
    # models that cannot load
    (["generate", "Hi", "--model", "{bad}/empty.gguf"], "is empty, not a GGUF file"),
    (["generate", "Hi", "--model", "{bad}/random.gguf"], "is not a GGUF file"),
    (["generate", "Hi", "--model", "{bad}/truncated.gguf"], "is truncated: "),
    (["generate", "Hi", "--model", "{bad}/only-config"], "no weights"),
    (["memory", "--model", "{bad}/unknown-type"], "model_type 'nosuch'"),
    (["generate", "Hi", "--model", "{bad}/notes.txt"], "is a file but not a model"),
    # devices this machine does not have, or no device at all
    (["generate", "Hi", "--device", "cuda:99"], "device 'cuda:99' is not on this machine"),
    (["generate", "Hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["eval", "--device", "meta"], "device 'meta' is not supported by kvopt"),
    (["bench", "--device", "cuda:99"], "device 'cuda:99' is not on this machine"),
    # outputs that cannot be written
    (["eval", "--out", "{bad}/notes.txt"], "is a file, not a folder"),
    (["eval", "--out", "{bad}/notes.txt/results"], "cannot be created"),
    (["report", "{bad}/empty-row", "--out", "{bad}/notes.txt"], "is a file, not a folder"),
    (["report", "{bad}/empty-row", "--out", "{bad}/notes.txt/report"], "cannot be created"),
    (["bench", "--out", "{bad}/notes.txt"], "is a file, not a folder"),
    # evaluations that would do nothing, or trust a row that is not one
    (["eval", "--methods", ""], "--methods is empty"),
    (["eval", "--task", ""], "--task is empty"),
    (["eval", "--lengths", "0"], "--lengths 0: prompt lengths must be positive"),
    (["bench", "--lengths", "0"], "--lengths needs positive prompt lengths"),
    (["eval", "--out", "{bad}/empty-row"], "line 1: the row lacks task"),
    (["report", "{bad}/empty-row"], "line 1: the row lacks task"),
]


@pytest.mark.parametrize("args, fragment", ROWS, ids=[" ".join(args) or "(no arguments)" for args, _ in ROWS])
def test_bad_input_exits_2_with_one_line(bad, monkeypatch, capsys, args, fragment):
    code, stderr = run_main([arg.format(bad=bad) for arg in args], monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert fragment in lines[0] and ";" in lines[0]  # the problem; then the fix
    assert "Traceback" not in stderr


def test_cache_setting_that_is_a_file(bad, monkeypatch, capsys):
    monkeypatch.setenv("KVOPT_CACHE", str(bad / "notes.txt"))
    code, stderr = run_main(["generate", "Hi"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "KVOPT_CACHE" in stderr and "is a file" in stderr


@pytest.mark.real_model
def test_empty_prompt_without_chat(monkeypatch, capsys):
    code, stderr = run_main(["generate", "", "--no-chat"], monkeypatch, capsys)
    assert code == 2 and stderr.count("\n") == 1 and "the prompt is empty" in stderr


def test_ctrl_c_stops_with_130_and_one_line():
    """A real SIGINT to a real process, while its command runs (the generation is a stand-in that waits)."""
    script = (
        "import os, signal, sys, time\n"
        "import kvopt.engine.streaming\n"
        "def generate(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "kvopt.engine.streaming.stream_through_engine = generate\n"
        "from kvopt.cli.main import main\n"
        "sys.argv = ['kvopt', 'generate', 'Write a long story']\n"
        "main()\n"
    )
    # A job started in the background inherits SIGINT ignored (Python then installs no handler): restore a
    # terminal's default in the child, which is what a user pressing Ctrl-C has.
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            preexec_fn=default_sigint)  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "interrupted"


def test_help_still_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kvopt", "--help"])
    main()
    assert "generate" in capsys.readouterr().out
