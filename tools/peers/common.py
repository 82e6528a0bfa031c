"""What the scripts run in the vLLM peer's virtualenv share: a private stdout for their results, the CPU engine's
environment, and the engine they compare (float32, prefix caching off, greedy-ready)."""

from __future__ import annotations

import os
import sys


def private_stdout():
    """A private copy of stdout for the results; fd 1 becomes stderr for vLLM's log and its engine processes. Also
    sets vLLM's CPU threads (every core this process may use) and a 1 GiB KV cache unless already set."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threads = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return out, threads


def engine(model: str, spec: dict | None, stats: bool = False):
    """vLLM's offline engine on ``model`` in float32, prefix caching off, with ``spec`` as its speculative config;
    ``stats``: keep vLLM's metrics (``LLM.get_metrics``: its speculative counters)."""
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=2048, enable_prefix_caching=False,
               gpu_memory_utilization=0.3, seed=0, disable_log_stats=not stats,
               **({"speculative_config": spec} if spec else {}))
