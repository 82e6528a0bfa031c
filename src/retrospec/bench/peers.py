"""Peers in the bench, each in an interpreter of its own: one worker process per row kind, one JSON line each way.

A peer engine (llama.cpp, vLLM) pins its own dependencies and compiles or downloads for minutes, so it never shares
our virtualenv: ``make peers`` builds one per peer, and the bench drives a worker script (``*_worker.py``, standard
library plus the peer) through pipes. ``PeerWorker`` is that driver, whatever the peer:

- ``{"op": "load", ...}`` once (the peer's own keys), answered ``{"ok": true, "version": ...}``;
- ``{"op": "generate", "prompt_ids": [...], "max_new_tokens": n, "eos_ids": [...]}`` per prompt, answered
  ``{"token_ids": [...], "prefill_s": s, "decode_s": s}``: the same token ids our methods get, greedy, decode timed
  from the first new token on (our bench's decode phase);
- a worker may answer other ops of its own (``ask``: any request, one answer), e.g. ``vllm_worker``'s
  ``generate_batch`` for a corpus;
- any failure is answered ``{"error": "one line"}``; a worker that dies is reported with the last line it wrote to
  stderr (kept off the terminal otherwise).

Each peer's module (``bench.llamacpp``, ``bench.vllm_peer``) has an ``open_peers`` that starts the workers a bench's
methods ask for and says, one note per row, why any is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from ..errors import RetrospecError
from ..types import SpecStats


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")  # "ValueError: ...", "torch.OutOfMemoryError: ..."


class PeerWorker:
    """One worker process; ``generate`` answers like our ``_run_ours`` (ids, stats, decode seconds)."""

    def __init__(self, python: str, worker: Path, method: str, load: dict, peer: str):
        self.method, self.peer, self.model = method, peer, load["model"]
        self._err = tempfile.TemporaryFile()  # the peer's own log lines: shown only when the worker fails
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        try:
            self.info = self.ask({"op": "load"} | load)
        except RetrospecError:
            self.close()  # a worker that could not load leaves no process behind
            raise

    def ask(self, request: dict) -> dict:
        """Send one request, return its answer; a failure, a dead worker or a non-JSON answer is one
        ``RetrospecError`` line."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise RetrospecError(f"{self.method}: the {self.peer} worker stopped ({self._log_line() or 'no output'})")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise RetrospecError(f"{self.method}: the {self.peer} worker answered something else than JSON: "
                                 f"{line.strip()[:120]!r}")
        if "error" in answer:
            cause = self._log_line(errors_only=True)  # an engine that died says why in its log, not in the error
            said = str(answer["error"])
            raise RetrospecError(f"{self.method}: {said}" + (f" (the {self.peer} log: {cause})"
                                                               if cause and cause not in said else ""))
        return answer

    def _log_line(self, errors_only: bool = False) -> str:
        """The last line the worker wrote to stderr that names an error (or, unless ``errors_only``, its last line)."""
        fd = self._err.fileno()  # read without moving the offset the worker writes at (it shares this file)
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        named = [ln for ln in lines if _ERROR_LINE.search(ln)]
        return (named or ([] if errors_only else lines) or [""])[-1][:300]

    def generate(self, prompt_ids: list[int], max_new: int, eos: frozenset[int]) -> tuple[list[int], SpecStats,
                                                                                          float]:
        got = self.ask({"op": "generate", "prompt_ids": list(prompt_ids), "max_new_tokens": max_new,
                         "eos_ids": sorted(eos)})
        stats = SpecStats(method=self.method, prompt_tokens=len(prompt_ids))
        stats.new_tokens = len(got["token_ids"])
        stats.target_calls = stats.new_tokens  # not reported by the peer; its drafting makes fewer
        stats.prefill_s, stats.decode_s = got["prefill_s"], max(1e-9, got["decode_s"])
        return got["token_ids"], stats, stats.decode_s

    def describe(self) -> dict:
        """What the bench's config records of this row: the peer, its version, the model file or directory name."""
        return {"peer": self.peer, "version": self.info.get("version"), "file": Path(self.model).name}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._err.close()

