"""Atomic file writes, shared by every layer (bottom rank: imports nothing from retrospec).

``write_text_atomic`` writes a hidden temporary file next to the destination and renames it over the destination
(``os.replace``), so a reader sees the old file or the new one, never half of one, and a killed writer leaves only
the hidden temporary file. Directories that appear whole use ``retrieval.store.atomic_build``.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
