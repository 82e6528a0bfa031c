"""``retrospec rag index|answer|bench|merge``: Speculative RAG (Wang et al., ICLR 2025) from the command line.

- ``index`` embeds a passages JSONL (id, title, text) into a ``rag`` datastore directory (exact FAISS inner-product
  index over unit-norm sentence embeddings; see ``retrospec.speculative_rag.index``);
- ``answer`` answers one question with one method and prints the drafts, their scores and the latency split;
- ``bench`` runs methods over a question file (``--split eval`` by default: never used to tune the drafter) and
  writes ``results.json``, ``report.md`` and ``accuracy_latency.png``; ``merge`` joins benches run in shards.

User errors are ``RetrospecError``s: one line on stderr, exit code 2.
"""

from __future__ import annotations

import time

from ..errors import RetrospecError
from ..speculative_rag import DEFAULT_DRAFTER, DEFAULT_VERIFIER, RagConfig

CONFIG_INTS = (("docs", "passages retrieved per question (default 10)"),  # RagConfig fields with a flag each
               ("drafts", "document subsets = drafts (default 5)"),
               ("per_draft", "documents per subset = clusters (default 2)"),
               ("max_rationale_tokens", None), ("max_answer_tokens", None),
               ("seed", "subset sampling seed (default 0)"))


def add_parser(sub) -> None:
    p = sub.add_parser("rag", help="Speculative RAG (Wang et al., ICLR 2025): index, answer, bench")
    rsub = p.add_subparsers(dest="rag_command", required=True, parser_class=type(p))
    _add_index(rsub)
    _add_answer(rsub)
    _add_bench(rsub)


def _add_index(rsub) -> None:
    i = rsub.add_parser("index", help="embed a passages JSONL (id, title, text) into a RAG index directory")
    i.add_argument("--passages", required=True, metavar="F.jsonl", help="passages, one JSON object per line")
    i.add_argument("--out", required=True, metavar="DIR", help="index directory to create")
    i.add_argument("--embedder", metavar="DIR",
                   help="local sentence-transformers directory (default: the bundled all-MiniLM-L6-v2)")
    i.add_argument("--batch-size", type=int, default=64, help="passages per embedding batch (default 64)")
    i.add_argument("--overwrite", action="store_true", help="replace an existing index at --out")
    i.set_defaults(func=run_index)


def run_index(args) -> int:
    from ..speculative_rag.index import build_index
    from ..retrieval.store import load_meta

    if args.batch_size < 1:
        raise RetrospecError(f"--batch-size must be >= 1, got {args.batch_size}")
    started = time.perf_counter()
    out = build_index(args.passages, args.out, embedder=args.embedder, overwrite=args.overwrite,
                      batch_size=args.batch_size)
    meta = load_meta(out, kind="rag")
    emb = meta["embedder"]
    print(f"{out}: RAG index of {meta['counts']['passages']:,} passages, {emb['dim']}-d ({emb['name']}), "
          f"built in {time.perf_counter() - started:.1f} s")
    return 0


def _add_models(p) -> None:
    p.add_argument("--index", required=True, metavar="DIR", help="a RAG index from 'retrospec rag index'")
    p.add_argument("--drafter", help=f"drafter model directory, adapter or name (default: {DEFAULT_DRAFTER} when "
                                     f"bundled, else the verifier model)")
    p.add_argument("--verifier", default=DEFAULT_VERIFIER, help=f"verifier model (default {DEFAULT_VERIFIER})")
    p.add_argument("--embedder", metavar="DIR", help="the embedder the index was built with (default: bundled)")
    for name, help_ in CONFIG_INTS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(RagConfig, name), help=help_)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype (bfloat16 roughly halves prompt time on CPUs with AVX512-BF16)")
    p.add_argument("--score-norm", default="mean", choices=("mean", "sum"),
                   help="mean (default): ρ_draft and ρ_SC per token; sum: the paper's raw product")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")


def _add_answer(rsub) -> None:
    a = rsub.add_parser("answer", help="answer one question with Speculative RAG or a baseline")
    _add_models(a)
    a.add_argument("--question", required=True)
    a.add_argument("--method", default="specrag", help="specrag (default), standard, drafter, closed-book, or an "
                                                       "ablation (specrag-random-subsets, ...)")
    a.add_argument("--json", action="store_true", help="print the answer, drafts, scores and timings as JSON")
    a.set_defaults(func=run_answer)


def _add_bench(rsub) -> None:
    b = rsub.add_parser("bench", help="accuracy and latency of RAG methods on held-out questions")
    _add_models(b)
    b.add_argument("--questions", required=True, metavar="F.jsonl", help="id, question, answers, gold_passage")
    b.add_argument("--methods", default="specrag,standard,drafter,closed-book",
                   help="comma-separated; 'all' = every method and ablation")
    b.add_argument("--split", default="eval", choices=("eval", "train", "all"),
                   help="which questions (default eval: never used to tune the drafter)")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--offset", type=int, default=0)
    b.add_argument("--shard", default=None, metavar="I/N", help="run every N-th question starting at I (0-based)")
    b.add_argument("--resume", action="store_true", help="continue a stopped bench in --out")
    b.add_argument("--out", required=True, metavar="DIR")
    b.set_defaults(func=run_bench)
    m = rsub.add_parser("merge", help="one report from rag bench directories run in shards")
    m.add_argument("parts", nargs="+", metavar="DIR")
    m.add_argument("--out", required=True, metavar="DIR")
    m.set_defaults(func=run_merge)


def _pipeline(args):
    import torch

    from ..speculative_rag import open_pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RagConfig(**{name: getattr(args, name) for name, _ in CONFIG_INTS}, score_norm=args.score_norm)
    cfg.validate()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # answer-level: drafter and verifier exchange text, not token ids, so their tokenizers may differ
    pipe = open_pipeline(args.index, drafter=args.drafter, verifier=args.verifier, embedder=args.embedder,
                         dtype=dtype, config=cfg)
    return pipe, pipe.drafter.path


def run_answer(args) -> int:
    import json

    from ..speculative_rag.pipeline import resolve_methods

    method = resolve_methods(args.method)
    if len(method) != 1:
        raise RetrospecError("--method takes one method (rag bench compares several)")
    if not args.question.strip():
        raise RetrospecError("--question is empty")
    pipe, drafter = _pipeline(args)
    res = pipe.answer(args.question, method[0])
    if args.json:
        print(json.dumps(res.to_dict() | {"drafter": drafter, "verifier": args.verifier}, ensure_ascii=False,
                         indent=1))
        return 0
    t = res.timings
    print(res.answer)
    print(f"[{res.method}] latency {t['latency_s']:.2f} s (retrieve {t['retrieve_s']:.2f}, cluster "
          f"{t['cluster_s']:.2f}, draft {t['draft_s']:.2f}, verify {t['verify_s']:.2f}); drafter {drafter}, "
          f"verifier {args.verifier}")
    for i, d in enumerate(res.drafts):
        mark = "*" if i == res.chosen else " "
        terms = ", ".join(f"{k} {v:.2f}" for k, v in (("draft", d.log_draft), ("sc", d.log_sc), ("sr", d.log_sr))
                          if v is not None)
        score = f"{d.score:.2f}" if d.score is not None else "-"
        print(f"{mark} draft {i + 1} [{', '.join(d.subset)}] log score {score} ({terms})")
        print(f"    answer: {d.answer}")
        print(f"    rationale: {d.rationale}")
    return 0


def run_bench(args) -> int:
    import platform
    from pathlib import Path

    import torch

    from ..speculative_rag.bench import run_bench as bench
    from ..speculative_rag.data import read_questions, select
    from ..speculative_rag.pipeline import METHODS, resolve_methods

    methods = list(METHODS) if args.methods.strip() == "all" else resolve_methods(args.methods)
    if args.limit is not None and args.limit < 1:
        raise RetrospecError(f"--limit must be at least 1, got {args.limit}")
    questions = select(read_questions(args.questions), args.split, args.limit, args.offset)
    if args.shard:
        try:
            i, n = (int(x) for x in args.shard.split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            raise RetrospecError(f"--shard must be I/N with 0 <= I < N, got {args.shard!r}") from None
        questions = questions[i::n]
    if not questions:
        raise RetrospecError(f"no questions selected from {args.questions} (split {args.split})")
    pipe, drafter = _pipeline(args)
    config = {"questions_file": args.questions, "split": args.split, "limit": args.limit, "offset": args.offset,
              "shard": args.shard, "index": args.index, "drafter": drafter, "verifier": args.verifier,
              "dtype": args.dtype, "threads": torch.get_num_threads(), "methods": methods,
              "machine": platform.machine(), "torch": torch.__version__} | {
        k: getattr(pipe.config, k) for k in (*(name for name, _ in CONFIG_INTS), "score_norm")}
    result = bench(pipe, questions, methods, Path(args.out), config=config, resume=args.resume)
    _print_summary(result, args.out)
    return 0


def run_merge(args) -> int:
    from pathlib import Path

    from ..speculative_rag.bench import merge

    result = merge([Path(p) for p in args.parts], Path(args.out))
    _print_summary(result, args.out)
    return 0


def _print_summary(result: dict, out) -> None:
    print(f"{result['config']['questions']} questions -> {out}/results.json, report.md, accuracy_latency.png")
    print(f"{'method':26s} {'accuracy':>8s} {'EM':>6s} {'latency s':>9s} {'draft s':>8s} {'verify s':>8s}")
    for s in result["summary"]:
        print(f"{s['method']:26s} {s['accuracy']:8.1f} {s['exact_match']:6.1f} {s['latency_s']:9.2f} "
              f"{s['draft_s']:8.2f} {s['verify_s']:8.2f}")
