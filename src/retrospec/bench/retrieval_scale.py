"""Scale measurements for the retrieval datastores (``python -m retrospec.bench.retrieval_scale``).

``suffix``: builds a REST store over a large token corpus and times its lookups. The corpus is the token stream
of an existing suffix store (``--base``, e.g. one built from ``--corpus stdlib``), repeated until ``--tokens`` is
reached; every copy after the first has ``--perturb`` of its tokens replaced by draws from the corpus' unigram
distribution, so copies are not verbatim duplicates (a synthetic corpus: say so when reporting). Queries are
contexts from held-out documents (``--queries-from``, default the stdlib held-out split), encoded with the
tokenizer of ``--target``. Reports build time, peak RSS, and search / lookup latency percentiles (wall and CPU).

The dense (DReSD) side is measured by ``retrospec datastore eval`` (``bench.datastore_eval``), the same
job (it reports the same percentiles); this module covers the suffix side only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def synthetic_docs(base_tokens: np.ndarray, total: int, perturb: float, seed: int, eos_id: int):
    """Yield copies of ``base_tokens`` (perturbed after the first) until ``total`` tokens; EOS-split documents."""
    from ..retrieval.corpus import TokenDoc

    rng = np.random.default_rng(seed)
    made, copy = 0, 0
    while made < total:
        toks = base_tokens.copy()
        if copy:
            mask = rng.random(len(toks)) < perturb
            toks[mask] = rng.choice(base_tokens, size=int(mask.sum()))  # unigram draws
        cuts = np.flatnonzero(toks == eos_id)
        start = 0
        for end in list(cuts) + [len(toks)]:
            if end > start:
                piece = toks[start:end][: total - made]
                yield TokenDoc(piece.astype(np.int32))
                made += len(piece) + 1
                if made >= total:
                    return
            start = end + 1
        copy += 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="REST suffix-store scale test")
    ap.add_argument("--base", required=True, help="an existing suffix store whose tokens seed the corpus")
    ap.add_argument("--out", required=True, help="where to build the large store")
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--perturb", type=float, default=0.1)
    ap.add_argument("--target", default=None, help="tokenizer source (default: zoo target)")
    ap.add_argument("--queries-from", default="stdlib:heldout")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="skip the build when --out exists")
    args = ap.parse_args(argv)

    from ..models import default_target, load_model
    from ..retrieval import build_suffix_store, load_meta, open_store
    from ..retrieval.corpus import limit_tokens, open_text_corpus, tokenize
    from .datastore_eval import eval_suffix
    from ..retrieval.suffix_array import TOKEN_DTYPE, TOKENS_FILE

    base_meta = load_meta(args.base, kind="suffix")
    eos = int(base_meta["tokenizer"]["eos_id"])
    base = np.fromfile(Path(args.base) / TOKENS_FILE, dtype=TOKEN_DTYPE).astype(np.int32)
    out = Path(args.out)
    if not (args.reuse and out.exists()):
        corpus = {"description": f"SYNTHETIC: {args.base} token stream ({len(base):,} tokens) repeated to "
                                 f"{args.tokens:,} tokens, {args.perturb:.0%} of each later copy's tokens replaced "
                                 f"by unigram draws (seed {args.seed})"}
        build_suffix_store(synthetic_docs(base, args.tokens, args.perturb, args.seed, eos), out,
                           tokenizer_info=base_meta["tokenizer"], corpus=corpus, overwrite=True)
    meta = load_meta(out)
    target = load_model(default_target() if args.target is None else args.target)
    store = open_store(out, "suffix", target=target)
    text = open_text_corpus(args.queries_from)
    docs = list(limit_tokens(tokenize(text, target.tokenizer, total=len(text), progress=False), 200_000))
    res = eval_suffix(store, docs, max_queries=args.queries, seed=args.seed)
    report = {"store": str(out), "tokens": meta["counts"]["tokens"], "build_seconds": meta["build"]["seconds"],
              "build_peak_rss_mb": meta["build"]["peak_rss_mb"],
              "store_mib": round(sum(meta["files"].values()) / 2**20, 1), "corpus": meta["corpus"]["description"],
              "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")} | res
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
