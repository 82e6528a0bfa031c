"""``retrospec train rag-drafter``: tune a Speculative RAG drafter (a LoRA adapter on a base model).

Training of the other models lives under ``retrospec zoo`` (the zoo pair, ``real-draft``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import RetrospecError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train models: rag-drafter (Speculative RAG's drafter, a LoRA adapter)")
    tsub = p.add_subparsers(dest="train_command", required=True, parser_class=type(p))
    r = tsub.add_parser("rag-drafter", help="instruction-tune a Speculative RAG drafter on extractive rationales")
    r.add_argument("--base", default="smollm2-135m", help="base model directory or name (default smollm2-135m)")
    r.add_argument("--questions", required=True, help="questions.jsonl (id, question, answers, gold_passage); "
                                                      "only its train split is used")
    r.add_argument("--passages", required=True, help="passages.jsonl (id, title, text)")
    r.add_argument("--out", required=True, help="adapter directory to create")
    budget = r.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--seconds", type=float, help="train for this long (wall clock)")
    r.add_argument("--limit", type=int, default=None, help="use at most N training examples")
    r.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--accum", type=int, default=4, help="examples per optimizer step (default 4)")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="autocast dtype of the frozen base on the CPU (default bfloat16)")
    r.add_argument("--embedder", help="sentence-transformers directory for hard negatives (default: bundled MiniLM)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    r.set_defaults(func=run_rag_drafter)


def run_rag_drafter(args) -> int:
    import torch

    from ..train.rag_drafter import RagDrafterConfig, train_rag_drafter

    for name in ("questions", "passages"):
        if not Path(getattr(args, name)).is_file():
            raise RetrospecError(f"--{name} file not found: {getattr(args, name)}")
    for name in ("limit", "rank", "accum"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise RetrospecError(f"--{name} must be at least 1, got {value}")
    if args.lr <= 0:
        raise RetrospecError(f"--lr must be positive, got {args.lr}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RagDrafterConfig(base=args.base, questions=args.questions, passages=args.passages, out=args.out,
                           steps=args.steps, seconds=args.seconds, limit=args.limit, rank=args.rank,
                           alpha=2 * args.rank, lr=args.lr, accum=args.accum, dtype=args.dtype,
                           embedder=args.embedder, seed=args.seed)
    train_rag_drafter(cfg)
    return 0
