"""Imports point one way: each part of kvopt (a subpackage or top-level module) imports only lower layers.

Layers, bottom first; a part imports parts of lower layers only (not its own layer's, not higher ones):

    errors, _version, local_text,  errors, the version, the best prose on this machine, embedded word lists:
    words                          import nothing
    paths, tiers                   file places (the cache folder); tiers hold bytes
    kernels                        take plain tensors (the CPU kernel is built into the cache folder)
    models                         model shape facts and loading; knows no kvopt storage
    cache                          storage and kvopt's attention
    methods                        what to keep and how to encode it, acting on cache storage
    guards, memory                 checks and byte estimates of a spec on a model
    api                            models and caches ready for use (load_model, build_cache)
    codec, runtime                 saving caches (rebuilt from their spec through the api); budgeted generation
    chunks, episodes               chunk KV reused at any position (stored through the codec), blending; a
                                   conversation's episode caches (saved through the codec)
    speculative                    drafting and verifying on api caches
    engine                         the paged serving engine
    serving, eval                  the HTTP server; the evaluation grid
    cluster                        replicas on Ray Serve behind a KV-aware router; batch on Ray Data
    cli                            the command line
    kvopt                          the package ``__init__``: the public face re-exports; nothing inside imports it

Read from the source (``ast``), lazy imports inside functions and relative imports included; imports only for
type checkers (under ``if TYPE_CHECKING:``) do not count. ``from kvopt import x`` is part ``x`` when ``x`` is a
module, and the package ``__init__`` otherwise (``from kvopt import __version__``).
"""

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvopt"
FACE = "kvopt"
LAYERS = [
    ("errors", "_version", "local_text", "words"),
    ("paths", "tiers"),
    ("kernels",),
    ("models",),
    ("cache",),
    ("methods",),
    ("guards", "memory"),
    ("api",),
    ("codec", "runtime"),
    ("chunks", "episodes"),
    ("speculative",),
    ("engine",),
    ("serving", "eval"),
    ("cluster",),
    ("cli",),
    (FACE,),
]
LAYER_OF = {part: height for height, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """Absolute ``kvopt`` modules a file imports at run time (``from kvopt import x`` counts as ``kvopt.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(filter(None, (base, node.module)))
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == root.name or name.startswith(f"{root.name}.")}


def part_of(module: str, root: Path = PACKAGE) -> str:
    """The top-level part a ``kvopt...`` module name lies in; names that are no module are the package face."""
    first = module.split(".")[1] if "." in module else ""
    return first if (root / first).is_dir() or (root / f"{first}.py").is_file() else FACE


def file_part(path: Path, root: Path = PACKAGE) -> str:
    relative = path.relative_to(root)
    return FACE if relative == Path("__init__.py") else relative.parts[0].removesuffix(".py")


def package_imports(root: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """For each part, the parts it imports, each with one ``file imports module`` line as evidence."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        source = file_part(path, root)
        edges = graph.setdefault(source, {})
        for module in sorted(runtime_imports(path, root)):
            target = part_of(module, root)
            if target != source:
                edges.setdefault(target, f"{path.relative_to(root)} imports {module}")
    return graph


def back_pointing(graph: dict[str, dict[str, str]]) -> list[str]:
    return sorted(
        f"{why} (layer {LAYER_OF[source]} -> {LAYER_OF[target]})"
        for source, edges in graph.items()
        for target, why in edges.items()
        if LAYER_OF[target] >= LAYER_OF[source]
    )


GRAPH = package_imports()


def test_every_part_has_a_layer():
    assert set(GRAPH) == set(LAYER_OF)


@pytest.mark.parametrize("part", sorted(LAYER_OF))
def test_each_part_imports_only_lower_layers(part):
    assert back_pointing({part: GRAPH.get(part, {})}) == []


def test_the_package_graph_has_no_cycle():
    graphlib.TopologicalSorter({part: set(edges) for part, edges in GRAPH.items()}).prepare()


def test_the_check_sees_lazy_relative_and_face_imports_and_skips_type_only_ones(tmp_path):
    root = tmp_path / "kvopt"
    for folder in ("cache", "models"):
        (root / folder).mkdir(parents=True)
    (root / "api.py").write_text("")
    source = root / "cache" / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvopt.methods.base import Method\n"
        "def build():\n    from kvopt.api import build_cache\n"
        "from kvopt import __version__\n"
        "from ..models import info\n"
    )
    assert runtime_imports(source, root) == {"kvopt.api.build_cache", "kvopt.__version__", "kvopt.models.info"}
    graph = package_imports(root)
    assert set(graph["cache"]) == {"api", FACE, "models"}
    assert back_pointing(graph) == [
        f"cache/sample.py imports kvopt.__version__ (layer {LAYER_OF['cache']} -> {LAYER_OF[FACE]})",
        f"cache/sample.py imports kvopt.api.build_cache (layer {LAYER_OF['cache']} -> {LAYER_OF['api']})",
    ]
