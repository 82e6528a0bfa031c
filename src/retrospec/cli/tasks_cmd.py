"""``retrospec tasks make kv|passkey|facts|repo``: write a seeded long-context task set as jsonl."""

from __future__ import annotations


def add_parser(sub) -> None:
    from ..tasks import TASKS

    p = sub.add_parser("tasks", help="generate offline long-context task sets (RAPID benchmarks)")
    tsub = p.add_subparsers(dest="tasks_command", required=True)
    m = tsub.add_parser("make", help="write N seeded tasks of one kind as jsonl (fields context, prompt, answers)")
    m.add_argument("kind", choices=TASKS)
    m.add_argument("--context-tokens", type=int, required=True,
                   help="size of the target prompt (context + query) in target tokens, e.g. 4096")
    m.add_argument("--n", type=int, default=10, help="number of tasks (default 10)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True, help="output .jsonl file")
    m.add_argument("--tokenizer", help="model or tokenizer directory, or a model name, that counts "
                                        "tokens (default: zoo)")
    m.set_defaults(func=run_make)


def run_make(args) -> int:
    from ..tasks import make_tasks, write_jsonl
    from ..errors import RetrospecError
    from ..models import default_target, model_dir
    from ..models.loading import _load_tokenizer

    src = model_dir(args.tokenizer) if args.tokenizer else default_target()
    if not src.is_dir():
        raise RetrospecError(f"tokenizer directory not found: {src}")
    tok = _load_tokenizer(src)  # RetrospecError when the files are there but do not load
    if tok is None:
        raise RetrospecError(f"no tokenizer files in {src}")
    tok.model_max_length = 1 << 30  # counting only; silences the over-length warning
    rows = make_tasks(args.kind, args.context_tokens, args.n, args.seed, tok)
    write_jsonl(rows, args.out)
    mean = sum(r["context_tokens"] for r in rows) / len(rows)
    print(f"wrote {len(rows)} {args.kind} tasks to {args.out} (context {mean:.0f} tokens on average, seed {args.seed})")
    return 0
