"""``python -m tools.gpu slim`` (``--undo``): for the length of a GPU session, keep the bundled weights out of what a
device call sends unless the call carries them.

Why: a device call sends the tracked tree plus its carries, 64 MiB in all. The tracked tree is ~50 MiB, nearly all of
it bundled weights, which leaves ~13 MiB a call for the real model's 94 MiB GGUF: ten calls, more than a 15-minute
session of device time can afford. ``slim`` takes every tracked file under ``ZOO`` of at least ``MIN_BYTES``, and
the packed corpora under ``CORPUS`` (no step reads them), out of git's index (``git rm --cached``: the file stays on
disk, untouched) and lists it in the repository's ``info/exclude``, so it travels only with a call that carries it
(``plan.StepSpec.weights``). The tree then weighs ~3 MiB and the GGUF goes in two parts.

Invariants (tested on a scratch repository): files on disk are never touched; ``unslim`` restores exactly the index
entries ``slim`` removed (mode, blob and path, recorded before any change: a staged edit comes back staged) and the
exclude file as it was, and fails loudly if a path is not back; while slim, a ``pre-commit`` hook refuses every commit
(one would delete the weights from the repository), and ``slim`` refuses to start when someone else's hook is in the
way; both are idempotent, and a ``slim`` interrupted half-way is finished by the next one. The record
(``info/retrospec-slim.json`` in git's own directory, beside the exclude file and the hook: ``rm -rf .gpu`` or
``git clean`` cannot lose it) names the worktree that was slimmed; ``unslim`` elsewhere refuses.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from retrospec.errors import RetrospecError

ZOO = "src/retrospec/zoo"
MIN_BYTES = 1 << 20
CORPUS = "corpus"  # the packed corpora kept in the repository: no device call needs them, whatever their size
RECORD = "info/retrospec-slim.json"  # under git's common directory (``git rev-parse --git-path``)
# the markers of what slim writes into git's directory: unslim recognises its own exclude block and hook by them, so
# they stay as they are whatever the command is called
BEGIN, END = "# retrospec gpu slim: begin", "# retrospec gpu slim: end"
HOOK = """#!/bin/sh
# retrospec gpu slim
echo "retrospec: bundled weights are out of git's index for a GPU session; run 'make gpu-done' before committing" >&2
exit 1
"""


def _git(root: Path, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, input=stdin)
    if proc.returncode:
        raise RetrospecError(f"git {args[0]} failed in {root}: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def _git_path(root: Path, rel: str) -> Path:
    return root / _git(root, "rev-parse", "--git-path", rel).strip()


def _record(root: Path) -> dict | None:
    path = _git_path(root, RECORD)
    return json.loads(path.read_text()) if path.is_file() else None


def slimmed(root: Path) -> list[str]:
    """The paths ``slim`` took out of this worktree's index ([] when the tree is whole)."""
    rec = _record(root)
    return rec["paths"] if rec and Path(rec["worktree"]) == root.resolve() else []


def heavy_files(root: Path) -> list[str]:
    """Tracked files under ``ZOO`` of at least ``MIN_BYTES`` and every tracked file under ``CORPUS``, sorted."""
    tracked = lambda folder: [n for n in _git(root, "ls-files", "-z", "--", folder).split("\0") if n]
    zoo = [n for n in tracked(ZOO) if (root / n).is_file() and (root / n).stat().st_size >= MIN_BYTES]
    return sorted(zoo + tracked(CORPUS))


def _set_exclude(root: Path, paths: list[str]) -> None:
    """Replace the block between BEGIN and END (a lost END: the zoo and corpus lines after BEGIN) by ``paths``'."""
    exclude = _git_path(root, "info/exclude")
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if BEGIN in lines:
        start = lines.index(BEGIN)
        stop = start + 1
        while stop < len(lines) and lines[stop].startswith((f"/{ZOO}/", f"/{CORPUS}/")):
            stop += 1
        stop += stop < len(lines) and lines[stop] == END
        lines = lines[:start] + lines[stop:]
    if paths:
        lines += [BEGIN, *(f"/{p}" for p in paths), END]
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("".join(f"{line}\n" for line in lines))


def slim(root: Path) -> list[str]:
    """Take the heavy bundled files out of the index (see the module docstring); returns their paths."""
    root = root.resolve()
    rec = _record(root)
    if rec and Path(rec["worktree"]) != root:
        raise RetrospecError(f"{rec['worktree']} is slim: run 'make gpu-done' there first")
    hook = _git_path(root, "hooks/pre-commit")
    if hook.exists() and hook.read_text() != HOOK:
        raise RetrospecError(f"{hook} exists: it would not stop a commit that deletes the weights; move it aside "
                             "for the GPU session")
    if rec is None:
        paths = heavy_files(root)
        if not paths:
            return []
        entries = _git(root, "ls-files", "-s", "--", *paths)  # "mode blob stage\tpath" lines, as they are now
        rec = {"worktree": str(root), "paths": paths, "entries": entries}
        path = _git_path(root, RECORD)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=1) + "\n")  # first: an interrupted slim is finished or undone from it
    _set_exclude(root, rec["paths"])
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(HOOK)
    hook.chmod(0o755)
    _git(root, "rm", "-q", "-f", "--cached", "--ignore-unmatch", "--", *rec["paths"])  # the record restores any edit
    return rec["paths"]


def unslim(root: Path) -> list[str]:
    """Put the recorded index entries back, drop the exclude block and the hook; returns the paths."""
    root = root.resolve()
    rec = _record(root)
    if rec is None:
        return []
    if Path(rec["worktree"]) != root:
        raise RetrospecError(f"{rec['worktree']} is slim, not {root}: run 'make gpu-done' there")
    _git(root, "update-index", "--add", "--index-info", stdin=rec["entries"])
    missing = set(rec["paths"]) - set(_git(root, "ls-files", "-z", "--", *rec["paths"]).split("\0"))
    if missing:
        raise RetrospecError(f"not back in git's index: {', '.join(sorted(missing))} (the hook stays; restore them "
                             "with 'git reset -q -- src/retrospec/zoo corpus')")
    _set_exclude(root, [])
    hook = _git_path(root, "hooks/pre-commit")
    if hook.is_file() and hook.read_text() == HOOK:
        hook.unlink()
    _git_path(root, RECORD).unlink()
    return rec["paths"]
