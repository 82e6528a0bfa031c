"""``retrospec profile``: ms of one target forward by tokens and context on this machine, floors, draft cost, the
gamma each method would pick; a table, ``--json`` (one object) and a plot (``bench.profile``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from ..errors import RetrospecError


def is_longspec_block(spec: str) -> bool:
    from ..models.longspec.checkpoint import META_FILE
    from ..models.named import longspec_dir

    try:
        return (longspec_dir(spec) / META_FILE).is_file()
    except RetrospecError:
        return False


def _ints(text: str, what: str, lo: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise RetrospecError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < lo:
        raise RetrospecError(f"{what} must be integers >= {lo}, got {text!r}")
    return tuple(sorted(set(values)))


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="what one target forward costs here, by tokens and context (choose a method)")
    p.add_argument("--target", help="target model directory or name (default: the bundled zoo target)")
    p.add_argument("--draft", help="draft model or LongSpec block (directory or name): its cost per drafted "
                                        "token")
    p.add_argument("--contexts", default="300,2000", help="cached context lengths (default 300,2000)")
    p.add_argument("--tokens", default="1,2,3,4,5,8,16",
                   help="tokens per forward, root included (default 1,2,3,4,5,8,16)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per point, median reported (default 7)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain transformers forward (half the time)")
    p.add_argument("--no-trees", action="store_true", help="skip the tree shapes")
    p.add_argument("--remeasure", action="store_true", help="measure the engine's matmul plan and the draft's "
                                                              "matmul path again (both are cached per model shape "
                                                              "and machine)")
    from .generate_cmd import add_device_args

    add_device_args(p)
    p.add_argument("--formats", metavar="LIST",
                   help="also measure a one-token step in each of these weight formats (comma-separated, or 'all': "
                        "float32,int8,w8a8,int4, w4a8 where the CPU runs it, gguf where the target has a GGUF "
                        "source), beside each format's floor and llama.cpp's decode step on the matching file where "
                        "the peer is installed (make peers)")
    p.add_argument("--json", action="store_true", help="print one JSON object (forward_ms[context][tokens] = ms)")
    p.add_argument("--plot", metavar="PNG", help="write the plot here")
    p.add_argument("--out", metavar="DIR", help="write profile.json, profile.md and profile.png here")
    p.set_defaults(func=run)


def save_for_gate(model, prof: dict) -> None:
    """Keep the profile where the gate of later processes starts from it (``gating.saved_verify_costs``)."""
    from ..atomic import write_text_atomic
    from ..gating import saved_profile_path

    path = saved_profile_path(model)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(prof))
    except OSError:
        pass  # a read-only cache: the gate learns its costs as before


def _formats(text: str | None, target: str | None) -> list[str]:
    """``--formats``: the names, checked; ``all``: float32, int8, w8a8, int4, w4a8 where this CPU runs it, and gguf
    where the target has a GGUF source."""
    from ..models import default_target
    from ..models.gguf_native import converted_from_gguf
    from ..models.loading import FORMAT_NAMES, model_dir
    from ..models.named import gguf_of

    if not text:
        return []
    if text.strip() == "all":
        from ..kernels import w4a8_cpu

        names = ["float32", "int8", "w8a8", "int4", *(["w4a8"] if w4a8_cpu() else [])]
        try:
            path = model_dir(default_target() if target is None else target)
            if converted_from_gguf(path, gguf_of(path)):
                names.append("gguf")
        except RetrospecError:
            pass  # the target itself is checked (one line) when it loads
        return names
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in FORMAT_NAMES]
    if not names or bad:
        raise RetrospecError(f"--formats takes 'all' or names from {', '.join(FORMAT_NAMES)}, got {text!r}")
    return list(dict.fromkeys(names))


def run(args) -> int:
    from ..atomic import write_text_atomic
    from ..bench.profile import render_plot, render_table, run_profile
    from ..fastpath import engine_for
    from ..models import check_same_vocab, default_target, load_model
    from .generate_cmd import device_kwargs

    contexts = _ints(args.contexts, "--contexts", 1)
    tokens = _ints(args.tokens, "--tokens", 1)
    if args.reps < 1:
        raise RetrospecError("--reps must be >= 1")
    if args.plot and Path(args.plot).is_dir():
        raise RetrospecError(f"--plot must be a file, but {args.plot} is a directory")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise RetrospecError(f"--out must be a directory, but {args.out} is a file")
    formats = _formats(args.formats, args.target)
    load = device_kwargs(args)
    target = load_model(default_target() if args.target is None else args.target, role="target", **load)
    if target.max_positions and max(contexts) + max(tokens) > target.max_positions:
        raise RetrospecError(f"context {max(contexts)} + {max(tokens)} tokens exceeds the target's "
                             f"{target.max_positions} positions")
    draft = None
    if args.draft is not None and is_longspec_block(args.draft):  # a LongSpec block: drafted over the target's KV
        from ..drafters.longspec import load_block

        draft = SimpleNamespace(path=str(args.draft), longspec_block=load_block(str(args.draft), target.model))
    elif args.draft is not None:
        draft = load_model(args.draft, role="draft", **load)
        check_same_vocab(target, draft)
    if args.remeasure:  # the target's plan, and the draft's matmul path (fastpath.draft), measured again
        engine_for(target.model, remeasure=True)
        if draft is not None and hasattr(draft, "longspec_block"):
            from ..drafters.longspec import fast_block

            fast_block(draft.longspec_block, remeasure=True)
        elif draft is not None:
            engine_for(draft.model, draft=True, remeasure=True)
    say = (lambda m: print(f"[profile] {m}", file=sys.stderr, flush=True)) if sys.stderr.isatty() or not args.json \
        else (lambda m: None)
    prof = run_profile(target, draft, contexts, tokens, reps=args.reps, plain=not args.no_plain,
                       trees=not args.no_trees, progress=say)
    save_for_gate(target.model, prof)
    if formats:
        from ..bench.format_steps import format_steps

        prof["format_steps"] = format_steps(target.path, formats, contexts[0], args.reps,
                                            prof["floors"]["bandwidth_gbs"], device=args.device, progress=say)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "profile.json", json.dumps(prof, indent=1) + "\n")
        (out / "profile.md").write_text(render_table(prof))
        render_plot(prof, out / "profile.png")
    if args.plot:
        render_plot(prof, args.plot)
    print(json.dumps(prof) if args.json else render_table(prof), end="\n" if args.json else "")
    return 0
