"""llama.cpp as a peer in the bench: the ``llamacpp-ar`` and ``llamacpp-lookup`` rows.

llama-cpp-python compiles llama.cpp for minutes, so it lives in a virtualenv of its own (``make peers``:
``.venv-peers``; or any interpreter named by ``$RETROSPEC_LLAMACPP_PYTHON``) and never in ``make demo``/``make
test``. The bench drives it through ``llamacpp_worker.py`` (that interpreter, line-delimited JSON over pipes), one
worker per row kind, loaded once and asked prompt by prompt between our own methods (interleaved, as ours are).

Same work as ours: the same prompt token ids (chat prompts through our template), greedy, the same EOS ids and
``max_new_tokens``, decode timed after the first new token (``prefill_s`` apart). Same weights, matching format:
``float32`` runs an F32 GGUF written from the model's GGUF source, ``int8`` a Q8_0 one, ``int4`` the published
Q4_1 file itself (4-bit groups of 32 with fp16 scale and minimum, activations quantized to 8 bits: llama.cpp's own
4-bit format, not bit-identical to our int4). Written files are cached under ``$RETROSPEC_HOME/peers/``.
``llamacpp-lookup`` is llama-cpp-python's prompt lookup decoding with our ``pld`` k and n-gram size.

Rows are skipped with one note each (never an error) when the peer is not installed, the run samples, or the
target has no GGUF source (today: the named model ``smollm2-135m``). ``lossless`` of a peer row says whether its
tokens equal our ``ar``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import RetrospecError
from ..paths import cache_home
from .peers import PeerWorker

LLAMACPP_METHODS = ("llamacpp-ar", "llamacpp-lookup")
PYTHON_ENV = "RETROSPEC_LLAMACPP_PYTHON"
PEER_VENV = ".venv-peers"
WORKER = Path(__file__).with_name("llamacpp_worker.py")
GGUF_SOURCE = "smollm2-135m"  # the named model whose GGUF the peer can read
# ours -> llama.cpp file type (None: as shipped); w8a8 beside Q8_0 and w4a8 beside Q4_1, whose paths also quantize
# activations to 8 bits
FILE_FORMATS = {"float32": "f32", "int8": "q8_0", "w8a8": "q8_0", "int4": None, "w4a8": None, "gguf": None}


def peer_python() -> str | None:
    """The peer's interpreter: ``$RETROSPEC_LLAMACPP_PYTHON``, else ``.venv-peers/bin/python`` here; None if absent."""
    named = os.environ.get(PYTHON_ENV)
    path = Path(named) if named else Path(PEER_VENV) / "bin" / "python"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def peer_file(target_path: str | Path, fmt: str) -> tuple[dict | None, str | None]:
    """(the worker's load fields for ``fmt``, None) or (None, why there is none)."""
    from ..models.named import locate_gguf, lookup

    named = lookup(GGUF_SOURCE)
    try:
        same = Path(target_path).resolve() == named.location().resolve()
    except OSError:
        same = False
    if not same:
        return None, f"llama.cpp rows need the target's GGUF; only {GGUF_SOURCE}'s is known"
    if fmt not in FILE_FORMATS:
        return None, f"no llama.cpp file type matches format {fmt}"
    try:
        source = locate_gguf(named)
    except RetrospecError as exc:
        return None, str(exc)
    ftype = FILE_FORMATS[fmt]
    if ftype is None:
        return {"model": str(source), "source": None, "ftype": None}, None
    dest = cache_home() / "peers" / f"{source.stem}.{ftype.upper()}.gguf"
    dest.parent.mkdir(parents=True, exist_ok=True)
    return {"model": str(dest), "source": str(source), "ftype": ftype}, None


class LlamaCppPeer(PeerWorker):
    """One ``llamacpp_worker`` process; ``generate`` answers like our ``_run_ours``."""

    def __init__(self, python: str, method: str, load: dict):
        super().__init__(python, WORKER, method, load, "llama.cpp")


def open_peers(methods: list[str], target_path: str | Path, fmt: str, greedy: bool, threads: int, n_ctx: int,
               pld_k: int, pld_ngram: int) -> tuple[dict[str, LlamaCppPeer], list[str]]:
    """A started worker per requested ``llamacpp-*`` method, and one note per method skipped (with why)."""
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if not wanted:
        return {}, []
    python = peer_python()
    why = (None if python else f"llama.cpp is not installed (make peers, or ${PYTHON_ENV})") or \
        (None if greedy else "llama.cpp rows run greedy only")
    load = None
    if why is None:
        load, why = peer_file(target_path, fmt)
    if why is not None:
        return {}, [f"{m} skipped: {why}" for m in wanted]
    peers, notes = {}, []
    for m in wanted:
        lookup = {"num_pred_tokens": pld_k, "max_ngram_size": pld_ngram} if m == "llamacpp-lookup" else None
        try:
            peers[m] = LlamaCppPeer(python, m, load | {"threads": threads, "n_ctx": n_ctx, "lookup": lookup})
        except RetrospecError as exc:
            notes.append(f"{m} skipped: {exc}")
    return peers, notes


def check(python: str | None = None) -> str | None:
    """None when the peer decodes the published 4-bit file here (a few tokens), else why not (one line). A build
    for this CPU can still stop on an instruction the machine refuses to run (AMX tiles under some hypervisors): the
    peers build checks this and rebuilds without such kernels."""
    from ..models.named import locate_gguf, lookup

    python = python or peer_python()
    if python is None:
        return f"llama.cpp is not installed (make peers, or ${PYTHON_ENV})"
    try:
        load = {"model": str(locate_gguf(lookup(GGUF_SOURCE))), "source": None, "ftype": None}
    except RetrospecError as exc:
        return str(exc)
    try:
        peer = LlamaCppPeer(python, "check", load | {"threads": 1, "n_ctx": 64, "lookup": None})
        try:
            peer.generate([1, 2, 3, 4], 4, frozenset())
        finally:
            peer.close()
    except RetrospecError as exc:
        return str(exc)
    return None


if __name__ == "__main__":  # ``python -m retrospec.bench.llamacpp``: the peers build's check (exit 1 and why)
    import sys

    problem = check()
    print(problem or "llama.cpp decodes the 4-bit file here", file=sys.stderr if problem else sys.stdout)
    sys.exit(1 if problem else 0)
