"""Row invariance of a model copy's matmuls: whether a row's result depends on how many rows share the call.

Why: a speculative method verifies k tokens in one forward, ``ar`` runs k one-token forwards; the method is
token-identical to ``ar`` only if both give the same logits. Kernels that pick their blocking or reduction order by
the number of rows (float32 BLAS: gemv for one row, a blocked gemm for several) differ by ~1e-7, which a later
rounding to a 16-bit activation can turn into a flipped near-tie. Whether a kernel is row-invariant is a property of
the machine's kernels, so it is measured, never assumed: ``rows_invariant`` calls each distinct layer with
``ROWS`` rows and compares every row bitwise with a one-row call of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..weight_only import WeightOnlyLinear
from .linear import KernelLinear, PackedLinear

ROWS = (2, 5, 17)  # row counts of a verification (a chain, a small tree) checked against one-row calls


def linear_modules(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """One module per distinct (type, in, out) among ``decoder``'s linear layers, as the copy calls them."""
    seen, out = set(), []
    for m in decoder.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear, KernelLinear, WeightOnlyLinear)):
            key = (type(m), m.in_features, m.out_features)
            if key not in seen:
                seen.add(key)
                out.append(m)
    return out


@torch.no_grad()
def rows_invariant(calls: Iterable[torch.nn.Module | Callable], in_features: int | None = None,
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> bool:
    """Whether every call in ``calls`` (modules with ``in_features``, or callables taking [M, ``in_features``]),
    fed ``dtype`` activations, gives for every M in ``ROWS`` bitwise the rows of M one-row calls."""
    gen = torch.Generator().manual_seed(seed)
    for call in calls:
        width = getattr(call, "in_features", in_features)
        for m in ROWS:
            x = torch.randn(m, width, generator=gen).to(dtype)  # [M, in]
            together = call(x)
            alone = torch.cat([call(x[i:i + 1]) for i in range(m)])
            if not torch.equal(together, alone):
                return False
    return True
