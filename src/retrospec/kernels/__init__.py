"""Hand-written CPU kernels, compiled for the running machine on first use and cached (rank 1: errors, paths).

Only what no maintained library does well here is written by hand (each source file says why). A kernel is built
with PyTorch's extension builder (``torch.utils.cpp_extension.load``: a C++ compiler and ninja) into
``kernels_home()``, keyed by its source, the torch and Python versions and the build flags, so a later process loads
it in milliseconds; where the CPU lacks the instructions, the compiler is missing or the build fails, the kernel is
None (with one warning for a failed build) and what needs it reports itself unavailable. Loading a kernel also
registers its operator (``torch.ops.retrospec.<name>``, with a shape function, so ``torch.export`` traces it and
compiled programs call it).

- ``w4a8()``: ``w4a8_mm(x, w, sz)``, the ``w4a8`` weight format's matmul (``w4a8.cpp``; AVX-512 VNNI).
- ``f32()``: ``f32_mm(x, w)``, ``x @ w.T`` in float32 for up to 64 rows, each row's bits independent of the others
  (``f32.cpp``; AVX-512 or AVX2): one of the float32 matmul paths ``fastpath.plan`` measures.
- ``w8a8()``: ``w8a8_mm(x, qweight, handle)``, the ``w8a8`` format's matmul by fbgemm's prepacked weights held under
  a handle (``w8a8_hold`` / ``w8a8_release``), so a compiled layer can call it (``w8a8.cpp``; glue only, where this
  build has fbgemm).
- ``attention()``: ``attention(qkv, kbuf, vbuf, bias, heads, scaling)``, rows' attention over a cache, each row's bits
  depending only on the keys it sees (``attention.cpp``; portable C++ in vectors of the CPU's width, ``vector_width``):
  the compiled decoder layers' attention (``fastpath.compiled``).
- ``sources_digest()``: a digest of the sources, for caches of measurements that depend on them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from ..paths import cache_home

HERE = Path(__file__).resolve().parent
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
F32_FLAGS = ("-O3", "-fopenmp", *AVX512_FLAGS)
W4A8_FLAGS = (*F32_FLAGS, "-mavx512vnni")
VECTOR_FLAGS = {"avx512": AVX512_FLAGS, "avx2": ("-mavx2", "-mfma"), "portable": ()}  # attention builds, widest 1st
_BUILT: dict[str, object] = {}  # kernel name -> loaded module, or None where it cannot run here
_SHAPES: dict[str, object] = {}  # operator -> its registered shape function (once per process)


def kernels_home() -> Path:
    """``$RETROSPEC_KERNELS_HOME``, else ``cache_home()/kernels``."""
    return Path(os.environ.get("RETROSPEC_KERNELS_HOME") or cache_home() / "kernels").expanduser()


def avx512_cpu(vnni: bool = False) -> bool:
    """Whether this CPU (and OS) has AVX-512 (and VNNI, where asked): what the kernels need (no build is tried)."""
    probes = ("_is_avx512_supported", "_is_vnni_supported") if vnni else ("_is_avx512_supported",)
    return sys.platform.startswith("linux") and all(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def w4a8_cpu() -> bool:
    """Whether this CPU can run the ``w4a8`` kernel: AVX-512 with VNNI, on Linux."""
    return avx512_cpu(vnni=True)


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel's source: measurements of code that calls the kernels (a compiled program's timing
    verdict) keep it and are taken again when a kernel changes."""
    text = b"\0".join(path.read_bytes() for path in sorted(HERE.glob("*.cpp")))
    return hashlib.sha256(text).hexdigest()[:16]


def w4a8():
    """The ``w4a8`` kernel module (``w4a8_mm``), or None where this CPU has no AVX-512 VNNI or it cannot be built."""
    return _kernel("w4a8", W4A8_FLAGS, w4a8_cpu(), lambda x, w, sz: x.new_empty(x.shape[0], w.shape[0] * 16),
                   "the w4a8 format is unavailable")


def f32():
    """The ``f32`` kernel module (``f32_mm``), or None where this CPU has neither AVX-512 nor AVX2 or it cannot be
    built (AVX-512: 16 floats a vector; AVX2 with FMA: 8, so its bits differ from an AVX-512 machine's)."""
    width = vector_width()
    flags = F32_FLAGS if width == "avx512" else ("-O3", "-fopenmp", *VECTOR_FLAGS["avx2"])
    runs = width != "portable" and sys.platform.startswith("linux")  # as the AVX-512 probe: built and run on Linux
    return _kernel("f32", flags, runs, lambda x, w: x.new_empty(x.shape[0], w.shape[0]),
                   "float32 matmuls stay PyTorch's",
                   more={"f32_mm_cat": lambda x, ws: x.new_empty(x.shape[0], sum(w.shape[0] for w in ws))})


def w8a8():
    """The ``w8a8`` operators (``w8a8_hold``, ``w8a8_release``, ``w8a8_mm``), or None where this build has no fbgemm
    or they cannot be built."""
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")
    return _kernel("w8a8", ("-O2",), fbgemm, lambda x, qweight, handle: x.new_empty(x.shape[0], qweight.shape[0]),
                   "w8a8 layers are not compiled", python_module=False)


def vector_width() -> str:
    """Which of ``VECTOR_FLAGS`` the attention kernel is built with here: ``avx512`` (16 floats a vector), ``avx2``
    (8, with FMA) or ``portable`` (4: SSE, NEON; the compiler's own choice of instructions)."""
    if avx512_cpu():
        return "avx512"
    avx2 = getattr(torch.cpu, "_is_avx2_supported", lambda: False)()
    return "avx2" if avx2 and _has_fma() else "portable"


@functools.cache
def _has_fma() -> bool:
    """Whether the CPU has FMA (every AVX2 CPU but a rare few): /proc/cpuinfo's flags where there is one."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return True
    return not flags or " fma " in f" {flags.split(':', 1)[-1]} "


def attention():
    """The ``attention`` kernel module, or None where it cannot be built (no C++ compiler)."""
    vector = VECTOR_FLAGS[vector_width()]
    return _kernel("attention", ("-O3", "-fopenmp", "-ffp-contract=off", *vector), True,
                   lambda qkv, kbuf, vbuf, bias, heads, scaling: qkv.new_empty(qkv.shape[0], heads * qkv.shape[2]),
                   "decoder layers are not compiled", op="attention")


def _kernel(name: str, flags: tuple[str, ...], runs_here: bool, shape, without: str, op: str | None = None,
            more: dict | None = None, python_module: bool = True):
    """The loaded kernel ``name`` (``<name>.cpp``), its operator's (``op``, else ``<name>_mm``) ``shape`` function
    registered (and those of its ``more`` operators: {name: shape}); built on first use. ``python_module``: the
    source has Python bindings besides its operators (else only operators: a faster build, loaded as a library)."""
    if name not in _BUILT:
        built = _build(name, HERE / f"{name}.cpp", flags, without, python_module) if runs_here else None
        if built is not None and name not in _SHAPES:  # once per process, however often it is loaded
            _SHAPES[name] = [torch.library.register_fake(f"retrospec::{o}")(fn)
                             for o, fn in {op or name + "_mm": shape, **(more or {})}.items()]
        _BUILT[name] = built
    return _BUILT[name]


def _build(name: str, source: Path, flags: tuple[str, ...], without: str, python_module: bool = True):
    """The kernel's library loaded from ``kernels_home()``, built there first where it is missing. Every load and
    build holds an OS lock on the folder (``flock``: released by the OS when its process dies), so a process killed
    mid-build never leaves later ones waiting on a stale lock file (PyTorch's own builder would wait forever); an
    existing library loads without the builder (no ninja run per process)."""
    from torch.utils import cpp_extension

    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, torch.__version__.encode(), sys.version.encode(),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    folder = kernels_home() / f"{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    module, library = f"retrospec_{name}_{key}", folder / f"retrospec_{name}_{key}.so"
    scripts = sysconfig.get_path("scripts")  # a pip-installed ninja lives beside this interpreter
    had, path = "PATH" in os.environ, os.environ.get("PATH", "")
    try:
        with _folder_lock(folder):
            if library.exists():
                try:
                    return _load(module, library, python_module)
                except (OSError, ImportError, RuntimeError):
                    pass  # unreadable (a build cut short): built again below
            print(f"[retrospec] compiling the {name} kernel for this machine (once; about half a minute)",
                  file=sys.stderr, flush=True)
            (folder / "lock").unlink(missing_ok=True)  # the builder's lock file, left by a process killed mid-build
            if scripts and scripts not in path.split(os.pathsep):
                os.environ["PATH"] = scripts + os.pathsep + path  # for the build only
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cpp_extension.load(module, [str(source)], extra_cflags=list(flags),
                                          extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                                          build_directory=str(folder), verbose=False, is_python_module=python_module)
    except (RuntimeError, OSError, ImportError, SystemExit) as e:  # no compiler or ninja, a failed build
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        warnings.warn(f"the {name} kernel could not be built here ({why}); {without}", RuntimeWarning, stacklevel=4)
        return None
    finally:
        if had:
            os.environ["PATH"] = path
        else:
            os.environ.pop("PATH", None)


def _load(module: str, library: Path, python_module: bool):
    """A built kernel library: imported as a Python module, or (operators only) loaded into ``torch.ops``."""
    if not python_module:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(module, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive OS lock on ``folder`` for this process (where the OS has ``flock``; else none)."""
    try:
        import fcntl
    except ImportError:  # no flock here: the builder's own lock file only
        yield
        return
    with open(folder / "retrospec.lock", "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
