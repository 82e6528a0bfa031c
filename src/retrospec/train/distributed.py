"""Data-parallel training (DDP) for the distillers: ``retrospec train longspec-distill`` / ``draft-distill`` under
``torchrun --nproc_per_node N`` or ``accelerate launch`` (both set ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``). Every
process holds the whole model and the frozen target, computes its own rows of each batch, and every process applies
the same summed gradient.

A trainer calls ``setup(device)`` first (it initialises the process group, gloo on the CPU, nccl on CUDA with one
device per ``LOCAL_RANK``) and hands the ``Dist`` it returns to the steps below. Invariants (what makes N processes
train as one):

- **One process is today's code path**: without ``WORLD_SIZE`` (or with 1) ``Dist.world == 1``; no process group is
  created and every method returns its input (no scaling, no collective).
- **The same global batch everywhere**: each process draws every batch with the same random draws one process would
  (same seed, same sampler, the same calls in the same order), then computes only its contiguous slice of the rows
  (``rows``): process r of N takes rows ``[r*b//N, (r+1)*b//N)`` of a b-row batch, so the slices in rank order are the
  batch. The distillers' batches are token-budgeted (``--batch-tokens``, the global batch: it must be divisible by N,
  ``check_global_batch``), their row counts vary, and a slice may be empty.
- **The one-process loss**: a batch's loss is a mean over its real tokens; a process's share is its rows' mean
  weighted by its real tokens / the batch's (``local_loss``), so the shares sum to the one-process loss, and the
  gradients summed over processes (``sum_grads``: one all-reduce per step, the loss in it) are that loss's gradient. A
  parameter no process gave a gradient keeps ``grad = None`` (AdamW skips it, as in one process).
- **Equal weights**: parameters are broadcast from rank 0 before training (``same_start``); every process then clips
  the same summed gradient and steps the same optimiser, so weights stay equal up to the order of float sums.
- **Decisions made once**: what a process would decide on its own (the measured precision, elapsed time towards a
  ``--seconds`` budget) is rank 0's (``same``) or the largest (``most``), so every process takes the same steps.
- **Rank 0 writes**: logs, progress bars, checkpoints and the final artefact (``main``); the others compute.
- **A sharded target** (``--fsdp``, ``setup(device, fsdp=True)``; ``train.fsdp``): the frozen target's decoder layers
  are split over the processes and gathered in each forward, so every process runs every forward of the target: a
  process with no rows of a batch runs the target alone on the batch's first row, without gradient, and discards it
  (``local_loss``). The trained model stays data-parallel as above.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from ..errors import RetrospecError
from ..models.loading import resolve_device


@dataclass(frozen=True)
class Dist:
    """This process's place among ``world`` data-parallel processes, and the device it trains on."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp: bool = False  # the target is sharded (``train.fsdp``): every process takes part in each of its forwards

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs and writes."""
        return self.rank == 0

    def log(self, log: Callable[..., object]) -> Callable[..., object]:
        """``log`` on rank 0, a no-op elsewhere."""
        return log if self.main else (lambda *_, **__: None)

    def rows(self, n: int) -> slice:
        """This process's contiguous rows of an ``n``-row batch (empty when ``n`` < world for some ranks)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def local_loss(self, loss: Callable[..., torch.Tensor], mask: torch.Tensor, *batch: torch.Tensor,
                   target: Callable[..., object] | None = None) -> torch.Tensor:
        """``loss(*batch)``, a mean over the real tokens (``mask`` [b, L]: 1 on them) of a global batch (tensors
        [b, ...]); several processes: ``loss`` of this process's rows times their share of the batch's real tokens
        (a zero with no gradient, and no forward, when it has none; with ``fsdp``, ``target`` (the target's forward,
        taking what ``loss`` takes) then runs on the batch's first row without gradient, its output discarded: the
        sharded target's collectives need every process)."""
        if self.world == 1:
            return loss(*batch)
        part = self.rows(mask.shape[0])
        mine, total = int(mask[part].sum()), int(mask.sum())
        if mine == 0:
            if self.fsdp and target is not None:
                with torch.no_grad():
                    target(*(t[:1] for t in batch))
            return torch.zeros((), device=mask.device)
        return loss(*(t[part] for t in batch)) * (mine / total)

    def sum_grads(self, params: Iterable[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients of ``params`` and ``loss`` (each process's ``local_loss``) over the processes, in one
        all-reduce; returns the summed loss (the one-process loss of the batch)."""
        if self.world == 1:
            return loss
        params = [p for p in params if p.requires_grad]
        ref = params[0]
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=ref.dtype,
                                                                            device=ref.device) for p in params]
        has = torch.tensor([float(p.grad is not None) for p in params], dtype=ref.dtype, device=ref.device)
        flat = torch.cat([*grads, loss.detach().reshape(1).to(ref.dtype), has])
        tdist.all_reduce(flat)
        sizes = [p.numel() for p in params]
        summed, total, has = flat.split([sum(sizes), 1, len(params)])
        for p, g, got in zip(params, summed.split(sizes), has.tolist()):
            p.grad = g.view_as(p) if got else None
        return total[0]

    def same(self, obj):
        """Rank 0's ``obj`` on every process (a picklable value)."""
        if self.world == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def most(self, x: float) -> float:
        """The largest ``x`` over the processes."""
        if self.world == 1:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t[0])

    def same_start(self, model: torch.nn.Module) -> None:
        """Every process starts from rank 0's parameters."""
        if self.world == 1:
            return
        with torch.no_grad():
            for p in model.parameters():
                tdist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        """Wait for every process (after rank 0 wrote the artefact)."""
        if self.world > 1:
            tdist.barrier()

    def manifest(self) -> dict:
        """What a manifest records of the run's processes (nothing for one process)."""
        return ({"processes": self.world} | ({"fsdp": "target"} if self.fsdp else {})) if self.world > 1 else {}


def env() -> Dist:
    """The launcher's ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` (torchrun and ``accelerate launch`` set them;
    absent: one process); a process group already initialised in this process wins over them."""
    if tdist.is_available() and tdist.is_initialized():
        return Dist(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", tdist.get_rank())))
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise RetrospecError("WORLD_SIZE / RANK / LOCAL_RANK must be integers (set by torchrun or accelerate "
                             "launch)") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise RetrospecError(f"need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE, got WORLD_SIZE={world} RANK={rank}")
    return Dist(rank, world, local)


def check_global_batch(size: int, flag: str) -> None:
    """A global batch ``size`` (``flag``) that the processes of this launch cannot share equally is one
    ``RetrospecError`` line (before anything loads)."""
    world = env().world
    if size % world:
        raise RetrospecError(f"{flag} {size} is the global batch of the {world} processes: it must be divisible by "
                             f"{world}")


def setup(device: str | torch.device = "cpu", fsdp: bool = False) -> Dist:
    """This process's ``Dist``, training on ``device`` (``models.loading.resolve_device``: cpu, cuda, cuda:N or
    auto). Several processes: CUDA is ``cuda:LOCAL_RANK`` (made the current device), and the default process group
    is initialised once per process from the launcher's environment (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``),
    nccl on CUDA, gloo on the CPU; it is destroyed at exit; ``fsdp``: the target will be sharded (``train.fsdp``).
    One process: no process group, and ``fsdp`` changes nothing."""
    d = env()
    if d.world > 1 and str(device) != "cpu" and (str(device) != "auto" or torch.cuda.is_available()):
        device = f"cuda:{d.local_rank}"
    device = resolve_device(device)
    if d.world == 1:
        return Dist(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=d.rank, world_size=d.world)
        atexit.register(_destroy)
    return Dist(d.rank, d.world, d.local_rank, device, fsdp)


def _destroy() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
