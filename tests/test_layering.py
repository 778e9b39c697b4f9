"""Imports point one way: api -> methods -> cache -> kernels; eval sits on top and nothing below imports it.

Read from the source (``ast``), lazy imports inside functions included; imports only for type
checkers (under ``if TYPE_CHECKING:``) do not count.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvopt"


def runtime_imports(path: Path) -> set[str]:
    """Absolute ``kvopt`` modules a file imports at run time (``from kvopt import x`` counts as ``kvopt.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvopt":
                found.update(f"kvopt.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return {name for name in found if name == "kvopt" or name.startswith("kvopt.")}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        # kernels sit at the bottom: storage hands them plain tensors
        ("kernels", ("kvopt.cache", "kvopt.methods", "kvopt.eval", "kvopt.api", "kvopt.engine", "kvopt.serving",
                     "kvopt.cli", "kvopt.codec", "kvopt.tiers", "kvopt.speculative")),  # fmt: skip
        ("cache", ("kvopt.methods", "kvopt.eval", "kvopt.api", "kvopt.engine", "kvopt.serving", "kvopt.cli")),
        ("methods", ("kvopt.eval", "kvopt.api", "kvopt.engine", "kvopt.serving", "kvopt.cli")),
        ("engine", ("kvopt.eval", "kvopt.serving", "kvopt.cli")),
        ("speculative", ("kvopt.eval", "kvopt.engine", "kvopt.serving", "kvopt.cli")),
        # the codec reads and writes cache storage (and rebuilds caches through the api); tiers hold bytes only
        ("codec", ("kvopt.methods", "kvopt.eval", "kvopt.engine", "kvopt.serving", "kvopt.cli", "kvopt.tiers")),
        ("tiers", ("kvopt.cache", "kvopt.methods", "kvopt.eval", "kvopt.api", "kvopt.engine", "kvopt.serving",
                   "kvopt.cli", "kvopt.codec")),  # fmt: skip
    ],
)
def test_lower_layers_never_import_higher_ones(package, forbidden):
    offending = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for name in runtime_imports(path)
        if name == "kvopt" or name.startswith(forbidden)
    }
    assert not offending


def test_the_check_sees_lazy_imports_and_skips_type_only_ones(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvopt.methods.base import Method\n"
        "def build():\n    from kvopt.eval.tasks.text import real_text\n"
        "from kvopt import methods\n"
    )
    assert runtime_imports(source) == {"kvopt.eval.tasks.text", "kvopt.methods"}
