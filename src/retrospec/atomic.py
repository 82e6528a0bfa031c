"""Atomic file and directory writes, shared by every layer (bottom rank: imports only ``errors``).

``write_text_atomic`` writes a hidden temporary file and renames it over the destination (``os.replace``): a reader
sees the old file or the new one, never half of one. ``atomic_build`` does the same for a directory (datastores,
LongSpec blocks, adapters, zoo models): it is renamed into place only after the block completes and wrote its
marker file (``meta.json`` by default); the next build of the same destination removes a dead process's leftovers.
Without ``overwrite``, a destination that another process filled while this one built is left as it is (this build
is discarded, a ``RetrospecError`` says so): a reader of that directory never sees it swapped away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .errors import RetrospecError

META_FILE = "meta.json"


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


@contextlib.contextmanager
def atomic_build(dest: str | Path, overwrite: bool = False, required: str = META_FILE):
    """Yield a fresh temporary directory next to ``dest``; rename it to ``dest`` when the block completes and wrote
    ``required`` (the marker of a finished directory). On any exception it is removed and ``dest`` is untouched."""
    dest = Path(dest)
    if dest.exists() and not overwrite:
        if not dest.is_dir() or any(dest.iterdir()):
            raise RetrospecError(f"{dest} already exists; choose another --out or pass --overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # leftovers of killed builds
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not (tmp / required).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"build of {dest} finished without writing {required}")
    if dest.exists() and not overwrite and (not dest.is_dir() or any(dest.iterdir())):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RetrospecError(f"{dest} appeared while building; left it as it is")
    trash = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        dest.rename(trash)
    tmp.rename(dest)
    shutil.rmtree(trash, ignore_errors=True)
