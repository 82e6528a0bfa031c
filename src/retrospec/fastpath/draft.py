"""Drafts in the fastest matmul path the running machine offers: measured once per shape set, cached on disk.

Why: a drafted token must cost a few percent of a target step; on CPU that is reading the draft's weights (2-core
AMD EPYC, AVX-512 bf16: 16,384 head rows x 576 at one row take 3.2 ms with ``F.linear``, 2.0 ms oneDNN-prepacked,
0.55 ms prepacked in bfloat16; CPUs without bf16 instructions may lose), hence the measurement. It stays exact: the
rules read the target's p (weights' dtype) and the draft's q as the draft produced it, so precision changes what is
proposed, never the output. Never applied to a target (``engine_for`` without ``draft=True``).

What:
- ``draft_choice(weights)`` times the [out, in] weights at ``ROWS`` rows in each of ``CHOICES``: ``plain``
  (``F.linear``), ``packed`` (oneDNN prepacked), ``packed-bf16`` (a bfloat16 prepacked copy; activations cast
  in and out) and ``kernel`` (``kernels.f32`` on float32 weights, where it is built), and in each of ``QUANTIZED``
  where its kernel runs and the shapes fit and the caller allows them, and returns the fastest; cached as JSON under
  ``cache_home()/fastpath/`` keyed like ``plan``. A head (a block's rows, a draft model's head) is measured apart
  from the linears (its shape favours other paths). Heads may run quantized, and so may a LongSpec block's linears;
  a draft model's linears may not: quantization error compounds through its layers (the bundled 2-layer
  ``smollm2-135m-draft`` with ``w4a8`` linears agreed with its float32 self on 30 % of next tokens, ``w8a8`` 91 %,
  and ``sd``'s greedy tau fell 1.32 -> 1.21 on chat and 1.75 -> 1.25 on code), while the one-layer block's tau moved
  by -0.3 % and 0.0 %.
- ``fast_copy(module, choice, shared)``: a private copy with every ``nn.Linear`` swapped for a ``PackedLinear``, a
  ``KernelLinear`` or a quantized ``WeightOnlyLinear`` (weights and the ``shared`` modules are the originals; a
  quantized linear holds its own integer copy), cached weakly per module while its weights stay the same.
- ``row_product(weight, choice)``: ``x -> x @ weight.T`` computed the same way (a block's head rows).

The quantized formats (``weight_only``): ``w8a8`` (int8 rows with a scale each, activations quantized per row) and
``w4a8`` (4-bit rows in groups of 32, activations quantized per group; AVX-512 VNNI), a quarter and an eighth of
float32's bytes. On a 2-core AMD EPYC VM with a 32 MiB L3: a 16,384 x 576 head at 1 / 4 / 16 rows took 0.15 / 0.19 /
0.54 ms in ``w4a8``, 0.23 / 0.17 / 0.51 ms in ``w8a8``, 0.33 / 0.29 / 0.93 ms prepacked in bfloat16; a LongSpec
block's nine linears at one row 0.16 ms in ``w4a8`` against 0.31 ms in float32 (``kernel``), and right after a
target step, whose forward leaves none of the draft's weights in the caches, 0.42 ms against 0.85 ms. A draft's
precision changes what it proposes, never the output; on the bundled drafts, ungated greedy tau moved by a few
percent at most (``docs/results.md``).

Overrides: ``RETROSPEC_FASTPATH`` ``off`` / ``plain`` -> ``plain``, ``packed`` -> ``packed``, ``kernel`` -> ``kernel``;
``RETROSPEC_DRAFT_DTYPE``: ``float32`` (no bfloat16, nothing quantized), ``bfloat16`` (``packed-bf16`` unmeasured),
``auto`` (default).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
import time
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from .. import weight_only
from ..errors import RetrospecError
from ..paths import cache_home
from .linear import KernelLinear, PackedLinear, kernel_available, kernel_matmul, onednn_available, pack_weight, \
    packed_matmul, packed_or_plain
from .plan import cached_json, machine_id, median_ms, mode

CHOICES = ("plain", "packed", "packed-bf16", "kernel")
QUANTIZED = ("w8a8", "w4a8")  # the integer formats a draft's weights may also run in (``weight_only``), measured too
ROWS = (1, 4, 16)  # a chain step, a tree level of 4, a level of 16
MAX_ROWS = 64  # inputs with more rows (a prompt) take the plain path on the shared weights
DTYPES = ("auto", "float32", "bfloat16")
VERSION = 2
_CHOICES: dict[tuple, str] = {}  # choices this process read or measured: a drafter per request reads no file
_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def _dtype_setting() -> str:
    d = os.environ.get("RETROSPEC_DRAFT_DTYPE", "auto").strip().lower() or "auto"
    if d not in DTYPES:
        raise RetrospecError(f"RETROSPEC_DRAFT_DTYPE must be one of {', '.join(DTYPES)}, got {d!r}")
    return d


def _key(weights: list[torch.Tensor], allowed: tuple[str, ...]) -> str:
    shapes = sorted(tuple(w.shape) for w in weights)
    parts = [machine_id(), torch.__version__, str(torch.get_num_threads()), str(weights[0].dtype), str(shapes),
             ",".join(allowed)]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def measure_choice(weights: list[torch.Tensor], allowed: tuple[str, ...] = CHOICES) -> dict:
    """{"choice": fastest of ``allowed``, "ms": {choice: {rows: ms}}, "seconds": ...} for these weights."""
    t0 = time.perf_counter()
    ms: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for choice in allowed:
            if choice == "plain":
                fns = [lambda x, w=w: F.linear(x, w) for w in weights]
            elif choice == "kernel":
                if not kernel_available(weights[0]):
                    continue
                fns = [lambda x, w=w: kernel_matmul(x, w) for w in weights]
            elif choice in QUANTIZED:
                fns = [_quantized(w, choice) for w in weights]
            else:
                packed = [pack_weight(w, torch.bfloat16 if choice == "packed-bf16" else None) for w in weights]
                if any(p is None for p in packed):
                    continue
                fns = [lambda x, p=p: packed_matmul(x, p) for p in packed]
            ms[choice] = {}
            for r in ROWS:
                xs = [torch.randn(r, w.shape[1], dtype=w.dtype) for w in weights]
                ms[choice][r] = median_ms(lambda: [f(x) for f, x in zip(fns, xs)])
    best = min(ms, key=lambda c: sum(ms[c].values()))
    return {"version": VERSION, "choice": best, "ms": ms, "seconds": round(time.perf_counter() - t0, 3)}


def draft_choice(weights: Iterable[torch.Tensor], remeasure: bool = False, quantized: bool = False) -> str:
    """The matmul path for a draft with these [out, in] weights on this machine (module docstring), one of
    ``CHOICES`` or, with ``quantized`` (the caller knows its draft proposes as well so), where it runs and fits them,
    one of ``QUANTIZED``."""
    weights = [w.detach() for w in weights]
    m = mode()
    if m in ("off", "plain") or not weights or weights[0].device.type != "cpu" or not onednn_available():
        return "plain"
    setting, fp32 = _dtype_setting(), weights[0].dtype == torch.float32
    if setting == "bfloat16":
        return "packed-bf16" if fp32 else "packed"
    if m == "packed":
        return "packed"
    if m == "kernel" and fp32 and kernel_available(weights[0]):
        return "kernel"
    allowed = ("plain", "packed")  # bfloat16 copies only where not ruled out; the kernel multiplies float32
    if fp32:
        allowed += ("packed-bf16", "kernel") if setting == "auto" else ("kernel",)
        if quantized and setting == "auto":
            allowed += tuple(f for f in QUANTIZED if _quantizable(weights, f))
    home = cache_home()
    seen = (str(home), torch.get_num_threads(), weights[0].dtype, tuple(sorted(tuple(w.shape) for w in weights)),
            allowed)
    if not remeasure and seen in _CHOICES:
        return _CHOICES[seen]

    def measure():
        data = measure_choice(weights, allowed)
        return data, data

    data = cached_json(home / "fastpath" / f"draft-{_key(weights, allowed)}.json", measure, remeasure,
                       read=lambda d: d if d.get("version") == VERSION and d.get("choice") in allowed else None)
    _CHOICES[seen] = data["choice"]
    return data["choice"]


def _pack_dtype(choice: str) -> torch.dtype | None:
    return torch.bfloat16 if choice == "packed-bf16" else None


def pack_linears(module: torch.nn.Module, choice: str, max_rows: int = MAX_ROWS) -> None:
    """Swap ``module``'s own ``nn.Linear`` children (recursively) for ``PackedLinear`` per ``choice``, for
    ``KernelLinear`` (``kernel``; float32 weights) or for a ``weight_only.WeightOnlyLinear`` holding its own quantized
    copy (``QUANTIZED``; every row count, a prompt's too: the integer kernels beat float32 ones at any size here) (in
    place: call it on a private copy only)."""
    if choice == "plain":
        return
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            if choice in QUANTIZED:
                setattr(parent, name, _quantized(child.weight, choice, child.bias))
                continue
            if choice == "kernel":
                if kernel_available(child.weight):
                    setattr(parent, name, KernelLinear(child))
                continue
            packed = pack_weight(child.weight, _pack_dtype(choice))
            if packed is not None:
                setattr(parent, name, PackedLinear(child, packed, max_rows))


def _quantizable(weights: list[torch.Tensor], fmt: str) -> bool:
    """Whether ``fmt`` (a ``QUANTIZED`` entry) runs here and fits these [out, in] weights."""
    if not weight_only.available(fmt):
        return False
    return fmt != "w4a8" or all(w.shape[1] % weight_only.GROUP == 0 and w.shape[0] % 16 == 0 for w in weights)


def _quantized(weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> weight_only.WeightOnlyLinear:
    """``weight`` [out, in] (and ``bias`` [out], shared) as a linear in ``fmt`` (``w8a8`` or ``w4a8``; its own
    quantized copy of the weight), called once: ``w8a8`` packs for fbgemm on its first call (~50 ms for a large head),
    which must not fall in a drafting step."""
    w = weight.detach().float()
    q, scales = weight_only.quantize_int8(w) if fmt == "w8a8" else weight_only.pack_w4a8(*weight_only.int4_groups(w))
    lin = weight_only.WeightOnlyLinear(fmt, w.shape[1], w.shape[0], q, scales, None if bias is None else bias.detach())
    with torch.inference_mode():
        lin(w.new_zeros(1, w.shape[1]))
    return lin


def row_product(weight: torch.Tensor, choice: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [..., in] -> x @ weight.T [..., out]`` in the path ``choice`` (inputs over ``MAX_ROWS`` rows: plain)."""
    if choice == "kernel" and kernel_available(weight):
        return lambda x: kernel_matmul(x, weight)
    if choice in QUANTIZED:
        lin = _quantized(weight, choice)
        return lambda x: lin(x) if x.numel() <= MAX_ROWS * x.shape[-1] else F.linear(x, weight)
    packed = None if choice in ("plain", "kernel") else pack_weight(weight, _pack_dtype(choice))
    if packed is None:
        return lambda x: F.linear(x, weight)
    return lambda x: packed_or_plain(x, weight, None, packed, None, MAX_ROWS)


def fast_copy(module: torch.nn.Module, choice: str, shared: Iterable[torch.nn.Module] = (),
              private: bool = False) -> torch.nn.Module:
    """``module``'s private copy with its linears packed per ``choice`` (for ``plain``, the module itself unless
    ``private``). The copy's modules are new objects; every parameter and buffer, and the ``shared`` modules, are the
    originals (a quantized linear holds its own integer copy of a weight). Cached (weakly) per module and rebuilt
    when its weights change."""
    if choice == "plain" and not private:
        return module
    fp = (choice, tuple((id(t), t.data_ptr(), t._version) for t in itertools.chain(module.parameters(),
                                                                                 module.buffers())))
    hit = _COPIES.get(module)
    if hit is not None and hit[0] == fp:
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():
        memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
        memo.update({id(m): m for m in shared})
        clone = copy.deepcopy(module, memo)
        pack_linears(clone, choice)
    _COPIES[module] = (fp, clone)
    return clone
