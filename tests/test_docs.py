"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a missing page or anchor, a
BENCHMARKS.md section that no longer exists fails), the docs' Python examples run as written, and the README stays a
front page: short, its links alive, its table of methods the registry's."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme_examples import BLOCK

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    site = {path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("index.html")}
    assert {"methods/snapkv/index.html", "cli/index.html", "benchmarks/index.html"} <= site
    cli = (tmp_path / "cli" / "index.html").read_text()
    assert "kvopt serve" in cli and "--kv-memory" in cli  # the reference was generated from the typer app


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 190, "README.md is a front page: move detail into docs/"
    for heading in ("## Quickstart", "## Install", "## Methods", "## Results at a glance", "## Architecture"):
        assert heading in text


def test_the_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_readme_table_of_methods_is_the_registry():
    spec = importlib.util.spec_from_file_location("readme_methods", DOCS / "readme_methods.py")
    readme_methods = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_methods)
    text = README.read_text()
    assert readme_methods.rewritten(text) == text, "README.md's table of methods is stale: python docs/readme_methods.py"


#: A paired share with its Wilson interval as the report prints it ("94% [87–98]").
INTERVAL = re.compile(r"\d+% \[\d+–\d+\]")
FENCE = re.compile(r"```[a-z]*\n.*?```", re.DOTALL)


def test_the_docs_quote_only_intervals_the_report_prints():
    """Every share with its interval quoted in the README or the docs is one BENCHMARKS.md prints (or a command's
    recorded output on a docs page shows): a figure copied by hand goes stale when a grid grows, and this names it."""
    texts = {page: page.read_text() for page in [README, *sorted(DOCS.rglob("*.md"))]}
    printed = (ROOT / "BENCHMARKS.md").read_text() + "".join("".join(FENCE.findall(text)) for text in texts.values())
    stale = {f"{page.relative_to(ROOT)}: {quoted}" for page, text in texts.items() for quoted in INTERVAL.findall(text)
             if quoted not in printed}  # fmt: skip
    assert not stale, f"figures BENCHMARKS.md no longer prints (update them from it): {sorted(stale)}"


def doc_blocks() -> list[tuple[str, int, str]]:
    """``(page, line, code)`` of every docs Python block not marked ``<!-- not run: why -->``."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            assert match["why"] is None or match["why"].strip(), f"{page}: say why a block is not run"
            if match["why"] is None:
                line = text.count("\n", 0, match.start("code")) + 1
                found.append((page.relative_to(ROOT).as_posix(), line, match["code"]))
    return found


@pytest.mark.real_model
@pytest.mark.parametrize("page", sorted({page for page, _, _ in doc_blocks()}))
def test_the_docs_python_examples_run_as_written(page, monkeypatch):
    """Each page's blocks run in order in one namespace, as a reader of that page runs them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict = {}
    for where, line, code in doc_blocks():
        if where != page:
            continue
        try:
            exec(compile(code, f"{where}:{line}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"{where} line {line}: {type(error).__name__}: {error}") from error
