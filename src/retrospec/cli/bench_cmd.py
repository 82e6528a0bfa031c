"""``retrospec bench``: methods x rows, results.json + report.md + a chart, table on the console. Rows with a
``context`` field (``retrospec tasks make``) are long-context rows (labels lc, rag, sd, magicdec, rapid by
default; baseline lc); other rows are prompts (baseline ar)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..drafters.registry import SPECS
from ..errors import RetrospecError

DEFAULT_CONTEXT_METHODS = "lc,rag,sd,magicdec,rapid"  # the default --methods for rows with a context


def add_parser(sub) -> None:
    from .generate_cmd import add_sampling_args

    p = sub.add_parser("bench", help="benchmark methods side by side on a prompt set")
    p.add_argument("--methods", default="ar,sd,pld,hf-assisted,hf-assisted-default,hf-pld",
                   help="comma-separated (ar is always included as the baseline)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="jsonl file with a 'prompt' or 'question' field per line (HumanEval/MBPP "
                                       "and NQ-open files work); "
                                       "rows with a 'context' field (retrospec tasks make; several files "
                                       "comma-separated) run the long-context bench: lc,rag,sd,magicdec,rapid")
    src.add_argument("--preset", help="built-in prompt set: heldout (held-out stdlib functions) | chat (short "
                                      "instructions and questions; use with --chat) | chat-tasks (instructions, QA, "
                                      "summaries, translation, maths; with --chat) | lcc (long code completion: "
                                      "4K-7K target tokens of held-out package source) | lcc-8k | lcc-16k | lcc-32k "
                                      "(the same at a fixed length)")
    p.add_argument("--longspec-draft", metavar="DIR|NAME",
                   help="LongSpec draft block of method longspec (labels longspec@gamma=N, longspec@tree=4x16x16); "
                        "default: the named target's bundled block (smollm2-135m -> smollm2-135m-longspec)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--pld-k", type=int, default=None,
                   help="pld / hf-pld draft length (default: --gamma, else pld's default)")
    p.add_argument("--pld-ngram", type=int, default=3, help="pld / hf-pld maximum n-gram size")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-warmup", action="store_true")
    add_sampling_args(p)
    from .generate_cmd import add_device_args, add_knob_args

    add_device_args(p)
    from .context_args import add_long_context_args

    add_knob_args(p, multiple_datastores=True, skip=("tree", "max_ngram", "neighbours", "rank", "adaptive_gamma"))
    add_long_context_args(p, context_file=False)  # rows with a 'context' field: lc, rag, sd, magicdec, rapid
    p.set_defaults(func=run, default_methods=p.get_default("methods"))


def run(args) -> int:
    from ..bench.harness import BenchConfig, run_bench, validate_methods
    from ..bench.labels import parse_label
    from ..tasks import load_prompts, preset, preset_max_tokens
    from ..config import DecodeConfig, SamplingConfig
    from ..models import paired_draft

    if args.limit is not None and args.limit <= 0:
        raise RetrospecError(f"--limit must be > 0, got {args.limit}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise RetrospecError(f"--out must be a directory, but {args.out} is a file")
    if args.gamma is not None and args.gamma < 1:
        raise RetrospecError(f"--gamma must be >= 1, got {args.gamma}")
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    DecodeConfig(max_new_tokens=args.max_new_tokens)  # validates
    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, gamma=args.gamma, warmup=not args.no_warmup,
                  gating=False if args.no_gating else None)
    rows = load_context_rows(args.prompts) if args.prompts else None
    if rows is not None:  # rows with a context: long-context labels, lc the baseline
        if args.chat:
            raise RetrospecError("--chat applies to prompt rows; long-context rows already use the chat "
                                 "template when the model has one (--no-chat-template turns it off)")
        return _finish(args, _context_run(args, rows[: args.limit], common), "long_context.png")
    pld_k = args.pld_k if args.pld_k is not None else args.gamma or SPECS["pld"].default_gamma
    if pld_k < 1 or args.pld_ngram < 1:
        raise RetrospecError("--pld-k and --pld-ngram must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check_knob_flags(args, methods, context=False)
    needs_draft = any(m in SPECS and SPECS[m].draft == "lm" or m.startswith("hf-assisted")
                      for m in (parse_label(label).method for label in methods))
    # default/named target: its paired draft
    target, draft = _models(args, paired_draft(args.target) if args.draft is None and needs_draft else args.draft)
    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer files")
    methods = validate_methods(methods, has_draft=draft is not None)
    longest = preset_max_tokens(args.preset) if args.preset else None
    if longest is not None:  # lcc*: plain continuation of prompts measured in target tokens
        if args.chat:
            raise RetrospecError(f"--preset {args.preset} is plain code continuation; drop --chat")
        limit = target.max_positions
        if limit and longest + args.max_new_tokens > limit:
            raise RetrospecError(f"--preset {args.preset} makes prompts of up to {longest} tokens; with "
                                 f"--max-new-tokens {args.max_new_tokens} they need {longest + args.max_new_tokens} "
                                 f"positions, but target {target.path} supports {limit}")
    options = _label_options(args, methods, target)
    longspec_src = _longspec_options(args, methods, target, options)
    prompts = (load_prompts(args.prompts) if args.prompts
               else preset(args.preset, args.limit or 20, tokenizer=target.tokenizer))
    cfg = BenchConfig(methods=methods, pld_k=pld_k, pld_ngram=args.pld_ngram, method_options=options,
                      chat=args.chat, longspec_draft=longspec_src, **common)
    return _finish(args, run_bench(target, draft, prompts[: args.limit], cfg), "speedup.png")


def _models(args, draft_src):
    """The target (``--target``, else the default) and the draft (``draft_src``, None: no draft), same vocabulary."""
    from ..models import check_same_vocab, default_target, load_model
    from .generate_cmd import device_kwargs

    load = device_kwargs(args)
    target = load_model(default_target() if args.target is None else args.target, role="target", **load)
    draft = load_model(draft_src, role="draft", **load) if draft_src is not None else None
    if draft is not None:
        check_same_vocab(target, draft)
    return target, draft


def _context_run(args, rows: list[dict], common: dict) -> dict:
    from ..bench.harness import BenchConfig, run_bench
    from ..request import LongContextOptions
    from .context_args import long_context_kwargs

    spec = args.methods if args.methods != args.default_methods else DEFAULT_CONTEXT_METHODS
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    _check_knob_flags(args, methods, context=True)  # a bad label or a knob no label takes fails before any load
    options = LongContextOptions.pop_from(long_context_kwargs(args, knobs=True))
    target, draft = _models(args, args.draft or None)
    return run_bench(target, draft, rows, BenchConfig(methods=methods, options=options, **common))


def _check_knob_flags(args, methods: list[str], context: bool) -> None:
    """Every knob flag given must be declared by the method of at least one label (as ``generate`` refuses a knob
    its method does not take); transformers' peers take ``--gamma``."""
    from ..bench.labels import parse_label
    from ..drafters.registry import all_knobs

    names = [parse_label(m, context=context).method for m in methods]
    for name, knob in all_knobs().items():
        if getattr(args, name, None) in (None, False, []):
            continue
        if not any(n in SPECS and SPECS[n].knob(name) is not None or name == "gamma" and n.startswith("hf-")
                   for n in names):
            raise RetrospecError(f"{knob.flag} applies to none of the methods benched ({', '.join(methods)})")


def _finish(args, result: dict, chart: str) -> int:
    from ..bench.report import print_table, write_outputs

    out = Path(args.out)
    write_outputs(result, out)
    for note in result["config"].get("notes") or []:
        print(f"note: {note}", file=sys.stderr)
    print_table(result["summary"])
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / chart}")
    return 0


def load_context_rows(spec: str) -> list[dict] | None:
    """Rows of one or more comma-separated jsonl files when they carry a ``context`` field; None otherwise."""
    paths = [Path(p) for p in spec.split(",") if p.strip()]
    if not all(p.is_file() for p in paths):
        if len(paths) > 1:
            missing = next(p for p in paths if not p.is_file())
            raise RetrospecError(f"prompts file not found: {missing}")
        return None
    try:
        with paths[0].open(encoding="utf-8") as fh:
            first = next((ln for ln in fh if ln.strip()), "")
        head = json.loads(first or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # not long-context rows; load_prompts reports what is wrong with the file
    if not isinstance(head, dict) or "context" not in head:
        if len(paths) > 1:
            raise RetrospecError("several --prompts files are only supported for long-context rows")
        return None
    from ..tasks import load_prompts

    rows = []
    for path in paths:
        for n, row in enumerate(load_prompts(path), 1):
            if not isinstance(row.get("context"), str) or not row["context"].strip():
                raise RetrospecError(f"{path}:{n}: long-context rows need a non-empty string field 'context'")
            rows.append(row)
    return rows


def _longspec_options(args, methods: list[str], target, options: dict[str, dict]) -> str | None:
    """Load longspec's block once (``--longspec-draft``, else the named target's bundled block) and hand it to
    every longspec label in ``options``; returns where it came from (None when no label runs longspec)."""
    from ..bench.labels import parse_label
    from ..drafters.longspec import load_block
    from ..models import paired_longspec

    labels = [m for m in methods if parse_label(m).method in SPECS and SPECS[parse_label(m).method].draft == "block"]
    if not labels:
        return None
    src = args.longspec_draft
    if src is None:
        try:
            src = paired_longspec(args.target)
        except RetrospecError as exc:  # a bundled block that is not built yet
            raise RetrospecError(f"{exc}; or give a block with --longspec-draft DIR|NAME") from None
        if src is None:
            raise RetrospecError(f"method 'longspec' needs a LongSpec draft block: --longspec-draft DIR|NAME (target "
                                 f"{target.path} has no bundled block)")
    block = load_block(src, target)
    for label in labels:
        options.setdefault(label, {})["draft"] = block
    return str(src)


def _label_options(args, methods: list[str], target) -> dict[str, dict]:
    """Factory options per label: the knob flags its method declares (``--sink``, ``--num-drafts``, ...; checked
    by the knob) and the datastore of its kind (one ``--datastore`` per kind, checked against the target up front,
    so a mismatch fails before any run). A label's own gamma comes from ``harness.label_options``."""
    from ..bench.labels import parse_label
    from ..retrieval import load_meta, open_store

    by_kind: dict[str, str] = {}
    for path in args.datastore:
        kind = load_meta(path)["kind"]
        if kind in by_kind:
            raise RetrospecError(f"two {kind} datastores given ({by_kind[kind]}, {path}); give one per kind")
        by_kind[kind] = path
    options: dict[str, dict] = {}
    for label in methods:
        spec = SPECS.get(parse_label(label).method)
        for knob in spec.knobs if spec is not None else ():
            value = getattr(args, knob.name, None) if knob.name not in ("gamma", "datastore") else None
            if value is not None:
                try:
                    options.setdefault(label, {})[knob.arg or knob.name] = knob.check(value)
                except RetrospecError as exc:
                    raise RetrospecError(str(exc).replace(knob.name, knob.flag, 1)) from None
        if spec is not None and spec.store:
            if spec.store not in by_kind:
                raise RetrospecError(f"method '{spec.name}' needs a {spec.store} datastore (--datastore DIR)")
            open_store(by_kind[spec.store], spec.store, target=target)
            options.setdefault(label, {})["datastore"] = by_kind[spec.store]
    return options
