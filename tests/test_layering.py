"""Imports run one way, down a rank table; the module graph has no cycles.

Checked on the source (AST, every import including lazy ones inside functions), so neither an upward import nor a
circle can come back through a function-level import. A *unit* is a top-level module (``decode``) or a package
(``retrieval``); a module may import its own unit's modules and units of a strictly lower rank, nothing else.
A new top-level module or package must be given a rank here.

Why this order (docs/architecture.md, "Layers"): shared I/O and data sources (atomic writes and directory builds,
model identity, the stdlib corpus) sit at the bottom, so every layer can build and check artefacts; ``tasks`` (prompt
rows, presets and seeded long-context task rows) is data, read by the bench, the corpus and training alike; the core
(kv, tree, attention -> models -> verify / acceptance / sampling -> drafters -> decode) sits below the request layer
and the API; ``speculative_rag`` is a client of retrieval and models beside the API; ``serve`` runs requests and ``corpus`` (the
target's own outputs) generates beside it; ``bench`` measures requests, and servers through their load generator
(``serve.loadtest``); ``train`` reads the corpus; the CLI and the demo are on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "retrospec"

RANKS: dict[str, int] = {
    # shared I/O and data sources: no retrospec imports, or only errors
    "errors": 0, "types": 0, "paths": 0, "stdlib_corpus": 0,
    "atomic": 1, "identity": 1, "config": 1, "text": 1, "kernels": 1,
    # the core
    "kv": 2, "tree": 2, "attention": 2, "chat": 2, "weight_only": 2, "tasks": 2,
    "fastpath": 3, "models": 3,
    "verify": 4, "acceptance": 4, "sampling": 4,
    "acceptance_rapid": 5, "retrieval": 5, "gating": 5,
    "drafters": 6,
    "decode": 7, "batched": 7, "integrations": 7,
    # requests and the API
    "request": 8,
    "run": 9,
    "api": 10, "speculative_rag": 10,
    # applications
    "__init__": 11, "serve": 11, "corpus": 11,
    "bench": 12, "train": 12,
    "cli": 13,
    "demo": 14,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["retrospec", *parts])


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The retrospec modules ``path`` imports, anywhere in the file (relative imports resolved; ``from pkg import
    mod`` counts as importing ``pkg.mod`` when that is a module, else ``pkg``)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                out.add(f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod)
    return {m for m in out if m == "retrospec" or m.startswith("retrospec.")}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = sorted(SRC.rglob("*.py"))


def test_request_sits_below_run_and_the_api():
    assert "retrospec.run" not in imported_modules(SRC / "request.py")
    assert "retrospec.request" in imported_modules(SRC / "run.py")
    assert "retrospec.request" in imported_modules(SRC / "api.py")
    text = {"__future__", "__future__.annotations", "retrospec.errors", "retrospec.errors.RetrospecError"}
    assert imported_modules(SRC / "text.py") <= text
    assert imported_modules(SRC / "chat.py") <= text | {"dataclasses", "dataclasses.dataclass", "retrospec.text",
                                                        "retrospec.text.encode"}


def test_the_method_registry_is_plain_data():
    assert {m for m in imported_modules(SRC / "drafters" / "registry.py") if m.startswith("retrospec")} <= {
        "retrospec.errors", "retrospec.errors.RetrospecError"}


def test_every_unit_has_a_rank():
    units = {unit(module_name(p)) for p in SOURCES}
    assert units - RANKS.keys() == set(), "give the new module or package a rank in RANKS"
    assert RANKS.keys() - units == set(), "a ranked unit no longer exists: drop it from RANKS"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_down_the_rank_table(path):
    me = unit(module_name(path))
    upward = sorted(m for m in imported_modules(path) if unit(m) != me and RANKS[unit(m)] >= RANKS[me])
    assert upward == [], f"{me} (rank {RANKS[me]}) imports {[(m, RANKS[unit(m)]) for m in upward]}"


def test_the_library_never_imports_the_repository_tools():
    """``tools/`` (development tooling, e.g. the GPU runbook) sits above the library and is not installed with it."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n == "tools" or n.startswith("tools.") for n in names), path


def test_no_import_cycles():
    graph = {module_name(p): imported_modules(p) for p in SOURCES}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if dep == mod or dep == "retrospec" and mod.count(".") == 1:
                continue  # a top-level module naming its own package (``from . import x`` resolved to a module)
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The parser resolves what the table is checked on: lazy (function-level) and relative imports included."""
    mods = imported_modules(SRC / "models" / "loading.py")
    assert "retrospec.models.adapters" in mods and "retrospec.errors" in mods
    lazy = imported_modules(SRC / "cli" / "__init__.py")
    assert any(unit(m) == "cli" and m != "retrospec.cli" for m in lazy)
    assert unit("retrospec.retrieval.store") == "retrieval" and unit("retrospec") == "__init__"


def test_the_architecture_doc_shows_this_rank_table():
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    shown = {}
    for line in doc.split("## Layers", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for unit in cells[1].split(","):
                shown[unit.strip().strip("`").rstrip("/")] = int(cells[0])
    assert shown == {u: r for u, r in RANKS.items() if u != "__init__"}
