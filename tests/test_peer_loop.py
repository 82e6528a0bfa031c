"""The peer workers' request loop (``bench.peer_loop``): a worker does not outlive the process that started it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrospec.bench import peers

BENCH = Path(peers.__file__).parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_busy_worker_exits_through_its_exit_handlers_when_its_parent_dies(tmp_path):
    marker = tmp_path / "exited"
    worker = tmp_path / "worker.py"
    worker.write_text(f"""
import atexit, os, sys, time
sys.path.insert(0, {str(BENCH)!r})
import peer_loop
def bye():  # where vLLM stops its engine processes; written whole, then renamed, so a reader never sees it half-done
    with open({str(marker)!r} + ".part", "w") as f:
        f.write("bye")
    os.replace({str(marker)!r} + ".part", {str(marker)!r})
atexit.register(bye)
peer_loop.serve(lambda request: (object(), "0"), lambda engine, request: time.sleep(120) or {{}})
""")
    parent = subprocess.Popen([sys.executable, "-c", f"""
import json, subprocess, sys, time
w = subprocess.Popen([sys.executable, {str(worker)!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
w.stdin.write(json.dumps({{"op": "load"}}) + "\\n"); w.stdin.flush(); w.stdout.readline()
w.stdin.write(json.dumps({{"op": "generate"}}) + "\\n"); w.stdin.flush()  # the worker is busy for 120 s
print(w.pid, flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    time.sleep(0.5)
    parent.kill()  # SIGKILL: nothing of the parent's own runs
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not marker.exists():
        time.sleep(0.1)
    assert marker.exists() and marker.read_text() == "bye"

    def gone() -> bool:  # the exit handlers run just before the process ends: give it a moment to finish
        return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0 or _zombie(pid)

    while time.monotonic() < deadline + 10 and not gone():
        time.sleep(0.1)
    assert gone()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
