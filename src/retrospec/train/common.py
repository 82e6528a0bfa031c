"""The pieces every trainer in ``train/`` shares: device, optimiser, learning-rate schedule.

- ``resolve_device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present); anything else, or CUDA asked
  for where there is none, is one ``RetrospecError`` line.
- ``adamw``: AdamW over the trainable parameters, weight decay on matrices only (norms, biases and other vectors
  are not decayed).
- ``warmup_cosine``: linear warm-up, then a cosine from the peak down to ``min_ratio`` x peak.

Datasets are read with the readers of the data they are (``rag.data``, ``stdlib_corpus``, ``retrieval.corpus``);
output directories are written with ``atomic.atomic_build``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..errors import RetrospecError


def resolve_device(name: str) -> torch.device:
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise RetrospecError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RetrospecError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with two groups: matrices (``dim >= 2``) decayed by ``weight_decay``, everything else not decayed."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))


def warmup_cosine(done: float, total: float, peak: float, warmup: float, min_ratio: float = 0.0, *,
                  ramp: int = 1, progress: float | None = None) -> float:
    """The learning rate after ``done`` of ``total`` (steps, or a fraction of a budget with ``total`` = 1).

    Warm-up while ``done < warmup``: ``peak * (done + ramp) / warmup`` (``ramp`` 1 for step counts, so step 0
    already trains; 0 for a continuous fraction). Then ``peak * (min_ratio + (1 - min_ratio) * (1 + cos(pi * x)) / 2)``
    with ``x`` = ``progress`` when given (a time budget's elapsed share), else the share of the steps after warm-up;
    ``x`` is clipped to [0, 1].
    """
    if done < warmup:
        return peak * (done + ramp) / warmup
    x = progress if progress is not None else (done - warmup) / max(1e-12, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, x))))
    return peak * (min_ratio + (1 - min_ratio) * cosine)
