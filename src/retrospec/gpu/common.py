"""Shared pieces of the GPU steps: device choice, a time budget, synchronized timing, JSON output, tiny models.

Contracts:

- ``pick_device(dry_run)``: CPU for a dry run (or ``step --cpu``); CUDA otherwise, and a ``RetrospecError`` (one
  line, exit 2) when no
  CUDA device is present: a real step never silently measures a CPU.
- ``time_ms(fn, device)``: median milliseconds of ``fn()`` with a device synchronize before each clock read (CUDA
  work is asynchronous), after warm-up calls; never asserted anywhere, only reported.
- ``StepResult`` is written as ``<step>.json`` by ``finish``; a part that raised is recorded under ``errors``
  (``{part: "Type: message"}``) and makes the exit code 1, the other parts' figures are kept.
- The device-side staging folder ``stage_root()`` (``$RETROSPEC_GPU_STAGE``, default ``/tmp/rs``) holds what must
  outlive one call on a warm machine: the GGUF parts (``g/``), the wheels' site (``site/``) and ``RETROSPEC_HOME``
  (``home/``, the converted model).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import RetrospecError


def stage_root() -> Path:
    return Path(os.environ.get("RETROSPEC_GPU_STAGE", "/tmp/rs"))


def pick_device(dry_run: bool) -> torch.device:
    """CPU for a dry run, or when ``$RETROSPEC_GPU_DEVICE`` is ``cpu`` (``step --cpu``: a real step, real model, on
    this machine's CPU: a slow local rehearsal); else CUDA, which must be there."""
    if dry_run or os.environ.get("RETROSPEC_GPU_DEVICE") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RetrospecError("no CUDA device here: run the step with --dry-run (CPU, tiny models) or on a GPU "
                             "machine (retrospec gpu plan)")
    return torch.device("cuda")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int = 7, warmup: int = 2, budget_s: float = 5.0) -> float:
    """Median ms of ``fn()`` over up to ``reps`` timed calls (at least 2; fewer than ``reps`` past ``budget_s``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


class Budget:
    """Wall-clock budget of a step: ``left()`` seconds remain; parts check it before starting."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def used(self) -> float:
        return time.monotonic() - self.start


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "host": platform.node()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"gpu": p.name, "gpu_mib": p.total_memory // 2**20, "sms": p.multi_processor_count,
                "cuda": torch.version.cuda}
    else:
        env |= {"cpu_threads": torch.get_num_threads()}
    return env


@dataclass
class StepResult:
    step: str
    dry_run: bool
    device: str
    env: dict
    figures: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    part_seconds: dict = field(default_factory=dict)

    def part(self, name: str, fn, *args, **kwargs):
        """Run one part; a raise is recorded (not re-raised) so the other parts still report."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a part that fails on CUDA must not lose the other parts' figures
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.errors[name] = f"{type(exc).__name__}: {first}"[:500]
            self.notes.append(f"{name}: " + "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300])
            return None
        finally:
            self.part_seconds[name] = round(time.perf_counter() - t0, 2)


def start(step: str, dry_run: bool) -> tuple[StepResult, torch.device, Budget]:
    device = pick_device(dry_run)
    if dry_run:  # tiny models gain nothing from threads, and on a busy CPU OpenMP threads spin-wait for each other
        torch.set_num_threads(1)
    return StepResult(step, dry_run, str(device), environment(device)), device, Budget(0)


def finish(result: StepResult, out: Path, budget: Budget) -> int:
    """Write ``<step>.json`` into ``out``; exit code 0, or 1 when a part failed."""
    result.seconds = round(budget.used(), 2)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.step}.json"
    path.write_text(json.dumps(result.__dict__, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"{result.step}: {'dry run, ' if result.dry_run else ''}{result.device}, {result.seconds:.1f} s, "
          f"{len(result.errors)} failed part(s){': ' + ', '.join(result.errors) if result.errors else ''}; "
          f"wrote {path}")
    return 1 if result.errors else 0


def tiny_causal_lm(arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 128,
                   max_pos: int = 1024, heads: int = 4, kv_heads: int = 2):
    """A random tiny Llama or Qwen2 (config only, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  eos_token_id=vocab - 1, bos_token_id=vocab - 1, pad_token_id=vocab - 2)
    return model_cls(cfg).eval()
