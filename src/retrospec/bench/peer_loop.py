"""The request loop every peer worker script runs (``llamacpp_worker.py``, ``vllm_worker.py``): standard library only.

A worker runs in its peer's own interpreter, where retrospec is not installed; it imports this file from its own
folder (``import peer_loop``) and calls ``serve``. The protocol is ``bench.peers``'s: one JSON request per line on
stdin, one JSON answer per line on stdout, every failure answered ``{"error": "one line"}``.

A worker does not outlive what started it: a SIGTERM (or, on Linux, the death of its parent, ``die_with_parent``)
exits it through the interpreter's exit handlers, where a peer stops the processes it started (vLLM's engine core
would otherwise keep computing, orphaned).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def die_with_parent() -> None:
    """SIGTERM exits through ``sys.exit`` (exit handlers run); on Linux the parent's death sends it (elsewhere the
    worker still ends when its stdin closes, once the request in progress returns)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() == 1:  # the parent died before the request took effect
        sys.exit(128 + signal.SIGTERM)


def serve(load: Callable[[dict], tuple[object, str]], generate: Callable[[object, dict], dict],
          ops: dict[str, Callable[[object, dict], dict]] | None = None) -> int:
    """Answer requests until stdin closes: ``{"op": "load", ...}`` -> ``load(request)`` = (engine, version) or
    (engine, version, facts), answered ``{"ok": true, "version": ...}`` plus ``facts``; a request whose op ``ops``
    names -> ``ops[op](engine, request)``; any other request -> ``generate(engine, request)``.

    Before anything is imported: this folder leaves ``sys.path`` (it holds modules named like the standard library's,
    ``profile``), and the answers get a private copy of stdout while file descriptor 1 becomes stderr, for this process
    and any the peer starts (their prints would otherwise land between the answers)."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    die_with_parent()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    engine = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req["op"] == "load":
                engine, version, *more = load(req)  # more: an optional dict of facts for the answer
                answer = {"ok": True, "version": version} | (more[0] if more else {})
            elif engine is None:
                answer = {"error": "no model loaded"}
            else:
                answer = (ops or {}).get(req["op"], generate)(engine, req)
        except Exception as exc:  # one line back to the bench, whatever the peer raised
            answer = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0
