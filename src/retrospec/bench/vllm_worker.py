"""The vLLM side of the bench's ``vllm-*`` rows, run by the peer's own interpreter (``make peers-vllm``).

This file imports only the standard library and ``vllm``: it runs in the peer's virtualenv as ``python
vllm_worker.py``, one JSON object per line on stdin and one answer per line on stdout (``bench.vllm_peer`` drives it
through ``bench.peers.PeerWorker``):

- ``{"op": "load", "model": checkpoint directory, "dtype": "float32" | "bfloat16", "threads": n, "n_ctx": n,
  "speculative_config": vLLM's dict or null, "env": {name: value}}``: ``env`` set, then one ``vllm.LLM`` (prefix
  caching off, so every prompt is prefilled; speculative decoding as configured); optional keys, passed to
  ``vllm.LLM`` when given: ``"tensor_parallel_size"``, ``"seed"`` (default 0), ``"gpu_memory_utilization"``
  (default 0.3); answers ``{"ok": true, "version": ..., "seeding": "record" | "engine"}``;
- ``{"op": "generate", "prompt_ids": [...], "max_new_tokens": n, "eos_ids": [...]}``: greedy decoding of the same
  token ids, run twice: one new token (``prefill_s``: the prompt and the first token), then the whole request;
  ``decode_s`` = the difference (vLLM's offline API does not stream); answers ``{"token_ids": [...], "prefill_s": s,
  "decode_s": s}``;
- ``{"op": "generate_batch", "requests": [{"prompt_ids": [...], "max_new_tokens": n, "temperature": t, "top_p": p,
  "seed": s}, ...], "eos_ids": [...]}``: every request in one ``LLM.generate`` call (vLLM batches them
  continuously), each sampled with its own seed (none when greedy; none either on vLLM's CPU build, which cannot
  seed requests one by one: the ``LLM``'s seed then covers the whole run, ``"seeding": "engine"``); answers
  ``{"token_ids": [[...], ...], "seconds": s}``, in the requests' order (a corpus: ``bench.vllm_corpus``).

Every failure is answered ``{"error": "one line"}``; vLLM's own log goes to stderr, never stdout.
"""

from __future__ import annotations

import os
import sys
import time

SEED_EACH = [True]  # False on vLLM's CPU build: a seeded request there fails ("CPU Generator does not use offset")


def _load(req: dict):
    threads = str(req["threads"])
    os.environ.update(req.get("env") or {})
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (req["threads"] - 1))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a few prompts of a small model
    import vllm

    kwargs = {"speculative_config": req["speculative_config"]} if req.get("speculative_config") else {}
    if req.get("tensor_parallel_size"):
        kwargs["tensor_parallel_size"] = int(req["tensor_parallel_size"])
    llm = vllm.LLM(model=req["model"], dtype=req["dtype"], max_model_len=req["n_ctx"], enable_prefix_caching=False,
                   gpu_memory_utilization=req.get("gpu_memory_utilization", 0.3), seed=req.get("seed", 0), **kwargs)
    try:
        from vllm.platforms import current_platform

        SEED_EACH[0] = not current_platform.is_cpu()
    except (ImportError, AttributeError):  # an older or stripped-down vllm: seed each request
        SEED_EACH[0] = True
    return llm, vllm.__version__, {"seeding": "record" if SEED_EACH[0] else "engine"}


def _run(llm, ids: list[int], max_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=eos, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def _generate(llm, req: dict) -> dict:
    ids, eos = req["prompt_ids"], req["eos_ids"]
    _, first = _run(llm, ids, 1, eos)
    tokens, whole = _run(llm, ids, req["max_new_tokens"], eos)
    return {"token_ids": tokens, "prefill_s": first, "decode_s": max(1e-9, whole - first)}


def _generate_batch(llm, req: dict) -> dict:
    from vllm import SamplingParams

    eos = req["eos_ids"]
    params = [SamplingParams(temperature=r["temperature"], top_p=r["top_p"] if r["temperature"] > 0 else 1.0,
                             seed=r["seed"] if r["temperature"] > 0 and SEED_EACH[0] else None,
                             max_tokens=r["max_new_tokens"], stop_token_ids=eos, detokenize=False)
              for r in req["requests"]]
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in req["requests"]], params, use_tqdm=False)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in out], "seconds": time.perf_counter() - t0}


def main() -> int:
    # from this file's folder, the shared request loop (which then takes the folder off sys.path); imported here, not
    # at the top: processes the peer spawns re-run this file's top level with the folder already gone
    import peer_loop

    return peer_loop.serve(_load, _generate, {"generate_batch": _generate_batch})


if __name__ == "__main__":
    sys.exit(main())
