"""Imports run one way: cli -> serve / bench -> api -> long_requests -> request -> drafters / models / retrieval.

Checked on the source (AST, every import including lazy ones inside functions), so a circle cannot come back
through a function-level import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "retrospec"
ABOVE_API = {"__init__", "api", "demo"}  # plus the cli/, serve/ and bench/ packages


def imported_modules(path: Path) -> set[str]:
    """Absolute dotted names of every module ``path`` imports (relative imports resolved)."""
    package = ["retrospec", *path.relative_to(SRC).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def below_api() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py"))
            if p.relative_to(SRC).parts[0] not in ("cli", "bench", "serve") and p.stem not in ABOVE_API]


@pytest.mark.parametrize("path", below_api(), ids=lambda p: str(p.relative_to(SRC)))
def test_nothing_below_the_api_imports_it(path):
    assert "retrospec.api" not in imported_modules(path)


def test_request_and_long_requests_sit_below_the_api():
    assert "retrospec.long_requests" not in imported_modules(SRC / "request.py")
    assert "retrospec.request" in imported_modules(SRC / "long_requests.py")
    assert {"retrospec.long_requests", "retrospec.request"} <= imported_modules(SRC / "api.py")
    text = {"__future__", "__future__.annotations", "retrospec.errors", "retrospec.errors.RetrospecError"}
    assert imported_modules(SRC / "text.py") <= text
    assert imported_modules(SRC / "chat.py") <= text | {"dataclasses", "dataclasses.dataclass", "retrospec.text",
                                                        "retrospec.text.encode"}


def test_the_method_registry_is_plain_data():
    assert {m for m in imported_modules(SRC / "drafters" / "registry.py") if m.startswith("retrospec")} <= {
        "retrospec.errors", "retrospec.errors.RetrospecError"}


@pytest.mark.parametrize("path", [p for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] not in
                                  ("cli", "serve")], ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_cli_imports_the_server(path):
    assert not any(m == "retrospec.serve" or m.startswith("retrospec.serve.") for m in imported_modules(path))
