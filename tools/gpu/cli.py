"""``python -m tools.gpu plan|prepare|slim|step|report``: the GPU runbook's command line (tools/gpu/README.md).

Under the ``retrospec`` CLI's contract (``retrospec.cli.common.guarded``): a user error is one line
``retrospec: error: ...`` on stderr and exit code 2. ``plan`` exits 2 when a call breaks a device limit. Run from the
repository root, where ``tools`` is importable (the device calls do the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from retrospec.errors import RetrospecError

from . import STEPS

PROG = "python -m tools.gpu"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print a usage block first)
        where = self.prog.removeprefix(PROG).strip()  # the subcommand, if any
        raise SystemExit(f"{where}: {message}" if where else message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="The GPU runbook: plan, prepare, run a step (or its CPU dry run), report.")
    g = p.add_subparsers(dest="gpu_command", required=True, parser_class=_Parser)
    q = g.add_parser("plan", help="print the device calls, in order")
    q.add_argument("--json", action="store_true", help="one JSON object instead of text")
    q.add_argument("--root", default=".", help="the repository root (default: here)")
    q.set_defaults(func=run_plan)
    q = g.add_parser("prepare", help="make .gpu/ (model parts, CPU reference logits, prompts); list missing wheels")
    q.add_argument("--root", default=".")
    q.add_argument("--download-wheels", action="store_true", help="fetch the missing wheels into .whl/ with pip")
    q.add_argument("--keep-ref", action="store_true", help="keep .gpu/ref/ref.pt if present (cut the parts again)")
    q.set_defaults(func=run_prepare)
    q = g.add_parser("slim", help="take the bundled weights out of git's index for a GPU session (--undo after it)")
    q.add_argument("--root", default=".")
    q.add_argument("--undo", action="store_true", help="put them back (before committing)")
    q.set_defaults(func=run_slim)
    q = g.add_parser("step", help="run one step of the plan")
    q.add_argument("name", choices=STEPS)
    q.add_argument("--out", required=True, help="where <step>.json (and the step's files) go ($OUT on the device)")
    q.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds: the rehearsal")
    q.add_argument("--budget-s", type=float, default=None, help="the step's own time budget (default: the plan's)")
    q.add_argument("--ref", default=".gpu/ref", help="the carried reference folder")
    q.add_argument("--cpu", action="store_true", help="the real step on this CPU (a slow local rehearsal)")
    q.set_defaults(func=run_step)
    q = g.add_parser("report", help="markdown tables from the steps' JSON files")
    q.add_argument("paths", nargs="+", help="directories holding <step>.json, or the files")
    q.set_defaults(func=run_report)
    return p


def run_plan(args) -> None:
    from . import plan

    root = Path(args.root).resolve()
    tree = plan.travelling_bytes(root)
    calls = plan.build_plan(root, tree)
    print(json.dumps(plan.plan_json(calls, tree), indent=1) if args.json else plan.render(calls, tree, root))
    if bad := plan.check_plan(calls, tree):
        raise RetrospecError("the plan breaks a device limit: " + "; ".join(bad))


def run_prepare(args) -> None:
    from .prepare import prepare

    print(json.dumps(prepare(Path(args.root).resolve(), wheels=args.download_wheels, remake_ref=not args.keep_ref)))


def run_slim(args) -> None:
    from .slim import slim, unslim

    root = Path(args.root).resolve()
    paths = unslim(root) if args.undo else slim(root)
    what = "back in git's index" if args.undo else "out of git's index (they travel only when a call carries them)"
    print(f"{len(paths)} bundled weight files {what}" + ("" if args.undo or not paths else
                                                           "; 'make gpu-done' puts them back before a commit"))


def run_step(args) -> int:
    from . import plan, steps_bench, steps_kernels, steps_model, steps_train

    budget = args.budget_s if args.budget_s is not None else 60.0 if args.dry_run else plan.SPECS[args.name].budget_s
    if budget <= 0:
        raise RetrospecError(f"--budget-s must be > 0, got {budget}")
    if args.cpu:
        os.environ["RETROSPEC_GPU_DEVICE"] = "cpu"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RetrospecError(f"--out must be a directory, but {out} is a file")
    run = {"tests": steps_bench.run_tests, "kernels": steps_kernels.run_kernels,
           "costmodel": steps_kernels.run_costmodel, "stage": steps_model.run_stage, "model": steps_model.run_model,
           "bench": steps_bench.run_bench_step, "train": steps_train.run_train}[args.name]
    return run(out, args.dry_run, budget, Path(args.ref))


def run_report(args) -> None:
    from .report import load, render

    sys.stdout.write(render(load(args.paths)))


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.gpu``: one error line and exit 2 on a user error, the command's exit code otherwise."""
    from retrospec.cli.common import guarded

    def call():
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        return int(args.func(args) or 0)

    return guarded(call)
