"""The zoo's training corpus: the standard library of the running interpreter (bottom rank: no retrospec imports).

Every machine that runs retrospec has this corpus, so the bundled models can be rebuilt anywhere, offline.

Invariants:
- File order is deterministic (sorted relative paths); any shuffling is done by the caller with a seed.
- Test suites (``test``/``tests``/``idle_test`` directories) and ``site-packages`` are excluded.
- The packages in ``HELDOUT_PACKAGES`` never enter training; they are the evaluation split (demo prompts,
  held-out loss, long-context repository tasks).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Held-out evaluation packages: multi-file, idiomatic, and not imported by the rest of the corpus's hot paths.
HELDOUT_PACKAGES: tuple[str, ...] = ("email", "json", "http", "xmlrpc")

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "ensurepip"}


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_heldout(rel: Path) -> bool:
    return rel.parts[0] in HELDOUT_PACKAGES or rel.stem in HELDOUT_PACKAGES and len(rel.parts) == 1


def stdlib_files(split: str = "train", root: Path | None = None) -> list[Path]:
    """Source files of the ``train`` or ``heldout`` split, in deterministic order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    want_heldout = split == "heldout"
    return [p for p in _python_files(root) if _is_heldout(p.relative_to(root)) == want_heldout]


def read_texts(files: list[Path]) -> list[str]:
    """File contents, skipping files that are not valid UTF-8 or are empty."""
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts
