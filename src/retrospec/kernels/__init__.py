"""Hand-written CPU kernels, compiled for the running machine on first use and cached (rank 1: errors, paths).

Only what no maintained library does well here is written by hand (each source file says why). A kernel is built
with PyTorch's extension builder (``torch.utils.cpp_extension.load``: a C++ compiler and ninja) into
``kernels_home()``, keyed by its source, the torch and Python versions and the build flags, so a later process loads
it in milliseconds; where the CPU lacks the instructions, the compiler is missing or the build fails, the kernel is
None (with one warning for a failed build) and its format reports itself unavailable.

- ``w4a8()``: ``w4a8_mm(x, w, sz)``, the ``w4a8`` weight format's matmul (``w4a8.cpp``; AVX-512 VNNI); loading it
  also registers the operator ``torch.ops.retrospec.w4a8_mm`` (with a shape function, so ``torch.export`` traces it).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from ..paths import cache_home

HERE = Path(__file__).resolve().parent
W4A8_FLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")
_BUILT: dict[str, object] = {}  # kernel name -> loaded module, or None where it cannot run here
_SHAPES: list = []  # the operators' shape functions, registered (once per process)


def kernels_home() -> Path:
    """``$RETROSPEC_KERNELS_HOME``, else ``cache_home()/kernels``."""
    return Path(os.environ.get("RETROSPEC_KERNELS_HOME") or cache_home() / "kernels").expanduser()


def w4a8_cpu() -> bool:
    """Whether this CPU (and OS) can run the ``w4a8`` kernel: AVX-512 with VNNI, on Linux (no build is tried)."""
    return sys.platform.startswith("linux") and all(
        getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_supported", "_is_vnni_supported"))


def w4a8():
    """The ``w4a8`` kernel module (``w4a8_mm``), or None where this CPU has no AVX-512 VNNI or it cannot be built."""
    if "w4a8" not in _BUILT:
        built = _build("w4a8", HERE / "w4a8.cpp", W4A8_FLAGS) if w4a8_cpu() else None
        if built is not None and not _SHAPES:  # once per process, however often it is loaded
            _SHAPES.append(torch.library.register_fake("retrospec::w4a8_mm")(_w4a8_shape))
        _BUILT["w4a8"] = built
    return _BUILT["w4a8"]


def _w4a8_shape(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The operator's result without computing it: x [M, K], w [N / 16, K / 32, 256] -> [M, N] float32."""
    return x.new_empty(x.shape[0], w.shape[0] * 16)


def _build(name: str, source: Path, flags: tuple[str, ...]):
    from torch.utils import cpp_extension

    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    folder = kernels_home() / f"{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"retrospec_{name}_{key}.so").exists():
        print(f"[retrospec] compiling the {name} kernel for this machine (once; about half a minute)",
              file=sys.stderr, flush=True)
    scripts = sysconfig.get_path("scripts")  # a pip-installed ninja lives beside this interpreter
    had, path = "PATH" in os.environ, os.environ.get("PATH", "")
    try:
        if scripts and scripts not in path.split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + path  # for the build only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cpp_extension.load(f"retrospec_{name}_{key}", [str(source)], extra_cflags=list(flags),
                                      extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                                      build_directory=str(folder), verbose=False)
    except (RuntimeError, OSError, ImportError, SystemExit) as e:  # no compiler or ninja, a failed build
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        warnings.warn(f"the {name} kernel could not be built here ({why}); the {name} format is unavailable",
                      RuntimeWarning, stacklevel=3)
        return None
    finally:
        if had:
            os.environ["PATH"] = path
        else:
            os.environ.pop("PATH", None)
