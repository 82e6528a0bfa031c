"""Ahead-of-time compiled programs: compiled once per machine and signature, cached, called without Python per op.

A program is a small ``torch.nn.Module`` exported with ``torch.export`` (rows dynamic) and compiled with AOTInductor
(``aoti_compile_and_package``); the package lands under ``cache_home()/compiled/``, keyed by ``key`` (the program's
kind and signature, this machine, the torch version and thread count), and is loaded once per process. ``runner``
returns the package's C++ runner as ``run(list of tensors) -> list of tensors``: ~4 us per call, where the module's
Python ``__call__`` would add tens of microseconds of argument handling. Callers decide what to compile and check
what they get (``fastpath.compiled``).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import torch

from ..paths import cache_home
from .plan import machine_id

MAX_ROWS = 4096  # the programs' largest T (a longer forward runs the lean loop)
PROGRAM_VERSION = 7
_LOADED: dict[str, object] = {}  # package path -> loaded runner (one per process)


def key(kind: str, signature: tuple) -> str:
    text = json.dumps([PROGRAM_VERSION, kind, machine_id(), torch.__version__, torch.get_num_threads(),
                       repr(signature)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def rows_dim() -> "torch.export.Dim":
    return torch.export.Dim("rows", min=1, max=MAX_ROWS)


def runner(program: torch.nn.Module, example: list[torch.Tensor], name: str, dims: tuple, progress=None,
           what: str = "a decoder layer"):
    """The loaded runner of ``program`` for inputs like ``example`` with ``torch.export`` dynamic ``dims`` (compiled
    and cached under ``name`` = ``key(...)`` on first use): ``run(list) -> list``."""
    folder = cache_home() / "compiled"
    path = folder / f"{name}.pt2"
    if str(path) in _LOADED:
        return _LOADED[str(path)]
    if not path.exists():
        if progress:
            progress(f"compiling {what} ahead of time ({type(program).__name__.strip('_').lower()}, "
                     "once per machine and model shape; about half a minute)")
        folder.mkdir(parents=True, exist_ok=True)
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations inside export
            exported = torch.export.export(program, tuple(example), dynamic_shapes=dims, strict=False)
        tmp = folder / f".{name}.{os.getpid()}.pt2"
        try:
            # serial loops: a program's own loops are a few rows' elementwise work (microseconds), less than a
            # parallel region's fork and join; the kernels it calls (matmuls, attention) run their own threads
            with warnings.catch_warnings(), torch._inductor.config.patch({"cpp.threads": 1}):
                warnings.simplefilter("ignore", FutureWarning)
                torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        loaded = torch._inductor.aoti_load_package(str(path))
    run = getattr(getattr(loaded, "loader", None), "run", None)  # the C++ runner: no per-call pytree handling
    if run is None:
        run = lambda args, _m=loaded: list(_m(*args))  # noqa: E731
    _LOADED[str(path)] = run
    return run
