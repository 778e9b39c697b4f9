"""The README's Python examples run as written, in order, in one namespace (each continues the ones before, as a
reader's session does). A block that cannot run here says why in an HTML comment just before it
(``<!-- not run: ... -->``) and is the only kind skipped."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- not run: (?P<why>.*?) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)

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
    for line, why, code in blocks():
        if why is not None:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README.md line {line}: {type(error).__name__}: {error}") from error
