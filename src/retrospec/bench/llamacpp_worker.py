"""The llama.cpp side of the bench's ``llamacpp-*`` rows, run by the peer's own interpreter (``make peers``).

This file imports only the standard library and ``llama_cpp``: it runs in the peer's virtualenv, where retrospec is
not installed, as ``python llamacpp_worker.py`` with one JSON object per line on stdin and one answer per line on
stdout (``bench.llamacpp`` drives it):

- ``{"op": "load", "model": GGUF, "source": GGUF or null, "ftype": "f32" | "q8_0" | null, "threads": n,
  "n_ctx": n, "lookup": {"num_pred_tokens": k, "max_ngram_size": n} or null}``: write ``model`` from ``source``
  in ``ftype`` first when it does not exist (``llama_model_quantize``, requantizing allowed), then load it
  (prompt lookup needs every position's logits: ``logits_all``); answers ``{"ok": true, "version": ...}``;
- ``{"op": "generate", "prompt_ids": [...], "max_new_tokens": n, "eos_ids": [...]}``: greedy decoding of the same
  token ids our methods get, streamed: ``prefill_s`` = until the first new token, ``decode_s`` = from it to the last
  (the bench's decode phase); answers ``{"token_ids": [...], "prefill_s": s, "decode_s": s}``.

Every failure is answered ``{"error": "one line"}``; the worker never prints anything else on stdout.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time


def _write_model(source: str, dest: str, ftype: str) -> None:
    import llama_cpp

    codes = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = codes[ftype]
    params.allow_requantize = True
    tmp = f"{dest}.tmp-{os.getpid()}"
    if llama_cpp.llama_model_quantize(source.encode(), tmp.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize could not write {ftype} from {source}")
    os.replace(tmp, dest)


def _load(req: dict):
    import llama_cpp

    if not os.path.exists(req["model"]):
        if not req.get("source"):
            raise FileNotFoundError(f"no GGUF at {req['model']}")
        _write_model(req["source"], req["model"], req["ftype"])
    draft = None
    if req.get("lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(**req["lookup"])
    llm = llama_cpp.Llama(model_path=req["model"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                          n_threads_batch=req["threads"], logits_all=draft is not None, draft_model=draft,
                          verbose=False)
    return llm, llama_cpp.__version__


def _generate(llm, req: dict) -> dict:
    eos, limit = set(req["eos_ids"]), req["max_new_tokens"]
    llm.reset()  # no prefix reuse from the previous prompt: every prompt is prefilled
    out, t0 = [], time.perf_counter()
    first = last = t0
    for tok in llm.generate(req["prompt_ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                            reset=True):
        last = time.perf_counter()
        if not out:
            first = last
        out.append(int(tok))
        if tok in eos or len(out) >= limit:
            break
    return {"token_ids": out, "prefill_s": first - t0, "decode_s": last - first}


def main() -> int:
    # from this file's folder, the shared request loop (which then takes the folder off sys.path); imported here, not
    # at the top: processes the peer spawns re-run this file's top level with the folder already gone
    import peer_loop

    return peer_loop.serve(_load, _generate)


if __name__ == "__main__":
    sys.exit(main())
