"""``retrospec profile --formats``: one model's decode step in every weight format it can run in, beside the step's
floor and llama.cpp's decode step on the matching file.

Per format (``float32``, ``int8``, ``int4``, ``gguf``: the file's own blocks, ...), measured in one process:

- ``step_ms``: one ``Verifier.score`` of the root alone (a one-token decode step, logits included) over a cache of
  ``context`` tokens, through the engine's fast path in that format; ``loop``: how its decoder layers ran
  (``compiled``, ``lean``, ``modules``: ``EngineModel.describe``);
- ``floor_ms``: the format's matmul weights read once at the measured memory bandwidth (``weights_bytes`` /
  ``bandwidth_gbs``), the least a decode step can cost when reading weights is what bounds it;
- ``llamacpp_ms`` (where the peer is installed, ``bench.llamacpp``): llama.cpp's decode time per token after the same
  ``context``-token prompt (32 tokens, timed from its first new token), on the file of the matching type (F32 /
  Q8_0 written from the model's GGUF source, the source file itself for ``int4`` and ``gguf``); ``llamacpp_note``
  says why a format has none.

Ours and the peer's are measured in turn ``rounds`` times (interleaved: drift hits both alike); medians reported. The
two are the same work up to the sampling of one token per step (ours: logits only; llama.cpp: its greedy sampler).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

import torch

from ..types import DraftTree
from ..fastpath import engine_for
from .profile import verify_ms, weight_bytes

PEER_TOKENS = 32  # tokens llama.cpp decodes per timing


def _peer(target_path: str, fmt: str, context: int):
    """(a started llama.cpp worker for ``fmt``'s file, None) or (None, why there is none)."""
    from .llamacpp import open_peers

    peers, notes = open_peers(["llamacpp-ar"], target_path, fmt, greedy=True, threads=torch.get_num_threads(),
                              n_ctx=context + PEER_TOKENS + 8, pld_k=1, pld_ngram=1)
    if peers:
        return peers["llamacpp-ar"], None
    return None, (notes[0].split(": ", 1)[-1] if notes else "no llama.cpp file for this format")


def format_steps(target_path: str | Path, formats: list[str], context: int, reps: int, bandwidth_gbs: float,
                 device=None, rounds: int = 3, progress: Callable[[str], None] | None = None) -> dict:
    """{format: {"step_ms", "floor_ms", "weights_bytes", "llamacpp_ms" | "llamacpp_note"}} (see the module
    docstring). Each format's model is loaded (``load_model``'s cache keeps it for the process)."""
    from ..models import load_model

    say = progress or (lambda _msg: None)
    out: dict[str, dict] = {}
    for fmt in formats:
        say(f"format {fmt}")
        loaded = load_model(str(target_path), role="target", dtype=fmt, device=device)
        model = loaded.model
        kind, weights, _ = weight_bytes(model)
        prompt = torch.randint(0, int(model.config.vocab_size), (context,),
                               generator=torch.Generator().manual_seed(context)).tolist()
        peer, why = _peer(str(target_path), fmt, context) if model.device.type == "cpu" else (None, "CPU only")
        ours, theirs = [], []
        try:
            for _ in range(rounds):
                ours.append(verify_ms(model, {"engine": (None, {"1": DraftTree.chain([])})}, context, reps,
                                      int(model.config.vocab_size))["engine"]["1"])
                if peer is not None:
                    ids, _, decode_s = peer.generate(prompt, PEER_TOKENS, frozenset())
                    theirs.append(decode_s / max(1, len(ids) - 1) * 1e3)
        finally:
            if peer is not None:
                peer.close()
        row = {"format": kind, "weights_bytes": weights, "floor_ms": weights / bandwidth_gbs / 1e6,
               "step_ms": statistics.median(ours), "loop": engine_for(model).describe()["loop"]}
        if theirs:
            row["llamacpp_ms"] = statistics.median(theirs)
        else:
            row["llamacpp_note"] = why
        out[fmt] = row
    return out
