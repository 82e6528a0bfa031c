"""vLLM as the engine of ``retrospec corpus generate --engine vllm``: the same corpus, written by vLLM's offline
``LLM.generate`` in large batches.

vLLM runs in its own interpreter (``vllm_peer.peer_python``: ``$RETROSPEC_VLLM_PYTHON`` or ``.venv-peers-vllm``),
driven through the bench's peer channel (``peers.PeerWorker`` on ``vllm_worker.py``, op ``generate_batch``). It lives
here, beside the other peers, because ``corpus`` sits below ``bench`` in the rank table: the CLI opens the engine and
hands it to ``corpus.CorpusBuilder`` (``corpus.build.CorpusEngine``).

Contract: ``generate`` sends the jobs in slices of ``batch_size`` (the CLI's default with this engine: the whole
shard), one ``LLM.generate`` call each, and returns the token ids in the jobs' order. Each job is sampled with its
own seed (``corpus.build.record_seed``, in vLLM's ``SamplingParams.seed``), so a record does not depend on which
batch it ran in: a shard generated again on resume is the same. vLLM's CPU build cannot seed requests one by one;
there the worker leaves them unseeded (vLLM's own seed starts one stream for the run, so a resumed run's sampled
records differ from an uninterrupted one's) and the manifest says so (``SEEDING_ENGINE``). The samples are not the
``retrospec`` engine's (another sampler and random stream); greedy rows are the same model's argmax, equal up to
kernel differences.
Engine settings as the bench's worker: prefix caching off, ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB and OpenMP threads
bound to the first cores unless the environment sets them; ``tensor_parallel_size`` as given.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..corpus.build import Job
from ..errors import RetrospecError
from .peers import PeerWorker
from .vllm_peer import PYTHON_ENV, WORKER, peer_python

DTYPES = ("float32", "bfloat16", "float16")  # what vLLM loads a checkpoint in
GPU_MEMORY = 0.9  # the share of a GPU's memory vLLM may take (weights and KV cache); vLLM's own default
SEEDING = ("per record: vLLM's SamplingParams.seed = record_seed(seed, item, phase); a record's sample does not "
           "depend on its batch, and differs from the retrospec engine's")
SEEDING_ENGINE = ("engine-wide: vLLM's CPU build cannot seed one request, so vLLM's own seed (--seed) starts one "
                  "random stream for the whole run; a sampled record depends on every call before it (a resumed run "
                  "differs from an uninterrupted one), and differs from the retrospec engine's")


def vllm_python() -> str:
    """The peer's interpreter, or one ``RetrospecError`` line saying how to get one."""
    python = peer_python()
    if python is None:
        raise RetrospecError(f"--engine vllm: vLLM is not installed (make peers-vllm, or set ${PYTHON_ENV} to a "
                             "Python that has vllm)")
    return python


class VllmCorpusEngine:
    """One ``vllm_worker`` process holding one ``vllm.LLM`` on the target's checkpoint directory."""

    name = "vllm"

    def __init__(self, target_path, dtype: str, n_ctx: int, seed: int = 0, tensor_parallel: int = 1,
                 threads: int | None = None):
        if dtype not in DTYPES:
            raise RetrospecError(f"--engine vllm runs the target in {', '.join(DTYPES)}, not {dtype}")
        if tensor_parallel < 1:
            raise RetrospecError(f"--tensor-parallel must be >= 1, got {tensor_parallel}")
        if not Path(target_path, "config.json").is_file():
            raise RetrospecError(f"--engine vllm needs the target's checkpoint directory; {target_path} has no "
                                 "config.json")
        self.python, self.tensor_parallel, self._worker = vllm_python(), tensor_parallel, None
        self.load = {"model": str(Path(target_path).resolve()), "dtype": dtype, "n_ctx": int(n_ctx),
                     "threads": threads or torch.get_num_threads(), "seed": seed,
                     "gpu_memory_utilization": GPU_MEMORY, "tensor_parallel_size": tensor_parallel,
                     "speculative_config": None, "env": {}}

    def start(self) -> None:
        """Start the worker (vLLM takes minutes to load): on first use, so not before the corpus is checked and
        never for a corpus already complete."""
        if self._worker is None:
            self._worker = PeerWorker(self.python, WORKER, "corpus", self.load, "vLLM")

    @property
    def worker(self) -> PeerWorker:
        self.start()
        return self._worker

    def record(self) -> dict:
        return {"name": self.name, "version": self.worker.info.get("version"), "tensor_parallel": self.tensor_parallel,
                "seeding": SEEDING if self.worker.info.get("seeding", "record") == "record" else SEEDING_ENGINE}

    def generate(self, jobs: list[Job], batch_size: int, eos: frozenset[int],
                 generator: torch.Generator | None = None) -> list[list[int]]:
        out: list[list[int]] = []
        for k in range(0, len(jobs), batch_size):
            requests = [{"prompt_ids": list(j.prompt_ids), "max_new_tokens": j.max_new_tokens,
                         "temperature": j.sampling.temperature, "top_p": j.sampling.top_p, "seed": j.seed}
                        for j in jobs[k:k + batch_size]]
            got = self.worker.ask({"op": "generate_batch", "requests": requests, "eos_ids": sorted(eos)})
            ids = got.get("token_ids")
            if not isinstance(ids, list) or len(ids) != len(requests):
                raise RetrospecError(f"corpus: the vLLM worker answered {len(ids) if isinstance(ids, list) else 0} "
                                     f"outputs to {len(requests)} prompts")
            out += [list(t) for t in ids]
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
