"""Shared pieces of the GPU steps: device choice, a time budget, synchronized timing, JSON output, random models.

Contracts: a real step runs on CUDA or stops with a one-line ``RetrospecError`` (exit 2): it never silently
measures a CPU. ``time_ms`` synchronizes the device around each clock read (CUDA work is asynchronous); its figures
are reported, never asserted. A part that raised is recorded under ``errors`` of ``<step>.json`` (``{part: "Type:
message"}``, exit code 1) and the other parts' figures are kept. The staging folder ``stage_root()``
(``$RETROSPEC_GPU_STAGE``, default ``/tmp/rs``) holds what must outlive one call on a warm machine: the GGUF parts
(``g/``), the wheels' site (``site/``) and ``RETROSPEC_HOME`` (``home/``, the converted model).
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

from retrospec.errors import RetrospecError


def stage_root() -> Path:
    return Path(os.environ.get("RETROSPEC_GPU_STAGE", "/tmp/rs"))


def pick_device(dry_run: bool) -> torch.device:
    """CPU for a dry run or when ``$RETROSPEC_GPU_DEVICE`` is ``cpu`` (``step --cpu``); else CUDA, which must be
    there."""
    if dry_run or os.environ.get("RETROSPEC_GPU_DEVICE") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RetrospecError("no CUDA device here: run the step with --dry-run (CPU, tiny models) or on a GPU "
                             "machine (python -m tools.gpu plan)")
    return torch.device("cuda")


def time_ms(fn, device: torch.device, reps: int = 7, warmup: int = 2, budget_s: float = 5.0) -> float:
    """Median ms of ``fn()`` over up to ``reps`` timed calls (at least 2; fewer than ``reps`` past ``budget_s``)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@dataclass
class StepResult:
    """``<step>.json``: every field not starting with ``_``; ``left()``: seconds left of the step's budget."""

    step: str
    dry_run: bool
    device: str
    env: dict
    figures: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    part_seconds: dict = field(default_factory=dict)
    _budget_s: float = 0.0
    _t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self._budget_s - (time.monotonic() - self._t0)

    def part(self, name: str, fn, *args, **kwargs):
        """Run one part; a raise is recorded (not re-raised) so the other parts still report."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a part that fails on CUDA must not lose the other parts' figures
            first = (str(exc).strip().splitlines() or [""])[0]
            self.errors[name] = f"{type(exc).__name__}: {first}"[:500]
            self.notes.append(f"{name}: " + "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300])
            return None
        finally:
            self.part_seconds[name] = round(time.perf_counter() - t0, 2)


def start(step: str, dry_run: bool, budget_s: float) -> tuple[StepResult, torch.device]:
    import transformers

    device = pick_device(dry_run)
    if dry_run:  # tiny models gain nothing from threads, and on a busy CPU OpenMP threads spin-wait for each other
        torch.set_num_threads(1)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "host": platform.node()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"gpu": p.name, "gpu_mib": p.total_memory // 2**20, "sms": p.multi_processor_count,
                "cuda": torch.version.cuda}
    else:
        env |= {"cpu_threads": torch.get_num_threads()}
    return StepResult(step, dry_run, str(device), env, _budget_s=budget_s), device


def finish(result: StepResult, out: Path) -> int:
    """Write ``<step>.json`` into ``out``; exit code 0, or 1 when a part failed."""
    result.seconds = round(time.monotonic() - result._t0, 2)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.step}.json"
    data = {k: v for k, v in vars(result).items() if not k.startswith("_")}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"{result.step}: {'dry run, ' if result.dry_run else ''}{result.device}, {result.seconds:.1f} s, "
          f"{len(result.errors)} failed part(s){': ' + ', '.join(result.errors) if result.errors else ''}; "
          f"wrote {path}")
    return 1 if result.errors else 0


def watchdog(result: StepResult, out: Path, after_s: float):
    """Write ``<step>.json`` as it stands after ``after_s`` seconds (a daemon timer; cancel it when done): a call
    killed at its limit still returns what was measured by then, with a note saying the step had not finished."""
    import threading

    def fire():
        result.notes.append(f"watchdog: the step was still running after {after_s:.0f} s; this JSON holds what was "
                            "measured by then")
        finish(result, out)

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def random_causal_lm(arch: str, config: dict, device="cpu", seed: int = 0):
    """A Llama or Qwen2 (``arch``) of that config with random weights drawn on ``device`` (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(**config)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):  # built on the device: transformers' own init (N(0, 0.02)), rotary buffers right
        torch.manual_seed(seed)
        return model_cls(cfg).eval()


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=1024)


def tiny_causal_lm(arch: str = "llama", seed: int = 0):
    """A random tiny Llama or Qwen2 on the CPU."""
    return random_causal_lm(arch, TINY | dict(eos_token_id=127, bos_token_id=127, pad_token_id=126), seed=seed)
