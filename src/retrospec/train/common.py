"""The pieces every trainer in ``train/`` shares: device, threads, optimiser and its step, learning-rate schedule,
the distillation loss, budget and output checks, manifests.

- ``resolve_device`` (``models.loading``'s): ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present); anything
  else, or CUDA asked for where there is none, is one ``RetrospecError`` line.
- ``adamw``: AdamW over the trainable parameters, weight decay on matrices only (norms, biases and other vectors
  are not decayed).
- ``warmup_cosine``: linear warm-up, then a cosine from the peak down to ``min_ratio`` x peak.
- ``warmup_stable_decay`` (WSD): linear warm-up, the peak held, then a 1-sqrt decay to 0 over the last ``decay``
  share (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"): the
  weights before the decay can be trained further without restarting a schedule, the decayed copy is the one used.
- ``kl``: forward KL(p || q) per position, what a draft minimises (acceptance is ``sum_x min(p, q) = 1 - TV``).
- ``pick_precision`` / ``autocast``: the distillers' forward passes (the frozen teacher's above all) in float32 or
  under bfloat16 autocast; ``auto`` times one batch's forward both ways on the running machine and keeps the faster
  (bfloat16 only where it is at least ``BF16_MARGIN`` faster: CPUs without bf16 units run it slower). Parameters,
  gradients, optimiser state and every evaluation stay float32.

Datasets are read with the readers of the data they are (``rag.data``, ``stdlib_corpus``, ``retrieval.corpus``);
output directories are written with ``atomic.atomic_build``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from ..atomic import write_text_atomic
from ..errors import RetrospecError
from ..models.loading import resolve_device  # noqa: F401  (the trainers' --device, as every loader reads it)


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
                   clip: float, dist=None) -> float:
    """Backward ``loss``, clip the gradient norm of ``params`` to ``clip``, step; returns the loss. ``dist``
    (``distributed.Dist``, several processes): the gradients and ``loss`` (this process's share) summed over the
    processes before clipping; returns the summed loss."""
    params = list(params)
    opt.zero_grad(set_to_none=True)
    if dist is None or loss.requires_grad:  # a process with no rows of a batch has nothing to differentiate
        loss.backward()
    if dist is not None:
        loss = dist.sum_grads(params, loss)
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


def warmup_stable_decay(progress: float, peak: float, warmup: float, decay: float) -> float:
    """The WSD learning rate at ``progress`` (share of the budget done, clipped to [0, 1]): ``peak * progress /
    warmup`` while warming up, ``peak`` until ``1 - decay``, then ``peak * (1 - sqrt(x))`` with ``x`` the share of
    the decay done."""
    progress = min(1.0, max(0.0, progress))
    if progress < warmup:
        return peak * progress / warmup
    if progress < 1 - decay:
        return peak
    return peak * (1 - math.sqrt(min(1.0, (progress - (1 - decay)) / max(1e-12, decay))))


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) [...] from log-probabilities [..., K]."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


PRECISIONS = ("auto", "float32", "bfloat16")
BF16_MARGIN = 0.9  # auto keeps bfloat16 only when its forward takes at most this share of float32's


def autocast(precision: str, device: torch.device):
    """The context a training forward runs in: bfloat16 autocast on ``device``'s type, or nothing (float32)."""
    if precision == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise RetrospecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def pick_precision(precision: str, device: torch.device, forward: Callable[[], object], log=print) -> str:
    """``float32`` / ``bfloat16`` as asked; ``auto``: time ``forward()`` (one batch's loss, no gradient) twice per
    precision, alternating, and keep the faster (module docstring)."""
    check_precision(precision)
    if precision != "auto":
        return precision
    best = {"float32": math.inf, "bfloat16": math.inf}
    with torch.no_grad():
        for _ in range(2):
            for name in best:
                with autocast(name, device):
                    start = time.perf_counter()
                    forward()
                    if torch.device(device).type == "cuda":
                        torch.cuda.synchronize(device)
                    best[name] = min(best[name], time.perf_counter() - start)
    chosen = "bfloat16" if best["bfloat16"] <= BF16_MARGIN * best["float32"] else "float32"
    log(f"precision auto: one batch's forward {best['float32']:.2f} s in float32, {best['bfloat16']:.2f} s under "
        f"bfloat16 autocast -> {chosen}")
    return chosen


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
    """``obj`` as JSON at ``path``, atomically (a reader sees the old file or the new one)."""
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")
