"""What every loader of models and stores shares: one-line errors from library exceptions, transformers kept quiet,
and the versioned JSON description of a directory artefact (a LongSpec block, a datastore). Imports only ``errors``.
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
    """The JSON object in ``file``; else a ``RetrospecError`` that starts with ``where``."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RetrospecError(f"{where}: {file.name} is not valid JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise RetrospecError(f"{where}: {file.name} is not a JSON object")
    return data


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
    for file, size in [*(meta.get("files") or {}).items(), *((f, None) for f in required)]:
        if not (path / file).is_file():
            raise RetrospecError(f"{corrupt}: file {file} is missing")
        if size is not None and (path / file).stat().st_size != size:
            raise RetrospecError(f"{corrupt}: file {file} has {(path / file).stat().st_size} bytes, {name} records "
                                 f"{size}")
    return meta
