"""``retrospec bench``: methods x prompts, results.json + report.md + speedup.png, table on the console."""

from __future__ import annotations

from pathlib import Path

from ..errors import RetrospecError


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
                                      "instructions and questions; use with --chat)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--pld-k", type=int, default=10, help="pld / hf-pld draft length")
    p.add_argument("--pld-ngram", type=int, default=3, help="pld / hf-pld maximum n-gram size")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-warmup", action="store_true")
    add_sampling_args(p)
    from .long_args import add_long_context_args

    add_long_context_args(p, context_file=False)  # rows with a 'context' field: lc, rag, sd, magicdec, rapid
    from .datastore_cmd import add_retrieval_args

    add_retrieval_args(p, multiple=True)  # rest / dresd: --datastore (one per kind), --num-drafts, --draft-len
    p.set_defaults(func=run, default_methods=p.get_default("methods"))


def run(args) -> int:
    from ..bench.harness import BenchConfig, run_bench, validate_methods, write_outputs
    from ..bench.report import print_table
    from ..bench.tasks import load_prompts, preset
    from ..config import DecodeConfig, SamplingConfig
    from ..models import check_same_vocab, default_target, load_model, paired_draft
    from .datastore_cmd import bench_method_options

    if args.limit is not None and args.limit <= 0:
        raise RetrospecError(f"--limit must be > 0, got {args.limit}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise RetrospecError(f"--out must be a directory, but {args.out} is a file")
    if args.prompts:  # long-context rows (retrospec tasks make): a separate harness
        from .long_bench import load_long_rows, run_long

        rows = load_long_rows(args.prompts)
        if rows is not None:
            if args.chat:
                raise RetrospecError("--chat applies to prompt rows; long-context rows already use the chat "
                                     "template when the model has one (--no-chat-template turns it off)")
            return run_long(args, rows)
    if args.gamma is not None and args.gamma < 1:
        raise RetrospecError(f"--gamma must be >= 1, got {args.gamma}")
    if args.pld_k < 1 or args.pld_ngram < 1:
        raise RetrospecError("--pld-k and --pld-ngram must be >= 1")
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    DecodeConfig(max_new_tokens=args.max_new_tokens)  # validates
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    target = load_model(default_target() if args.target is None else args.target, role="target")
    draft_src = args.draft
    from ..bench.harness import parse_label

    if draft_src is None and any(parse_label(m)[0] == "sd" or m.startswith("hf-assisted") for m in methods):
        draft_src = paired_draft(args.target)  # default/named target: its paired draft
    draft = load_model(draft_src, role="draft") if draft_src is not None else None
    if draft is not None:
        check_same_vocab(target, draft)
    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer files")
    methods = validate_methods(methods, has_draft=draft is not None)
    prompts = load_prompts(args.prompts) if args.prompts else preset(args.preset, args.limit or 20)
    if args.limit:
        prompts = prompts[: args.limit]
    cfg = BenchConfig(methods=methods, max_new_tokens=args.max_new_tokens, sampling=sampling, gamma=args.gamma,
                      pld_k=args.pld_k, pld_ngram=args.pld_ngram, warmup=not args.no_warmup,
                      method_options=bench_method_options(args, methods, target), chat=args.chat,
                      gating=not args.no_gating)
    result = run_bench(target, draft, prompts, cfg)
    out = Path(args.out)
    write_outputs(result, out)
    print_table(result["summary"])
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'speedup.png'}")
    return 0
