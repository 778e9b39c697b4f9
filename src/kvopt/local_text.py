"""The best prose found on this machine (nothing is downloaded), for methods that calibrate and for the evaluation.

Sources in order: Debian's python3-doc reST sources (tutorial, FAQ, HOWTOs), the license texts in
/usr/share/common-licenses, and as a last resort the docstrings of stdlib modules, which every Python has.
The source name travels with the text so results say what was read. It sits at the bottom of the package
(it imports nothing from kvopt) so that the api's calibration and ``kvopt.eval`` read the same text.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from pathlib import Path

PYTHON_DOC_ROOTS = "/usr/share/doc"
LICENSE_DIR = "/usr/share/common-licenses"
MIN_CHARS = 20_000
"""A source shorter than this is a stub (e.g. a doc package without its text files) and is skipped."""

SENTENCE_END = re.compile(r"(?<=[.!?])\s")
_DOC_DIR = re.compile(r"python3(\.\d+)?(-doc)?")
_DOC_SECTIONS = ("tutorial", "faq", "howto")
_STDLIB_MODULES = (
    "argparse", "collections", "csv", "datetime", "email.message", "functools", "http.client", "inspect",
    "itertools", "json", "logging", "pathlib", "random", "re", "statistics", "string", "subprocess",
    "textwrap", "threading", "unittest", "urllib.request", "zipfile",
)  # fmt: skip
_HEADING_RULE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{2,}\s*$")


@functools.lru_cache(maxsize=1)
def real_text() -> tuple[str, str]:
    """``(text, source_name)``: the best local prose, whitespace collapsed; loaded once per process."""
    for found in (python_docs(PYTHON_DOC_ROOTS), licenses(LICENSE_DIR)):
        if found is not None:
            return found
    return stdlib_docstrings()


def python_docs(root: str | Path) -> tuple[str, str] | None:
    """The prose paragraphs of the CPython docs' reST sources under ``root/python3*/html/_sources``."""
    for folder in sorted(Path(root).glob("python3*/html/_sources")):
        if not _DOC_DIR.fullmatch(folder.parent.parent.name):
            continue  # e.g. python3-pip ships its own, unrelated docs
        files = [f for section in _DOC_SECTIONS for f in sorted((folder / section).glob("*.txt"))]
        text = _collapse(" ".join(_prose(f.read_text(errors="replace")) for f in files))
        if len(text) >= MIN_CHARS:
            return text, f"python-docs:{folder} ({', '.join(_DOC_SECTIONS)})"
    return None


def licenses(directory: str | Path) -> tuple[str, str] | None:
    """One text per license family (the longest version, e.g. GPL-3 not also GPL-1/GPL-2): no near-duplicates."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    families: dict[str, Path] = {}
    for path in sorted(p.resolve() for p in folder.iterdir() if p.is_file()):
        family = re.sub(r"-[\d.]+$", "", path.name)
        if family not in families or path.stat().st_size > families[family].stat().st_size:
            families[family] = path
    chosen = [families[name] for name in sorted(families)]
    text = _collapse(" ".join(p.read_text(errors="replace") for p in chosen))
    if len(text) < MIN_CHARS:
        return None
    return text, f"common-licenses:{','.join(p.name for p in chosen)}"


def stdlib_docstrings() -> tuple[str, str]:
    """Docstrings of a fixed list of stdlib modules and their public members (always available)."""
    docs = []
    for name in _STDLIB_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr, member in sorted(vars(module).items()):
            if not attr.startswith("_") and getattr(member, "__module__", None) == name:
                docs.append(inspect.getdoc(member) or "")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return _collapse(" ".join(_prose(doc) for doc in docs)), f"stdlib-docstrings:python{version}"


def _prose(rest: str) -> str:
    """Paragraphs of running text from reST or a docstring: no code, directives, doctests or headings."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", rest):
        lines = paragraph.strip("\n").splitlines()
        if not lines or lines[0][:1].isspace() or lines[0].startswith(("..", ">>>", "::")):
            continue
        if any(_HEADING_RULE.match(line) for line in lines) or not SENTENCE_END.search(paragraph + " "):
            continue
        kept.append(" ".join(lines))
    text = " ".join(kept)
    text = re.sub(r":[\w:.+-]+:`~?([^`<]*?)\s*(<[^>]*>)?`", r"\1", text)  # :role:`target <link>` -> target
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`_+", r"\1", text)  # `label <url>`_ -> label
    return text.replace("``", "").replace("::", ":")


def _collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
