"""The README's Python examples run as written, in order, in one namespace (each continues the ones before, as a
reader's session does). A block that talks to ``kvopt serve`` at ``127.0.0.1:8000`` runs against the same server
(default settings, default model) on a free loopback port, that one address replaced. A block that cannot run here
says why in an HTML comment just before it (``<!-- not run: ... -->``) and is the only kind skipped."""

import re
from pathlib import Path

import pytest

import kvopt
from kvopt.serving import ServerSettings, ThreadedServer

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- not run: (?P<why>.*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)
#: Where the README's server example expects `kvopt serve` (its default port).
SERVE_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.real_model


def blocks() -> list[tuple[int, str | None, str]]:
    """``(line, why it is not run or None, code)`` of every fenced Python block."""
    text = README.read_text()
    found = BLOCK.finditer(text)
    return [(text.count("\n", 0, match.start("code")) + 1, match["why"], match["code"]) for match in found]


def test_the_readme_has_examples_and_says_why_any_is_not_run():
    found = blocks()
    assert len(found) >= 3 and sum(why is None for _, why, _ in found) >= 3
    assert all(why is None or why.strip() for _, why, _ in found)


def test_the_readme_python_examples_run_as_written(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict = {}
    served = [code for _, why, code in blocks() if why is None and SERVE_URL in code]
    assert served, f"the README's server example (an OpenAI client at {SERVE_URL}) is gone or not run"
    settings = ServerSettings("SmolLM2-135M-Instruct")  # what `kvopt serve` names the default model
    with ThreadedServer(lambda: kvopt.LLM(kv_memory="512MB").engine, settings) as server:
        server.wait_ready()
        for line, why, code in blocks():
            if why is not None:
                continue
            try:
                exec(compile(code.replace(SERVE_URL, server.url), f"README.md:{line}", "exec"), namespace)
            except Exception as error:  # noqa: BLE001 - name the block that failed
                raise AssertionError(f"README.md line {line}: {type(error).__name__}: {error}") from error
    assert namespace["reply"].choices[0].message.content, "the served chat answered nothing"
