"""``retrospec gpu slim`` (``--undo``): for the length of a GPU session, keep the bundled weights out of what a device
call sends unless the call carries them.

Why: a device call sends the tracked tree plus its carries, 64 MiB in all. The tracked tree is ~50 MiB, nearly all of
it bundled weights, which leaves ~13 MiB a call for the real model's 94 MiB GGUF: ten calls, more than a 15-minute
session of device time can afford. ``slim`` takes every tracked file under ``ZOO`` of at least ``MIN_BYTES`` out of
git's index (``git rm --cached``: the file stays on disk, untouched) and lists it in the repository's
``info/exclude``, so it travels only with a call that carries it (``plan.StepSpec.weights``). The tree then weighs
~3 MiB and the GGUF goes in two parts.

Invariants (tested on a scratch repository): files on disk are never touched; ``unslim`` restores exactly the index
entries ``slim`` removed (``git reset -- paths``, from HEAD) and the exclude file as it was; while slim, a
``pre-commit`` hook refuses every commit (one would delete the weights from the repository); both are idempotent.
The list of slimmed paths is ``.gpu/slim.json``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..errors import RetrospecError

ZOO = "src/retrospec/zoo"
MIN_BYTES = 1 << 20
LIST = ".gpu/slim.json"
BEGIN, END = "# retrospec gpu slim: begin", "# retrospec gpu slim: end"
HOOK = """#!/bin/sh
# retrospec gpu slim
echo "retrospec: bundled weights are out of git's index for a GPU session; run 'make gpu-done' before committing" >&2
exit 1
"""


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode:
        raise RetrospecError(f"git {args[0]} failed in {root}: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def _git_path(root: Path, rel: str) -> Path:
    return root / _git(root, "rev-parse", "--git-path", rel).strip()


def slimmed(root: Path) -> list[str]:
    """The paths ``slim`` took out of the index ([] when the tree is whole)."""
    path = root / LIST
    return json.loads(path.read_text())["paths"] if path.is_file() else []


def heavy_files(root: Path) -> list[str]:
    """Tracked files under ``ZOO`` of at least ``MIN_BYTES``, sorted."""
    names = [n for n in _git(root, "ls-files", "-z", "--", ZOO).split("\0") if n]
    return sorted(n for n in names if (root / n).is_file() and (root / n).stat().st_size >= MIN_BYTES)


def _set_exclude(root: Path, paths: list[str]) -> None:
    exclude = _git_path(root, "info/exclude")
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if BEGIN in lines:
        lines = lines[:lines.index(BEGIN)] + lines[lines.index(END) + 1:]
    if paths:
        lines += [BEGIN, *(f"/{p}" for p in paths), END]
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("".join(f"{line}\n" for line in lines))


def slim(root: Path) -> list[str]:
    """Take the heavy bundled files out of the index (see the module docstring); returns their paths."""
    if done := slimmed(root):
        return done
    paths = heavy_files(root)
    if not paths:
        return []
    (root / LIST).parent.mkdir(parents=True, exist_ok=True)
    (root / LIST).write_text(json.dumps({"paths": paths}, indent=1) + "\n")  # first: unslim knows what to restore
    _set_exclude(root, paths)
    hook = _git_path(root, "hooks/pre-commit")
    if not hook.exists():
        hook.parent.mkdir(parents=True, exist_ok=True)
        hook.write_text(HOOK)
        hook.chmod(0o755)
    _git(root, "rm", "-q", "--cached", "--", *paths)
    return paths


def unslim(root: Path) -> list[str]:
    """Put the slimmed paths back into the index from HEAD, drop the exclude block and the hook; returns the paths."""
    paths = slimmed(root)
    if paths:
        _git(root, "reset", "-q", "--", *paths)
    _set_exclude(root, [])
    hook = _git_path(root, "hooks/pre-commit")
    if hook.is_file() and hook.read_text() == HOOK:
        hook.unlink()
    (root / LIST).unlink(missing_ok=True)
    return paths
