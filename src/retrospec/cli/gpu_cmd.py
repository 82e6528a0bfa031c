"""``retrospec gpu plan|prepare|step|report``: the GPU runbook (``retrospec.gpu``; docs/gpu.md).

- ``plan [--json]``: the device ``run`` calls in order (command, carry, timeout, what comes back); exit 2 when a call
  breaks a limit (a command over 2000 characters, a carry over 8 paths or over 64 MiB with the tree).
- ``prepare [--download-wheels]``: ``make gpu``: the carry folders ``.gpu/`` (model parts, CPU reference, prompts)
  and the list of wheels ``.whl/`` lacks.
- ``step NAME [--dry-run] --out DIR [--budget-s S]``: run one step (on a GPU machine, or on CPU with tiny models).
- ``report DIR|FILE...``: the steps' JSON files as markdown tables for docs/gpu.md.

``python -m retrospec.cli.gpu_cmd ...`` runs the same commands without building the rest of the CLI (what the
device calls use). The ``gpu`` package itself never imports the CLI (it sits below it in the layering).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RetrospecError

STEP_NAMES = ("tests", "kernels", "costmodel", "stage", "model", "bench", "train")


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="the GPU runbook: plan, prepare, run a step (or its CPU dry run), report")
    g = p.add_subparsers(dest="gpu_command", required=True, parser_class=type(p))
    q = g.add_parser("plan", help="print the device calls, in order")
    q.add_argument("--json", action="store_true", help="one JSON object instead of text")
    q.add_argument("--root", default=".", help="the repository root (default: here)")
    q.set_defaults(func=run_plan)
    q = g.add_parser("prepare", help="make .gpu/ (model parts, CPU reference logits, prompts); list missing wheels")
    q.add_argument("--root", default=".")
    q.add_argument("--download-wheels", action="store_true", help="fetch the missing wheels into .whl/ with pip")
    q.add_argument("--keep-ref", action="store_true", help="keep .gpu/ref/ref.pt if present (cut the parts again)")
    q.set_defaults(func=run_prepare)
    q = g.add_parser("step", help="run one step of the plan")
    q.add_argument("name", choices=STEP_NAMES)
    q.add_argument("--out", required=True, help="where <step>.json (and the step's files) go ($OUT on the device)")
    q.add_argument("--dry-run", action="store_true", help="CPU, tiny models, seconds: the rehearsal")
    q.add_argument("--budget-s", type=float, default=None, help="the step's own time budget (default: the plan's)")
    q.add_argument("--ref", default=".gpu/ref", help="the carried reference folder")
    q.add_argument("--cpu", action="store_true", help="the real step on this CPU (a slow local rehearsal)")
    q.set_defaults(func=run_step)
    q = g.add_parser("report", help="markdown tables from the steps' JSON files")
    q.add_argument("paths", nargs="+", help="directories holding <step>.json, or the files")
    q.set_defaults(func=run_report)


def run_plan(args) -> int:
    from ..gpu import plan

    root = Path(args.root).resolve()
    tree = plan.travelling_bytes(root)
    calls = plan.build_plan(root, tree)
    bad = plan.check_plan(calls, tree)
    print(json.dumps(plan.plan_json(calls, tree), indent=1) if args.json else plan.render(calls, tree, root))
    if bad:
        raise RetrospecError("the plan breaks a device limit: " + "; ".join(bad))
    return 0


def run_prepare(args) -> int:
    from ..gpu.prepare import prepare

    got = prepare(Path(args.root).resolve(), wheels=args.download_wheels, remake_ref=not args.keep_ref)
    print(json.dumps(got))
    return 0


def run_step(args) -> int:
    from ..gpu import plan

    budget = args.budget_s if args.budget_s is not None else plan.SPECS[args.name].budget_s
    if args.dry_run and args.budget_s is None:
        budget = 60.0
    if budget <= 0:
        raise RetrospecError(f"--budget-s must be > 0, got {budget}")
    if args.cpu:
        import os

        os.environ["RETROSPEC_GPU_DEVICE"] = "cpu"
    out, ref = Path(args.out), Path(args.ref)
    if out.exists() and not out.is_dir():
        raise RetrospecError(f"--out must be a directory, but {out} is a file")
    if args.name in ("tests", "bench"):
        from ..gpu import steps_bench as m

        return m.run_tests(out, args.dry_run, budget) if args.name == "tests" else m.run_bench_step(
            out, args.dry_run, budget, ref)
    if args.name in ("kernels", "costmodel"):
        from ..gpu import steps_kernels as m

        return (m.run_kernels if args.name == "kernels" else m.run_costmodel)(out, args.dry_run, budget)
    if args.name in ("stage", "model"):
        from ..gpu import steps_model as m

        return m.run_stage(out, args.dry_run, budget) if args.name == "stage" else m.run_model(
            out, args.dry_run, budget, ref)
    from ..gpu import steps_train as m

    return m.run_train(out, args.dry_run, budget, ref)


def run_report(args) -> int:
    from ..gpu.report import load, render

    sys.stdout.write(render(load(args.paths)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m retrospec.cli.gpu_cmd``: this command alone, under the CLI's contract (one error line, exit 2)."""
    from . import _Parser, guarded

    def call():
        parser = _Parser(prog="retrospec")
        sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
        add_parser(sub)
        args = parser.parse_args(["gpu", *(sys.argv[1:] if argv is None else argv)])
        return int(args.func(args) or 0)

    return guarded(call)


if __name__ == "__main__":
    raise SystemExit(main())
