"""Benchmark prompt sources: jsonl files and built-in presets.

A jsonl file needs a ``prompt`` or a ``question`` field per line (HumanEval / MBPP files and NQ-open question files
work as they are); every returned row has ``prompt`` set (a ``question`` row gets ``prompt = question``, other
fields kept). Presets need no external data:
- ``heldout``: function headers + docstrings generated deterministically from the standard library's held-out
  packages (never seen in zoo training), for raw code completion;
- ``chat``: ``presets/chat.jsonl``, short instructions and questions written for this project (explain, summarise,
  list, rewrite, how-to, general knowledge, a few code requests), meant for ``--chat`` (one user message each).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from ..errors import RetrospecError
from ..train.corpus import stdlib_files, stdlib_root

PRESETS = ("heldout", "chat")
PRESET_DIR = Path(__file__).parent / "presets"


def load_prompts(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise RetrospecError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise RetrospecError(f"prompts file is not UTF-8 text: {path}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise RetrospecError(f"{path}:{n}: not valid JSON") from None
        if isinstance(row, dict) and "prompt" not in row and isinstance(row.get("question"), str):
            row = {"prompt": row["question"]} | row
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise RetrospecError(f"{path}:{n}: each line needs a non-empty string field 'prompt' or 'question'")
        rows.append(row)
    if not rows:
        raise RetrospecError(f"prompts file has no prompts: {path}")
    return rows


def heldout_prompts(n: int = 20, context_lines: int = 12) -> list[dict]:
    """Prompts = a function's header + docstring (with a few lines of preceding context) from held-out packages.

    Functions are taken in a fixed order spread across the held-out files; the model continues the body.
    """
    root = stdlib_root()
    candidates: list[dict] = []
    for path in stdlib_files("heldout"):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if doc is None or len(node.body) < 3 or first.end_lineno is None:
                continue
            start = max(0, node.lineno - 1 - context_lines)
            prompt = "".join(lines[start:first.end_lineno])
            candidates.append({"prompt": prompt, "source": f"{path.relative_to(root)}:{node.lineno}",
                               "entry_point": node.name})
    if not candidates:
        raise RetrospecError("no held-out prompts could be built from the standard library")
    stride = max(1, len(candidates) // n)
    return candidates[::stride][:n]


def preset(name: str, n: int) -> list[dict]:
    if name == "heldout":
        return heldout_prompts(n)
    if name == "chat":
        return load_prompts(PRESET_DIR / "chat.jsonl")[:n]
    raise RetrospecError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
