"""Where a CPU model's weights live: one anonymous arena advised for transparent huge pages.

Why: a decode step reads every weight once, so its cost is memory bandwidth, and how the pages behind the weights
are mapped shows in it. transformers leaves a safetensors checkpoint's tensors in a private mapping of the file
(page-cache pages, 4 KiB each); measured on a 2-core AMD EPYC VM (SmolLM2-135M's 211 float32 matmuls at one row, the
same kernel on the same values, medians of 61 interleaved repetitions): 19.5 ms reading the file mapping, 18.5 ms
from anonymous copies, 18.2 ms from anonymous memory in 2 MiB pages (fewer TLB misses while streaming 538 MB).
``place_weights`` copies a model's parameters and buffers into one anonymous mapping advised ``MADV_HUGEPAGE`` (the
kernel backs it with huge pages where transparent huge pages are ``always`` or ``madvise``; elsewhere it is ordinary
anonymous memory).

Invariants: values, dtypes, shapes, ``requires_grad`` and tying are unchanged (a tied weight is one Parameter, moved
once); every tensor gets a storage of its own (a view of the arena through ``torch.frombuffer`` with its own data
pointer: savers that refuse shared storages still save the model); the arena lives as long as any of its tensors.
Only models retrospec loads itself are placed (``models.loading.load_model``), never a caller's module.
``RETROSPEC_HUGE_PAGES=0`` leaves weights where the loader put them.
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 (4 KiB base pages) transparent huge pages
ALIGN = 64  # bytes between tensors: a cache line (vector loads of a row never split one needlessly)


def enabled() -> bool:
    """Whether weights go to huge pages here: Linux's ``madvise(MADV_HUGEPAGE)`` exists and the switch is on."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RETROSPEC_HUGE_PAGES", "1").strip() != "0"


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers on the CPU, each once (tied weights are one object), that can move."""
    seen, out = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t.device.type != "cpu" or t.numel() == 0 or t.is_sparse or not t.is_contiguous():
            continue
        seen.add(id(t))
        out.append(t)
    return out


@torch.no_grad()
def place_weights(model: torch.nn.Module) -> int:
    """Copy ``model``'s CPU parameters and buffers into one anonymous huge-page arena (see the module docstring);
    returns the bytes placed (0 where disabled or nothing moves)."""
    if not enabled():
        return 0
    tensors = _tensors(model)
    sizes = [t.numel() * t.element_size() for t in tensors]
    slots = [-(-n // ALIGN) * ALIGN for n in sizes]  # each tensor's bytes rounded up to the alignment
    total = sum(slots)
    if total == 0:
        return 0
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(arena) % HUGE_PAGE  # the first huge-page boundary inside the mapping
    try:
        arena.madvise(mmap.MADV_HUGEPAGE, start, total)
    except OSError:
        pass  # no transparent huge pages here: ordinary anonymous memory
    offset = start
    for t, n, slot in zip(tensors, sizes, slots):
        view = torch.frombuffer(arena, dtype=torch.uint8, count=n, offset=offset).view(t.dtype).view(t.shape)
        view.copy_(t)
        t.data = view  # the same Parameter / buffer object, its storage now in the arena
        offset += slot
    return total


def _address(buffer: mmap.mmap) -> int:
    """The mapping's first byte's address."""
    return torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
