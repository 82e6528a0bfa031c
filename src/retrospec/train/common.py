"""The pieces every trainer in ``train/`` shares: device, threads, optimiser and its step, learning-rate schedule,
the distillation loss, budget and output checks, manifests.

- ``resolve_device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present); anything else, or CUDA asked
  for where there is none, is one ``RetrospecError`` line.
- ``adamw``: AdamW over the trainable parameters, weight decay on matrices only (norms, biases and other vectors
  are not decayed).
- ``warmup_cosine``: linear warm-up, then a cosine from the peak down to ``min_ratio`` x peak.
- ``kl``: forward KL(p || q) per position, what a draft minimises (acceptance is ``sum_x min(p, q) = 1 - TV``).

Datasets are read with the readers of the data they are (``rag.data``, ``stdlib_corpus``, ``retrieval.corpus``);
output directories are written with ``atomic.atomic_build``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

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


def set_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` unless 0 (torch's default)."""
    if n < 0:
        raise RetrospecError(f"--threads must be >= 0, got {n}")
    if n:
        torch.set_num_threads(n)


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with two groups: matrices (``dim >= 2``) decayed by ``weight_decay``, everything else not decayed."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params: Iterable[torch.nn.Parameter],
                   clip: float) -> float:
    """Backward ``loss``, clip the gradient norm of ``params`` to ``clip``, step; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return float(loss.detach())


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


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) [...] from log-probabilities [..., K]."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def check_budget(steps: int | None, seconds: float | None) -> None:
    if (steps is None) == (seconds is None):
        raise RetrospecError("give exactly one of --steps or --seconds")
    if (steps is not None and steps < 1) or (seconds is not None and not seconds > 0):
        raise RetrospecError("--steps / --seconds must be positive")


def check_new(out: str | Path) -> None:
    if Path(out).expanduser().exists():
        raise RetrospecError(f"{out} already exists; choose another --out")


def jsonable(cfg) -> dict:
    """A config dataclass as a JSON-ready dict (paths as strings, tuples as lists)."""
    return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in asdict(cfg).items()}


def write_json(path: Path, obj, indent: int | None = 1) -> None:
    Path(path).write_text(json.dumps(obj, indent=indent) + "\n")
