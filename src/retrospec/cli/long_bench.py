"""``retrospec bench`` on long-context rows (files with a ``context`` field): lc, rag, sd, magicdec, rapid."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RetrospecError

DEFAULT_LONG_METHODS = "lc,rag,sd,magicdec,rapid"


def load_long_rows(spec: str) -> list[dict] | None:
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
    from ..bench.tasks import load_prompts

    rows = []
    for path in paths:
        for n, row in enumerate(load_prompts(path), 1):
            if not isinstance(row.get("context"), str) or not row["context"].strip():
                raise RetrospecError(f"{path}:{n}: long-context rows need a non-empty string field 'context'")
            rows.append(row)
    return rows


def run_long(args, rows: list[dict]) -> int:
    from ..bench.long_harness import LongBenchConfig, parse_method, run_long_bench
    from ..bench.long_report import print_table, write_outputs
    from ..config import DecodeConfig, SamplingConfig
    from ..long_requests import LongContextOptions, default_long_target
    from ..models import check_same_vocab, load_model
    from .long_args import long_context_kwargs

    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    DecodeConfig(max_new_tokens=args.max_new_tokens)  # validates
    spec = args.methods if args.methods != args.default_methods else DEFAULT_LONG_METHODS
    methods = [parse_method(m.strip()) for m in spec.split(",") if m.strip()]
    options = LongContextOptions.pop_from(long_context_kwargs(args, knobs=True))
    target = load_model(args.target or default_long_target(), role="target")
    draft = load_model(args.draft, role="draft") if args.draft else None
    if draft is not None:
        check_same_vocab(target, draft)
    if args.limit:
        rows = rows[: args.limit]
    cfg = LongBenchConfig(methods=methods, max_new_tokens=args.max_new_tokens, sampling=sampling, gamma=args.gamma,
                          options=options, warmup=not args.no_warmup, gating=False if args.no_gating else None)
    result = run_long_bench(target, draft, rows, cfg)
    out = Path(args.out)
    write_outputs(result, out)
    print_table(result["summary"])
    print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'long_context.png'}")
    return 0
