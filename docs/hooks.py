"""mkdocs hooks: the parts of the site that are read from the code, so they cannot go stale.

- ``methods/<name>.md``, one page per registered method (``kvopt.methods.available()``): its summary, paper,
  kind, budget convention, parameters and how the engine serves it, then its module and class through
  mkdocstrings; the Methods section of the nav lists them. A new method file documents itself.
- ``<!-- generated: methods-table -->`` in a page: the table of every registered method.
- ``<!-- generated: cli-reference -->``: every ``kvopt`` command and option, from the typer app.
- ``<!-- generated: layers -->`` and ``<!-- generated: layout -->``: the import layers ``tests/test_layering.py``
  enforces, and every package and module of ``src/kvopt`` with the first line of its docstring.
- ``benchmarks.md``: the repository's ``BENCHMARKS.md`` as a page, so the docs link to its sections and
  ``mkdocs build --strict`` fails on a section that no longer exists.
- ``cluster.md`` joins the nav when the page exists.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvopt"
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_methods import engine_path, kind, methods as _methods, paper_links  # noqa: E402  (docs/ on the path)


def _defaults(cls) -> str:
    import dataclasses

    rows = []
    for field in cls.parameters():
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        shown = "-" if default is dataclasses.MISSING else default
        meaning = field.metadata.get("help", "").replace("|", r"\|")
        rows.append(f"| `{field.name}` | `{shown}` | {meaning} |")
    return "\n".join(["| parameter | default | meaning |", "|---|---|---|", *rows]) if rows else "No parameters."


def method_page(cls) -> str:
    return f"""# `{cls.name}`

{cls.summary}

| | |
|---|---|
| paper | {paper_links(cls)} |
| kind | {kind(cls)} |
| budget | {cls.budget_convention} |
| served by the engine | yes: {engine_path(cls)} ([how](../add-a-method.md#how-a-method-reaches-the-engine)) |
| module | `{cls.__module__}` |

Measurements and the rules for composing it: [the methods table](index.md#every-method-in-detail).
`kvopt methods {cls.name}` prints this page's facts in a terminal.

## Parameters

{_defaults(cls)}

## Module

::: {cls.__module__}
    options:
      members: false
      show_root_heading: false
      show_root_toc_entry: false

## Class

::: {cls.__module__}.{cls.__qualname__}
    options:
      show_root_heading: true
      members_order: source
"""


def methods_table() -> str:
    rows = [
        f"| [`{cls.name}`]({cls.name}.md) | {paper_links(cls)} | {kind(cls)} | {engine_path(cls)} | {cls.summary} |"
        for cls in _methods()
    ]
    header = "| method | paper | kind | served by the engine as | what it does |\n|---|---|---|---|---|"
    return "\n".join([header, *rows])


def cli_reference() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from kvopt.cli.main import app

    command = typer.main.get_command(app)
    ctx = typer.Context(command)
    return get_docs_for_click(obj=command, ctx=ctx, name="kvopt", indent=1).strip()


def layers() -> str:
    """The ``LAYERS`` list of tests/test_layering.py, bottom first, as a Markdown list."""
    tree = ast.parse((ROOT / "tests" / "test_layering.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LAYERS" for t in node.targets):
            rows = []
            for height, layer in enumerate(node.value.elts):
                names = [elt.value if isinstance(elt, ast.Constant) else "the package `__init__`" for elt in layer.elts]
                rows.append(f"{height + 1}. " + ", ".join(n if n.startswith("the ") else f"`{n}`" for n in names))
            return "\n".join(rows)
    raise RuntimeError("tests/test_layering.py has no LAYERS list")


def _first_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except SyntaxError:
        return ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", first)  # Sphinx roles (:class:`X`) as code


def layout() -> str:
    """Every package and module of src/kvopt with the first paragraph of its docstring."""
    out = []

    def walk(folder: Path, depth: int) -> None:
        for path in sorted(folder.iterdir()):
            if path.name.startswith(("_", ".")) and path.name not in ("_version.py",):
                continue
            rel = path.relative_to(PACKAGE.parent).as_posix()
            if path.is_dir() and (path / "__init__.py").exists():
                out.append(f"{'    ' * depth}- **`{rel}/`** {_first_line(path / '__init__.py')}")
                walk(path, depth + 1)
            elif path.suffix == ".py":
                out.append(f"{'    ' * depth}- `{path.name}` {_first_line(path)}")

    walk(PACKAGE, 0)
    return "\n".join(out)


GENERATED = {
    "methods-table": methods_table,
    "cli-reference": cli_reference,
    "layers": layers,
    "layout": layout,
}
MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def on_config(config):
    nav = config["nav"]
    for entry in nav:
        if isinstance(entry, dict) and "Methods" in entry:
            entry["Methods"] = [*entry["Methods"], *({cls.name: f"methods/{cls.name}.md"} for cls in _methods())]
    if (Path(config["docs_dir"]) / "cluster.md").exists():
        at = next((i for i, e in enumerate(nav) if isinstance(e, dict) and "KV tiers and sessions" in e), len(nav) - 1)
        nav.insert(at + 1, {"Cluster": "cluster.md"})
    return config


def on_files(files, config):
    for cls in _methods():
        files.append(File.generated(config, f"methods/{cls.name}.md", content=method_page(cls)))
    files.append(File.generated(config, "benchmarks.md", content=(ROOT / "BENCHMARKS.md").read_text()))
    for image in sorted((ROOT / "benchmarks" / "report").rglob("*.png")):  # BENCHMARKS.md's plots
        files.append(File.generated(config, image.relative_to(ROOT).as_posix(), abs_src_path=str(image)))
    return files


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: GENERATED[m.group(1)](), markdown)


SPHINX_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|obj|exc):(?=<code>)")


def on_post_page(output, page, config):
    """Docstrings name things Sphinx's way (:class:`X`); mkdocstrings renders the name as code and leaves the role."""
    return SPHINX_ROLE.sub("", output)
