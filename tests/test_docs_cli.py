"""docs/reference/cli.md is what ``tools/docs_cli.py`` renders from the command's own argparse definitions."""

from __future__ import annotations

from tools.docs_cli import PAGE, render


def test_the_cli_reference_is_current():
    assert PAGE.read_text(encoding="utf-8") == render(), "docs/reference/cli.md is stale: run python -m tools.docs_cli"
