"""BENCHMARKS.md's structure (#41): one title, "What holds on both models" first, then a table of contents linking
every section, each section opening with the command that regenerates it and the days its rows were measured; and
the generator (benchmarks/run.py) reproduces the committed file from the committed rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run  # noqa: E402

TEXT = (ROOT / "BENCHMARKS.md").read_text()
HEADINGS = re.findall(r"^## (.+)$", TEXT, flags=re.M)
DAY = r"\d{4}-\d{2}-\d{2}"
OPENING = re.compile(rf"Measured {DAY}(?: / {DAY})* with `python benchmarks/\w+\.py[^`]*`")
#: The part of the intro that names the machine composing the file (not the rows'): left out of the comparison.
MACHINE = re.compile(r"^Machine: \d+ CPU cores, torch \S+, transformers \S+\. ", flags=re.M)


def test_one_title_at_the_top():
    assert TEXT.startswith(f"{run.TITLE}\n")
    assert re.findall(r"^# .*$", TEXT, flags=re.M) == [run.TITLE]


def test_the_headline_table_comes_first_then_the_contents_list_every_section():
    intro, _, rest = TEXT.partition("\n## ")
    assert "\n|" not in intro and HEADINGS[0] == run.SUMMARY.removeprefix("## ")
    headline = rest.partition("\n## ")[0]
    assert "\n| headline |" in headline
    contents = re.findall(r"^- \[(.+)\]\(#([^)]+)\)$", headline.partition("**Contents**")[2], flags=re.M)
    assert contents == [(heading, run.anchor(heading)) for heading in HEADINGS]


def test_the_contents_anchors_are_those_github_and_mkdocs_give():
    """GitHub renders the file, the docs site includes it (``mkdocs build --strict`` checks its anchors): each
    section's anchor must be the same in both, and no earlier heading may take it (both would suffix it)."""
    slugify = pytest.importorskip("markdown.extensions.toc").slugify
    seen = set()
    for level, heading in re.findall(r"^(#+) (.+)$", TEXT, flags=re.M):
        slug = slugify(heading.replace("`", ""), "-")  # mkdocs slugifies the rendered text: code spans unwrapped
        if level == "##":
            assert run.anchor(heading) == slug, heading
            assert slug not in seen, f"{heading}: an earlier heading has its anchor"
        seen.add(slug)


@pytest.mark.parametrize("heading", HEADINGS)
def test_every_section_opens_with_its_command_and_the_days_its_rows_were_measured(heading):
    section = TEXT.split(f"\n## {heading}\n", 1)[1]
    first = next(line for line in section.splitlines() if line.strip())
    assert OPENING.match(first), first


@pytest.mark.real_model
def test_the_generator_reproduces_it_from_the_committed_rows(tmp_path):
    """``python benchmarks/run.py --steps none`` composed here (plots into a scratch folder) gives the committed
    file, but for the machine composing it. Skipped while rows are not committed (a run in progress writes them):
    the file is composed from committed rows, and git gives the days of rows without a date stamp."""
    pytest.importorskip("matplotlib")
    changed = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
    if changed.returncode or changed.stdout.strip():
        pytest.skip(f"rows not committed, or no git checkout: {(changed.stdout or changed.stderr).strip()[:200]}")
    args = run.with_model_defaults(run.arguments().parse_args(["--steps", "none"]))
    composed = run.composed(args, tmp_path, TEXT)
    assert MACHINE.search(TEXT) and MACHINE.search(composed)
    assert MACHINE.sub("", composed) == MACHINE.sub("", TEXT), "BENCHMARKS.md is stale: python benchmarks/run.py --steps none"
