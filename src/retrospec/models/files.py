"""What every loader of models and stores shares: one-line errors from library exceptions, transformers kept quiet,
the readers of artefact files, and the versioned JSON description of a directory artefact (a LongSpec block, a
datastore). Imports only ``errors``.

Contract of the readers (``read_json``, ``read_jsonl``, ``read_tensors``, ``read_array``): a file that is missing,
unreadable, truncated or not what it should be is one ``RetrospecError`` line that starts with the caller's
``where`` ("corrupt corpus runs/c") and names the file (and, for JSON, the line), never a library traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from ..errors import RetrospecError


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def quiet_transformers(capture_stderr: bool = False):
    """transformers' log lines and progress bars off for the duration; ``capture_stderr`` also drops what is written
    to stderr (its GGUF tensor loop writes a bare tqdm bar; failures surface as exceptions)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()) if capture_stderr else contextlib.nullcontext():
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def read_json(file: Path, where: str) -> dict:
    """The JSON object in ``file``; else a ``RetrospecError`` that starts with ``where`` (the decoder's message
    gives the line and column)."""
    file = Path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RetrospecError(f"{where}: {file.name} is not valid JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise RetrospecError(f"{where}: {file.name} is not a JSON object")
    return data


def read_jsonl(file: Path, where: str) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of the JSON-lines file ``file``; a line that is not a JSON
    object (a file cut in the middle of a line) is a ``RetrospecError`` naming the file and the line."""
    file = Path(file)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RetrospecError(f"{where}: cannot read {file.name} ({first_line(exc)})") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RetrospecError(f"{where}: {file.name} line {number} is not valid JSON ({exc.msg}, column "
                                 f"{exc.colno}; a truncated or corrupt file?)") from None
        if not isinstance(obj, dict):
            raise RetrospecError(f"{where}: {file.name} line {number} is not a JSON object")
        out.append((number, obj))
    return out


def read_tensors(file: Path, where: str) -> dict:
    """The tensors of the safetensors file ``file`` (on the CPU); a missing, truncated or corrupt file is a
    ``RetrospecError`` that starts with ``where``."""
    from safetensors.torch import load_file

    file = Path(file)
    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types (header, size) besides OSError
        raise RetrospecError(f"{where}: cannot read {file.name} ({first_line(exc)})") from None


def read_array(file: Path, where: str, mmap_mode: str | None = None):
    """The numpy array in the ``.npy`` file ``file`` (memory-mapped with ``mmap_mode``); a missing, truncated or
    corrupt file is a ``RetrospecError`` that starts with ``where``."""
    import numpy as np

    file = Path(file)
    try:
        array = np.load(file, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise RetrospecError(f"{where}: cannot read {file.name} ({first_line(exc)})") from None
    if not isinstance(array, np.ndarray):
        raise RetrospecError(f"{where}: {file.name} is not a single array")
    return array


def read_description(path: Path, name: str, fmt: str, version: int, what: str, *, absent: str,
                     upgrade: str = "", required: tuple[str, ...] = ()) -> dict:
    """``path/name``, the JSON description of the directory ``path``, checked: its ``"format"`` is ``fmt``, its
    ``"version"`` is ``version``, every file its ``"files"`` records (name -> bytes) has that size, the ``required``
    files exist. Errors name the artefact ``what`` ("LongSpec block"); ``absent``: the error for a directory without
    the description; ``upgrade``: what to do about another version."""
    if not path.exists():
        raise RetrospecError(f"{what} not found: {path}")
    if not path.is_dir():
        raise RetrospecError(f"{what} path is not a directory: {path}")
    if not (path / name).is_file():
        raise RetrospecError(absent)
    corrupt = f"corrupt {what} {path}"
    meta = read_json(path / name, corrupt)
    if meta.get("format") != fmt:
        raise RetrospecError(f"{corrupt}: {name} is not a {what} description")
    if meta.get("version") != version:
        raise RetrospecError(f"{what} {path} has format version {meta.get('version')}; this retrospec reads version "
                             f"{version}{upgrade}")
    files = meta.get("files") or {}
    if not isinstance(files, dict):
        raise RetrospecError(f"{corrupt}: {name} records its files as {type(files).__name__}, not name -> bytes")
    for file, size in [*files.items(), *((f, None) for f in required)]:
        if not (path / file).is_file():
            raise RetrospecError(f"{corrupt}: file {file} is missing")
        if size is not None and (path / file).stat().st_size != size:
            raise RetrospecError(f"{corrupt}: file {file} has {(path / file).stat().st_size} bytes, {name} records "
                                 f"{size}")
    return meta
