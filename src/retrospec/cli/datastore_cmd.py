"""``retrospec datastore build|info|eval``: retrieval datastores for ``rest`` (suffix) and ``dresd`` (dense)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RetrospecError

KEYS = ("completions", "all")  # the first is the default


def _generation_args(p, what: str) -> None:
    """``--from-generations`` (``what`` the target's greedy replies become), its length and ``--chat``."""
    p.add_argument("--from-generations", metavar="PROMPTS.jsonl", help=what)
    p.add_argument("--gen-max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--chat", action="store_true",
                   help="with --from-generations: each prompt is one user message under the target's chat template")


def add_parser(sub) -> None:
    p = sub.add_parser("datastore", help="build, describe or evaluate retrieval datastores (rest, dresd)")
    dsub = p.add_subparsers(dest="datastore_command", required=True, parser_class=type(p))

    b = dsub.add_parser("build", help="build a suffix (rest) or dense (dresd) datastore, atomically")
    b.add_argument("--kind", required=True, choices=("suffix", "dense"))
    b.add_argument("--out", required=True, help="store directory to create")
    b.add_argument("--target", help="target model directory or name (default: zoo); its tokenizer (and, "
                                    "for dense, its hidden states) define the store")
    b.add_argument("--corpus", help="text file, .jsonl (text | prompt+completion), directory, 'stdlib' "
                                    "(zoo training split) or 'stdlib:heldout'")
    _generation_args(b, "in-distribution store: the target's own greedy outputs on these prompts (saved in the "
                        "store as generations.jsonl; passing that file again reuses them)")
    b.add_argument("--max-tokens", type=int, default=None, help="use at most N corpus tokens")
    b.add_argument("--keys", choices=KEYS, default=None,
                   help="dense: the positions of prompt + completion rows that become keys: 'completions' (the "
                        "default: where the drafts start in a completion, as decoding's do; about half the store "
                        "on chat and code corpora, the same tau) or 'all'")
    b.add_argument("--value-len", type=int, default=20, help="dense: tokens stored after each key (default 20)")
    b.add_argument("--pca-dims", type=int, default=64, help="dense: PCA dimensions, 0 = no PCA (default 64)")
    b.add_argument("--pca-sample", type=int, default=1_000_000, help="dense: positions the z-norm/PCA are fit on")
    b.add_argument("--index", default="auto", choices=("auto", "flat", "hnsw", "ivf"),
                   help="dense: FAISS index (auto: exact up to 100k entries, HNSW above)")
    b.add_argument("--window", type=int, default=512, help="dense: tokens per forward window (default 512)")
    b.add_argument("--batch-tokens", type=int, default=8192, help="dense: tokens per forward batch")
    b.add_argument("--memory-budget-mb", type=int, default=2048,
                   help="dense: hidden states larger than this are memory-mapped on disk (default 2048)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=0, help="torch threads for the forward passes (0 = default)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    from .generate_cmd import add_device_args

    add_device_args(b)
    b.set_defaults(func=run_build)

    i = dsub.add_parser("info", help="describe a datastore")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="print meta.json")
    i.set_defaults(func=run_info)

    e = dsub.add_parser("eval", help="intrinsic quality on held-out text (dense: MRR; suffix: hit rate) and the "
                                     "tau a greedy decode would reach on it; prompt + completion rows are scored "
                                     "on their completions")
    e.add_argument("dir")
    e.add_argument("--corpus", help="held-out corpus (same forms as build), e.g. stdlib:heldout or "
                                    "'corpus export --heldout-records'")
    _generation_args(e, "held-out prompts: score the target's own greedy replies to them (then decode_tau is an "
                        "ungated greedy bench's tau on these prompts at --gen-max-new-tokens; every prompt is "
                        "decoded, --max-tokens caps what is scored)")
    e.add_argument("--walk-docs", type=int, default=64,
                   help="documents walked as a greedy decode for decode_tau (default 64)")
    e.add_argument("--num-drafts", type=int, default=3,
                   help="drafts per step of the drafter scored (1-64; default 3, the greedy default of rest and dresd)")
    e.add_argument("--draft-len", type=int, default=20,
                   help="tokens per draft (1-64; default 20; dense: at most the store's value length)")
    e.add_argument("--target", help="target model directory (default: the store's target, else the zoo target)")
    e.add_argument("--max-tokens", type=int, default=50_000, help="held-out tokens to read (default 50000)")
    e.add_argument("--max-queries", type=int, default=1000)
    e.add_argument("--k", type=int, default=10, help="dense: neighbours for MRR@k")
    e.add_argument("--match-len", type=int, default=4, help="dense: tokens that must match for relevance")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=0, help="torch threads for the forward passes (0 = default)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=run_eval)


def _check(args, names: tuple[str, ...]) -> None:
    """Refuse an option of ``names`` below 1 and a negative ``--threads``; apply ``--threads``."""
    import torch

    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise RetrospecError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.threads < 0:
        raise RetrospecError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)


def _load_target(path, **load):
    """The target (``--target``, else the default); ``load``: ``load_model``'s device and dtype."""
    from ..models import default_target, load_model

    return load_model(default_target() if path is None else path, role="target", **load)


def _eos_id(target) -> int:
    tok_eos = getattr(target.tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        return tok_eos
    ids = sorted(target.eos_ids())
    if not ids:
        raise RetrospecError(f"target {target.path} defines no EOS token (needed as the document separator)")
    return ids[0]


def _documents(corpus: str | None, target, max_tokens: int | None, completions: bool = False):
    """Token documents of ``--corpus``; with ``completions``, prompt + completion rows keep where their completion
    starts (``TokenDoc.index_from``: eval scores there, a dense build keys only the positions whose drafts start
    there), else every position is a document's own."""
    from ..retrieval.corpus import limit_tokens, open_text_corpus, tokenize

    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer; a text corpus cannot be encoded")
    text = open_text_corpus(corpus)
    docs = tokenize(text.split() if completions else text, target.tokenizer, total=len(text))
    return limit_tokens(docs, max_tokens), text.description


def run_build(args) -> int:
    import itertools

    from ..retrieval import build_dense_store, build_suffix_store
    from ..corpus.documents import GENERATIONS_FILE, generation_documents, save_generations
    from ..retrieval.corpus import limit_tokens
    from ..retrieval.store import target_meta, tokenizer_meta

    if not args.corpus and not args.from_generations:
        raise RetrospecError("give --corpus PATH|stdlib and/or --from-generations PROMPTS.jsonl")
    if args.chat and not args.from_generations:
        raise RetrospecError("--chat applies to --from-generations prompts")
    if args.pca_dims < 0:
        raise RetrospecError(f"--pca-dims must be >= 0, got {args.pca_dims}")
    if args.keys is not None and args.kind != "dense":
        raise RetrospecError("--keys applies to dense stores (a suffix store holds every token: matches need the "
                             "context before a completion)")
    keys = args.keys or KEYS[0]
    _check(args, ("max_tokens", "value_len", "pca_sample", "window", "batch_tokens", "memory_budget_mb",
                  "gen_max_new_tokens"))
    out = Path(args.out)
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise RetrospecError(f"{out} already exists; choose another --out or pass --overwrite")
    from .generate_cmd import device_kwargs

    target = _load_target(args.target, **device_kwargs(args))
    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer files")
    sources, parts, extra = [], [], {}
    if args.from_generations:
        gdocs, rows, gdesc = generation_documents(args.from_generations, target,
                                                  max_new_tokens=args.gen_max_new_tokens, chat=args.chat)
        sources.append(gdocs)
        parts.append(gdesc)
        extra[GENERATIONS_FILE] = lambda path: save_generations(rows, path)  # reusable by the next ID build
    if args.corpus:
        docs, desc = _documents(args.corpus, target, None, completions=args.kind == "dense" and keys == KEYS[0])
        sources.append(docs)
        parts.append(desc)
    docs = limit_tokens(itertools.chain(*sources), args.max_tokens)
    corpus = {"description": "; ".join(parts), "corpus": args.corpus, "from_generations": args.from_generations,
              "distribution": "ID (target generations)" if args.from_generations and not args.corpus else
              ("OOD (raw text)" if not args.from_generations else "mixed"), "max_tokens": args.max_tokens}
    if args.kind == "dense":
        corpus["keys"] = keys
    tok = tokenizer_meta(target.tokenizer, target.vocab_size, _eos_id(target), source=target.path)
    if args.kind == "suffix":
        meta = build_suffix_store(docs, out, tokenizer_info=tok, corpus=corpus, target_info={"path": target.path},
                                  overwrite=args.overwrite, extra_files=extra)
    else:
        meta = build_dense_store(target.model, docs, out, tokenizer_info=tok,
                                 target_info=target_meta(target.model, target.path), corpus=corpus,
                                 value_len=args.value_len, pca_dims=args.pca_dims, pca_sample=args.pca_sample,
                                 index=args.index, window=args.window, batch_tokens=args.batch_tokens,
                                 memory_budget_mb=args.memory_budget_mb, seed=args.seed, overwrite=args.overwrite,
                                 extra_files=extra)
    print(summary(out, meta))
    return 0


def summary(path, meta: dict) -> str:
    c, p, b = meta.get("counts", {}), meta.get("params", {}), meta.get("build", {})
    size = sum((meta.get("files") or {}).values())
    built = (f"  size {size / 2**20:.1f} MiB; built {b.get('created')} in {b.get('seconds')} s, "
             f"peak RSS {b.get('peak_rss_mb')} MiB")
    if meta["kind"] == "rag":  # Speculative RAG passage index (retrospec rag index)
        e = meta.get("embedder") or {}
        return "\n".join([
            f"{path}: RAG passage index (retrospec rag)",
            f"  passages {c.get('passages', 0):,} from {p.get('source')}; embedder {e.get('name')} "
            f"({e.get('dim')}-d, fingerprint {e.get('fingerprint')}); exact inner-product index", built])
    from ..drafters.registry import SPECS

    users = ", ".join(s.name for s in SPECS.values() if s.store == meta["kind"])
    lines = [f"{path}: {meta['kind']} datastore ({users})"]
    if meta["kind"] == "suffix":
        lines.append(f"  tokens {c.get('tokens', 0):,} in {c.get('documents', 0):,} documents")
    else:
        idx, t = p.get("index"), meta.get("target") or {}
        extra = {"hnsw": f"M={p.get('M')}, efSearch={p.get('ef_search')}",
                 "ivf": f"nlist={p.get('nlist')}, nprobe={p.get('nprobe')}"}.get(idx, "exact")
        keyed = (meta.get("corpus") or {}).get("keys")
        keyed = f" ({keyed} of prompt + completion rows)" if keyed else ""
        lines += [f"  entries {c.get('entries', 0):,} from {c.get('documents', 0):,} documents{keyed}; keys "
                  f"{p.get('key_dim')}-d (PCA {p.get('pca_dims') or 'off'}, fit on {p.get('pca_sample', 0):,}); "
                  f"values 1 + {p.get('value_len')} tokens; index {idx} ({extra})",
                  f"  target {t.get('path')} (fingerprint {t.get('fingerprint')}, layer {t.get('layer')}, "
                  f"hidden {t.get('hidden_size')})"]
    tk = meta.get("tokenizer") or {}
    lines += [f"  tokenizer {tk.get('fingerprint')} (vocab {tk.get('vocab_size')}, eos {tk.get('eos_id')})",
              f"  corpus: {(meta.get('corpus') or {}).get('description', '?')}", built]
    return "\n".join(lines)


def run_info(args) -> int:
    from ..retrieval import load_meta

    meta = load_meta(args.dir)
    print(json.dumps(meta, indent=2) if args.json else summary(args.dir, meta))
    return 0


def run_eval(args) -> int:
    from ..retrieval import load_meta, open_store
    from ..bench.datastore_eval import eval_dense, eval_suffix
    from ..drafters.registry import MAX_DRAFT

    _check(args, ("max_tokens", "max_queries", "k", "match_len", "gen_max_new_tokens", "walk_docs", "num_drafts",
                  "draft_len"))
    for name in ("num_drafts", "draft_len"):  # the bounds rest and dresd decode with
        if getattr(args, name) > MAX_DRAFT:
            raise RetrospecError(f"--{name.replace('_', '-')} must be <= {MAX_DRAFT}, got {getattr(args, name)}")
    if (args.corpus is None) == (args.from_generations is None):
        raise RetrospecError("give one held-out source: --corpus PATH|stdlib:heldout or --from-generations "
                             "PROMPTS.jsonl")
    if args.chat and not args.from_generations:
        raise RetrospecError("--chat applies to --from-generations prompts")
    meta = load_meta(args.dir)
    recorded = (meta.get("target") or {}).get("path") or (meta.get("tokenizer") or {}).get("source")
    if args.target is None and recorded:
        from ..models.named import lookup

        if Path(recorded).is_dir() or lookup(recorded) is not None:  # a directory, or a named model's name
            args.target = recorded
    target = _load_target(args.target)
    store = open_store(args.dir, meta["kind"], target=target)
    if args.from_generations:
        from ..corpus.documents import as_decoded, generation_documents
        from ..retrieval.corpus import limit_tokens

        gdocs, rows, desc = generation_documents(args.from_generations, target,
                                                 max_new_tokens=args.gen_max_new_tokens, chat=args.chat)
        docs = limit_tokens(as_decoded(gdocs, rows), args.max_tokens)
        max_new = args.gen_max_new_tokens
    else:
        docs, desc = _documents(args.corpus, target, args.max_tokens, completions=True)
        max_new = None
    if not (docs := list(docs)):
        raise RetrospecError(f"held-out source {args.corpus or args.from_generations} has no tokens")
    if meta["kind"] == "suffix":
        res = eval_suffix(store, docs, max_queries=args.max_queries, seed=args.seed, walk_docs=args.walk_docs,
                          max_new=max_new, num_drafts=args.num_drafts, draft_len=args.draft_len)
    else:
        if args.match_len > store.value_len + 1:
            raise RetrospecError(f"--match-len must be <= {store.value_len + 1} for this store")
        res = eval_dense(store, target.model, docs, max_queries=args.max_queries, k=args.k, match_len=args.match_len,
                         seed=args.seed, walk_docs=args.walk_docs, max_new=max_new, num_drafts=args.num_drafts,
                         draft_len=args.draft_len)
    scored = "completions" if any(d.index_from for d in docs) else "every position"
    res = {"datastore": str(args.dir), "kind": meta["kind"], "heldout": desc, "scored": scored} | res
    if args.json:
        print(json.dumps(res))
    else:
        for key, v in res.items():
            print(f"{key}: {v:.4f}" if isinstance(v, float) else f"{key}: {v}")
    return 0
