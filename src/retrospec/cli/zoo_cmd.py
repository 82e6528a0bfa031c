"""``retrospec zoo build|long|stream|info``: train, extend (long-context target) or describe the tiny model zoo.

The bundled zoo (``src/retrospec/zoo``) ships only the long-context pair, ``target-long`` and ``draft-long`` (the
named models ``zoo`` and ``zoo-draft``), and ``long.json``, whose ``base_zoo`` entry is the manifest of the
``zoo build`` they descend from. ``zoo build`` writes a complete base zoo (``target/``, ``draft/``, ``zoo.json``)
to ``--out``; ``zoo long`` needs such a base (``--base``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RetrospecError
from .train_cmd import config_from


def _ints(text: str, flag: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RetrospecError(f"{flag} must be comma-separated {what}, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("zoo", help="build or inspect the bundled tiny model zoo")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    b = zsub.add_parser("build", help="train tokenizer, target and distilled draft on the stdlib source (CPU ok)")
    b.add_argument("--out", required=True, help="output directory (written atomically)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--target-tokens", type=int, default=4_000_000)
    b.add_argument("--draft-tokens", type=int, default=2_500_000)
    b.add_argument("--self-distill-tokens", type=int, default=0,
                   help="also distil the draft on this many tokens the target generates from corpus prefixes")
    b.add_argument("--reuse-target", help="existing zoo dir: keep its tokenizer and target, retrain only the draft")
    b.set_defaults(func=run_build)
    lz = zsub.add_parser("long", help="add a long-context target (and optionally a small draft) to a zoo: "
                                      "continue the zoo target on code + retrieval tasks at <= 2K tokens (RAPID)")
    lz.add_argument("--base", help="zoo directory with target/ and draft/, as written by 'zoo build' (the bundled "
                                   "zoo holds only target-long/ and draft-long/)")
    lz.add_argument("--out", help="zoo directory to write target-long/, draft-long/, long.json (default: --base)")
    lz.add_argument("--seed", type=int, default=0)
    lz.add_argument("--steps", type=int, default=400)
    lz.add_argument("--batch-size", type=int, default=4)
    lz.add_argument("--max-len", type=int, default=2048, help="training length (batches at 1/4, 1/2, 3/4, 1 of it)")
    lz.add_argument("--lengths", help="comma-separated batch lengths instead of --max-len's four, e.g. 2048,4096,16384")
    lz.add_argument("--batch-tokens", type=int, default=0,
                    help="> 0: rows per batch = batch-tokens // length (overrides --batch-size)")
    lz.add_argument("--init-target", help="continue from this checkpoint instead of the base zoo target "
                                          "(e.g. a second stage at longer lengths); with --steps 0, kept as is")
    lz.add_argument("--draft-labels", action="store_true",
                    help="train draft-long on the labels (code + task completions) instead of distilling")
    lz.add_argument("--draft-lr", type=float, default=2e-3)
    lz.add_argument("--task-weight", type=float, default=0.5, help="weight of the task-completion loss (0..1)")
    lz.add_argument("--init-draft", help="continue distilling this draft-long instead of cutting down the zoo draft")
    lz.add_argument("--lr", type=float, default=5e-4)
    lz.add_argument("--draft-steps", type=int, default=0, help="> 0: also distil a small draft-long")
    lz.add_argument("--draft-intermediate", type=int, default=192)
    lz.add_argument("--eval-n", type=int, default=6, help="task rows per (task, length) for the accuracy check")
    lz.add_argument("--threads", type=int, default=0)
    lz.add_argument("--device", default="cpu", help="cpu | cuda | auto (cuda trains in bfloat16 autocast)")
    lz.add_argument("--workers", type=int, default=0, help="background processes rendering task examples")
    lz.add_argument("--seconds", type=float, default=0.0,
                    help="> 0: train the target for this wall-clock budget instead of --steps")
    lz.add_argument("--draft-seconds", type=float, default=0.0,
                    help="> 0: distil draft-long for this wall-clock budget instead of --draft-steps")
    lz.add_argument("--task-fraction", type=float, default=0.5, help="share of each batch's rows that are tasks")
    lz.add_argument("--stream-file", help="a .npy token stream to train on instead of this interpreter's stdlib")
    lz.set_defaults(func=run_long)
    st = zsub.add_parser("stream", help="encode this interpreter's stdlib training split with a zoo tokenizer into a "
                                        ".npy token stream (for zoo long --stream-file on another machine)")
    st.add_argument("--out", required=True, help="output .npy file (written atomically)")
    st.add_argument("--tokenizer", help="model or tokenizer directory, or a model name (default: zoo)")
    st.set_defaults(func=run_stream)
    rd = zsub.add_parser("real-draft", help="build a draft for a real target: target-initialised blocks, a reduced "
                                            "vocabulary, distilled on the target's soft labels (smollm2-135m-draft)")
    rd.add_argument("--out", required=True, help="draft directory to write (atomically)")
    rd.add_argument("--target", default="smollm2-135m", help="target model directory or name")
    rd.add_argument("--layers", default="0,1", help="target blocks copied into the draft, comma-separated")
    rd.add_argument("--vocab", type=int, default=12288, help="draft vocabulary size (most frequent training tokens)")
    rd.add_argument("--teacher-seconds", type=float, default=1400.0, help="time spent computing soft labels")
    rd.add_argument("--seconds", type=float, default=2000.0, help="time spent training on them")
    rd.add_argument("--seq-len", type=int, default=256)
    rd.add_argument("--batch-size", type=int, default=8)
    rd.add_argument("--lr", type=float, default=3e-4)
    rd.add_argument("--nq-dir", help="NQ-open directory (passages.jsonl, questions.jsonl) for prose and chat turns, "
                                     "e.g. ../shared/data/nq_open; rows before --nq-skip are never used")
    rd.add_argument("--nq-skip", type=int, default=200)
    rd.add_argument("--chat-answers", type=int, default=0, help="target-generated chat answers (slow on a CPU)")
    rd.add_argument("--code-continuations", type=int, default=0, help="target continuations of stdlib prefixes")
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--threads", type=int, default=0)
    rd.set_defaults(func=run_real_draft)
    i = zsub.add_parser("info", help="print the bundled zoo's manifest")
    i.add_argument("dir", nargs="?", help="zoo directory (default: bundled)")
    i.set_defaults(func=run_info)


def run_build(args) -> int:
    from ..train.zoo import ZooBuildConfig, build_zoo

    if args.target_tokens <= 0 or args.draft_tokens <= 0:
        raise RetrospecError("token budgets must be > 0")
    reuse = Path(args.reuse_target) if args.reuse_target else None
    if reuse is not None and not (reuse / "target" / "config.json").is_file():
        raise RetrospecError(f"--reuse-target: no zoo target at {reuse / 'target'}")
    build_zoo(config_from(ZooBuildConfig, args, out=Path(args.out), reuse_target=reuse,
                          self_distill_tokens=max(0, args.self_distill_tokens)))
    return 0


def run_long(args) -> int:
    import sys

    from ..models import ZOO_DIR
    from ..train.common import resolve_device
    from ..train.zoo import LongZooConfig, build_long_zoo

    base = Path(args.base) if args.base else ZOO_DIR
    if not (base / "target" / "config.json").is_file():
        hint = ("the bundled zoo ships only target-long/draft-long; " if base == ZOO_DIR else "") + \
            "build a base zoo with 'retrospec zoo build --out DIR' and pass --base DIR"
        raise RetrospecError(f"no zoo target at {base / 'target'} ({hint})")
    if args.steps == 0 and not args.init_target:
        raise RetrospecError("--steps 0 (keep the target as is) needs --init-target")
    for flag in ("init_draft", "init_target"):
        if getattr(args, flag) and not (Path(getattr(args, flag)) / "config.json").is_file():
            raise RetrospecError(f"--{flag.replace('_', '-')}: no model at {getattr(args, flag)}")
    if args.steps < 0 or args.batch_size < 1 or args.max_len < 256 or args.draft_steps < 0:
        raise RetrospecError("need --steps >= 0, --batch-size >= 1, --max-len >= 256, --draft-steps >= 0")
    if args.workers < 0 or args.seconds < 0 or args.draft_seconds < 0 or not 0 <= args.task_fraction <= 1:
        raise RetrospecError("need --workers >= 0, --seconds >= 0, --draft-seconds >= 0, 0 <= --task-fraction <= 1")
    resolve_device(args.device)
    if args.stream_file and not Path(args.stream_file).is_file():
        raise RetrospecError(f"--stream-file: no such file {args.stream_file}")
    if args.lengths:
        lengths = tuple(sorted(set(_ints(args.lengths, "--lengths", "integers"))))
        if not lengths or min(lengths) < 256:
            raise RetrospecError("--lengths must be >= 256 each")
    else:
        lengths = tuple(sorted({max(256, args.max_len * k // 4) for k in (1, 2, 3, 4)}))
    if args.batch_tokens < 0:
        raise RetrospecError("--batch-tokens must be >= 0")
    build_long_zoo(config_from(LongZooConfig, args, base=base, out=Path(args.out) if args.out else base,
                               lengths=lengths, init_target=args.init_target or "", init_draft=args.init_draft or "",
                               stream_file=args.stream_file or "", command="retrospec " + " ".join(sys.argv[1:])))
    return 0


def run_stream(args) -> int:
    import os

    import numpy as np

    from ..models import default_target, model_dir
    from ..train.zoo import load_tokenizer, stdlib_train_stream

    src = model_dir(args.tokenizer) if args.tokenizer else default_target()
    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer_config.json").is_file():
        raise RetrospecError(f"no tokenizer files in {src}")
    out = Path(args.out)
    if out.suffix != ".npy":
        raise RetrospecError(f"--out must end in .npy, got {out}")
    if not out.parent.is_dir():
        raise RetrospecError(f"output directory does not exist: {out.parent}")
    stream = stdlib_train_stream(load_tokenizer(src))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, stream)
    tmp.replace(out)
    print(f"wrote {out}: {len(stream):,} tokens ({stream.dtype})")
    return 0


def run_real_draft(args) -> int:
    from ..train.real_draft import RealDraftConfig, build_real_draft

    layers = _ints(args.layers, "--layers", "block indices")
    if not layers or args.vocab < 2 or args.seconds <= 0 or args.teacher_seconds <= 0 or args.seq_len < 2:
        raise RetrospecError("--layers, --vocab >= 2, --seconds > 0, --teacher-seconds > 0 and --seq-len >= 2 needed")
    nq = Path(args.nq_dir) if args.nq_dir else None
    if nq is not None and not (nq / "passages.jsonl").is_file():
        raise RetrospecError(f"--nq-dir: no passages.jsonl in {nq}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise RetrospecError(f"--out {out} exists and is not empty")
    build_real_draft(config_from(RealDraftConfig, args, out=out, layers=layers, nq_dir=nq),
                     log=lambda msg: print(msg, flush=True))
    return 0


def run_info(args) -> int:
    from ..models import ZOO_DIR

    path = Path(args.dir) if args.dir else ZOO_DIR
    zoo, long = path / "zoo.json", path / "long.json"
    if not zoo.is_file() and not long.is_file():
        raise RetrospecError(f"no zoo manifest (zoo.json or long.json) in {path}")
    if not long.is_file():  # a base zoo only (zoo build)
        print(json.dumps(json.loads(zoo.read_text()), indent=2))
        return 0
    info = {"long": json.loads(long.read_text())}  # the long-context pair, with its earlier stages
    if zoo.is_file():
        info = {"zoo": json.loads(zoo.read_text())} | info
    elif "base_zoo" in info["long"]:  # the bundled zoo: the base manifest travels inside long.json
        info = {"zoo": info["long"].pop("base_zoo")} | info
    print(json.dumps(info, indent=2))
    return 0
