"""Intrinsic evaluation of a datastore on held-out documents (``retrospec datastore eval``).

Query positions t are sampled (seeded) from the held-out documents; the truth at t is the sequence that really
followed, x_{t+1}, x_{t+2}, ... In prompt + completion documents (``corpus export``) only the completions are
scored: what the target wrote, which is what a drafter meets while decoding.

- dense (DReSD's intrinsic metric): the store is searched with the target's hidden state h_t. MRR@k over the k
  nearest neighbours, where a neighbour is relevant when its stored sequence starts with the true next
  ``match_len`` tokens (reported for match_len = 1, the next token, and for the requested length).
- suffix (REST): hit rate (some suffix of >= 2 tokens of the context occurs in the corpus) and mean match length
  (the length of the longest matching suffix, over hits).
- both: the drafts a drafter would propose (``num_drafts x draft_len`` nodes; default the greedy 3 x 20), scored
  against the truth:
  ``top1_prefix`` = tokens of the truth reproduced by the first draft, ``tree_prefix`` = tokens of the truth
  reproduced along the draft tree (what greedy verification would accept at that position);
- both: ``decode_tau``, the tokens a greedy decode gains per target step when the target writes these documents:
  up to ``walk_docs`` documents (seeded) are walked as decoding walks them, from the last prompt token (the root of
  decoding's first step), one drafter step at a time (the drafter itself, the same shape, ungated; with
  ``max_new``, cut as the decode loop cuts it: no deeper than the tokens left), each step accepting the tree's
  longest path along the text plus the target's own token. On the target's own greedy replies with their stop
  tokens (``--from-generations``) it is the tau of an ungated greedy bench of the same prompts and length, up to
  the hidden states' rounding; ``tree_prefix`` counts every position once, ``decode_tau`` only those a decode
  meets (after an accepted draft it skips ahead);
- both: ``ceiling_tau``, the same walks with each step drafting, of every continuation the drafter retrieved there
  (REST: its sampled occurrences; DReSD: its neighbours that passed the token filter), the one that matches the
  text longest. At a step no tree built from those continuations, whatever its ranking or node budget, accepts
  more than that path, so ``ceiling_tau`` is what re-ranking the same retrieval can reach (over a walk, up to
  where the steps land); beyond it takes a store whose contents recur in the text, or more neighbours searched;
- latency, p50 / p99 in milliseconds, wall clock and thread CPU time: ``search`` (suffix: longest-suffix search;
  dense: transform + FAISS search) and ``lookup`` (the drafter's whole step: search, continuations / filtering,
  tree), the target forward excluded.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..config import SamplingConfig
from ..decode import draft_room
from ..drafters.base import DecodeContext
from ..drafters.dresd import DresdDrafter
from ..drafters.rest import RestDrafter, check_shape
from ..retrieval.corpus import TokenDoc
from ..retrieval.dense_index import _encode, _key_range
from ..tree import frequency_trie, within_depth
from ..types import DraftTree


def _tree_prefix(tree, truth: list[int]) -> int:
    """Number of truth tokens matched walking down a DraftTree from the root."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    node, n = -1, 0
    for want in truth:
        nxt = next((i for i in range(len(toks)) if pars[i] == node and toks[i] == want), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _sample_positions(docs: list[TokenDoc], n: int, seed: int, min_ctx: int, known: int) -> list[tuple[int, int]]:
    """(doc, t) pairs with at least ``min_ctx`` tokens up to t and one token after it, and, in a document with a
    completion (``index_from`` > 0), every token to guess inside it, its first one included (decoding's first step
    drafts it, below the last prompt token): a store is scored where decoding uses it. ``known``: tokens after t the
    drafter is given (suffix 0: it guesses from x_{t+1}; dense 1: x_{t+1} filters, it guesses from x_{t+2})."""
    cands = [(d, t) for d, doc in enumerate(docs)
             for t in range(max(min_ctx - 1, doc.index_from - 1 - known), len(doc.ids) - 1)]
    if not cands:
        return []
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(cands), size=min(n, len(cands)), replace=False)
    return [cands[i] for i in sorted(pick)]


WALK_BUDGET = 60  # nodes a step: the greedy defaults' 3 x 20 tree, as an ungated bench drafts


def _walk_start(doc: TokenDoc) -> int:
    """The last committed token when a walk starts: the last prompt token (decoding's first step drafts below it;
    a document without a prompt starts from its first token)."""
    return max(doc.index_from - 1, 0)


def _walked(docs: list[TokenDoc], n: int, seed: int) -> list[int]:
    """Up to ``n`` documents to walk (a seeded choice, in corpus order): those with a token after ``_walk_start``."""
    cands = [d for d, doc in enumerate(docs) if len(doc.ids) - 1 > _walk_start(doc)]
    if len(cands) <= n:
        return cands
    return sorted(np.random.default_rng(seed).choice(cands, size=n, replace=False).tolist())


def _walk(ids: list[int], start: int, propose, max_new: int | None = None, budget: int = WALK_BUDGET
          ) -> tuple[int, int]:
    """(steps, tokens) of a greedy decode that has committed ``ids[: start + 1]`` and whose target writes the rest:
    per step ``propose(pos, budget)`` drafts a tree of at most ``budget`` nodes below ``ids[pos]`` (with ``max_new``,
    cut to the decode loop's depth: the new tokens left less the target's own), which accepts its longest path
    along the text and the target's next token (the last step takes what is left; with ``max_new`` the walk ends
    after that many tokens, as decoding does)."""
    steps = tokens = 0
    pos = start
    while pos < len(ids) - 1 and (max_new is None or pos - start < max_new):
        depth = None if max_new is None else draft_room(max_new, pos - start, 1 << 30)[1]
        tree = within_depth(propose(pos, budget), depth) if depth != 0 else DraftTree.empty()
        left = len(ids) - 1 - pos if max_new is None else min(len(ids) - 1 - pos, max_new - (pos - start))
        gained = min(_tree_prefix(tree, ids[pos + 1 : pos + 1 + budget]), left - 1) + 1
        steps, tokens, pos = steps + 1, tokens + gained, pos + gained
    return steps, tokens


def _walks(docs: list[TokenDoc], walked: list[int], proposer, max_new: int | None,
           budget: int = WALK_BUDGET) -> list[tuple[int, int]]:
    """``_walk`` of each walked document; ``proposer(d, ids)`` gives its ``propose``."""
    out = []
    for d in walked:
        ids = docs[d].ids.tolist()
        out.append(_walk(ids, _walk_start(docs[d]), proposer(d, ids), max_new, budget))
    return out


def _walk_summary(walked: list[int], walks: list[tuple[int, int]], name: str = "decode") -> dict:
    """Walks' totals; ``decode_tau`` = tokens / steps, as the bench's tau is new tokens / target calls."""
    steps, tokens = sum(s for s, _ in walks), sum(t for _, t in walks)
    out = {f"{name}_steps": steps, f"{name}_tau": tokens / steps if steps else 0.0}
    return {"walked_documents": len(walked)} | out if name == "decode" else out


def _best_chain(rows: np.ndarray, truth: list[int]) -> DraftTree:
    """The one row of ``rows`` [M, L] (-1 padded) that reproduces ``truth`` longest, as a chain: the path any tree
    built from these rows (whatever its ranking or node budget) could at best accept along the text."""
    if not len(rows):
        return DraftTree.empty()
    want = np.full(rows.shape[1], -2, dtype=np.int64)
    want[: min(len(truth), rows.shape[1])] = truth[: rows.shape[1]]
    matched = np.cumprod(rows == want, axis=1).sum(1)  # [M] prefix each row reproduces
    best = rows[int(matched.argmax())]
    return DraftTree.chain([int(t) for t in best if t >= 0])


def _ceiling(docs: list[TokenDoc], walked: list[int], candidates, max_new: int | None, budget: int) -> dict:
    """``ceiling_tau``: the walks again, each step drafting ``_best_chain`` of the continuations the drafter
    retrieved there (``candidates(d, ids, pos)`` -> [M, L]): at each step, what no ranking of them exceeds."""
    def proposer(d: int, ids: list[int]):
        return lambda pos, _budget: _best_chain(candidates(d, ids, pos), ids[pos + 1 : pos + 1 + budget])

    return _walk_summary(walked, _walks(docs, walked, proposer, max_new, budget), "ceiling")


class Timer:
    """Wall-clock and thread-CPU milliseconds per timed call (CPU time is the cost without waiting for a core,
    which matters on a shared machine)."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc):
        self.wall.append((time.perf_counter() - self._w) * 1000)
        self.cpu.append((time.thread_time() - self._c) * 1000)

    def summary(self, name: str) -> dict:
        if not self.wall:
            return {}
        w, c = np.asarray(self.wall), np.asarray(self.cpu)
        return {f"{name}_p50_ms": float(np.percentile(w, 50)), f"{name}_p99_ms": float(np.percentile(w, 99)),
                f"{name}_cpu_p50_ms": float(np.percentile(c, 50)), f"{name}_cpu_p99_ms": float(np.percentile(c, 99))}


def eval_suffix(store, docs: list[TokenDoc], *, max_queries: int = 1000, seed: int = 0, walk_docs: int = 64,
                max_new: int | None = None, num_drafts: int = 3, draft_len: int = 20) -> dict:

    check_shape(num_drafts, draft_len)
    queries = _sample_positions(docs, max_queries, seed, min_ctx=2, known=0)
    hits, lengths, top1, tree_acc = 0, [], [], []
    search_t, lookup_t = Timer(), Timer()
    for d, t in queries:
        ids = docs[d].ids
        ctx = ids[max(0, t - 15) : t + 1].tolist()
        truth = ids[t + 1 : t + 1 + draft_len].tolist()
        with search_t:
            store.search(ctx)
        with lookup_t:  # what the rest drafter does per step
            match = store.search(ctx)
            tree = None
            if match is not None:
                tree = frequency_trie(store.sample(match, draft_len), None, num_drafts * draft_len, presorted=True)
        if match is None:
            top1.append(0)
            tree_acc.append(0)
            continue
        hits += 1
        lengths.append(match.length)
        seqs, _ = store.continuations(match, draft_len)
        top1.append(_prefix([x for x in seqs[0].tolist() if x >= 0], truth) if len(seqs) else 0)
        tree_acc.append(_tree_prefix(tree, truth))
    n = len(queries)
    drafter = RestDrafter(store, num_drafts=num_drafts, draft_len=draft_len)
    ctx = DecodeContext(tokens=[], prompt_len=0, sampling=SamplingConfig())
    drafter.prefill(ctx)

    def proposer(d: int, ids: list[int]):
        def propose(pos: int, budget: int):
            ctx.tokens = ids[: pos + 1]
            return drafter.propose(ctx, budget)
        return propose

    def candidates(d: int, ids: list[int], pos: int) -> np.ndarray:
        return drafter.continuations(ids[: pos + 1])

    walked = _walked(docs, walk_docs, seed)
    walks = _walks(docs, walked, proposer, max_new, num_drafts * draft_len)
    ceiling = _ceiling(docs, walked, candidates, max_new, num_drafts * draft_len)
    return {"queries": n, "num_drafts": num_drafts, "draft_len": draft_len, "hit_rate": hits / n if n else 0.0,
            "mean_match_length": float(np.mean(lengths)) if lengths else 0.0,
            "top1_prefix": float(np.mean(top1)) if n else 0.0, "tree_prefix": float(np.mean(tree_acc)) if n else 0.0,
            } | _walk_summary(walked, walks) | ceiling | search_t.summary("search") | lookup_t.summary("lookup")


def eval_dense(store, model: torch.nn.Module, docs: list[TokenDoc], *, max_queries: int = 1000, k: int = 10,
               match_len: int = 4, seed: int = 0, batch_tokens: int = 8192, progress: bool = True,
               walk_docs: int = 64, max_new: int | None = None, num_drafts: int = 3, draft_len: int = 20) -> dict:

    check_shape(num_drafts, draft_len)
    params = store.meta["params"]
    queries = _sample_positions(docs, max_queries, seed, min_ctx=1, known=1)
    walked = _walked(docs, walk_docs, seed)
    if not queries:
        return {"queries": 0}
    used = sorted({d for d, _ in queries} | set(walked))
    sub = [TokenDoc(docs[d].ids) for d in used]
    sizes = [max(0, hi - lo) for lo, hi in map(_key_range, sub)]
    bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    hidden = np.empty((int(bases[-1]), int(model.config.hidden_size)), dtype=np.float32)  # [positions, H]
    _encode(model, sub, bases[:-1].tolist(), hidden, window=params.get("window", 512),
            overlap=params.get("overlap", 128), batch_tokens=batch_tokens, pad_id=store.eos_id, progress=progress)
    row_of = {d: int(b) for d, b in zip(used, bases[:-1])}
    drafter = DresdDrafter(store, num_drafts=num_drafts, draft_len=draft_len)
    drafter.prefill(DecodeContext(tokens=[], prompt_len=0, sampling=SamplingConfig()))
    budget = num_drafts * draft_len
    rr1, rrn, top1, tree_acc = [], [], [], []
    search_t, lookup_t = Timer(), Timer()
    for d, t in queries:
        ids = docs[d].ids
        h = hidden[row_of[d] + t]  # [H] (key range starts at 0 for these documents)
        truth = ids[t + 1 : t + 1 + store.value_len + 1].tolist()
        truth = truth + [store.eos_id] * (store.value_len + 1 - len(truth))  # [1 + N], EOS-padded like values
        with search_t:  # transform + FAISS search
            _, nn = store.search(h[None], k)
        vals = np.asarray(store.values[nn[0][nn[0] >= 0]])  # [k, 1 + N]
        rank1 = np.flatnonzero(vals[:, 0] == truth[0])
        rankn = np.flatnonzero((vals[:, :match_len] == np.asarray(truth[:match_len])).all(1))
        rr1.append(1.0 / (rank1[0] + 1) if rank1.size else 0.0)
        rrn.append(1.0 / (rankn[0] + 1) if rankn.size else 0.0)
        with lookup_t:  # what the dresd drafter does per step
            rows = drafter.continuations(h, truth[0])  # [M, L] in similarity order
            tree = drafter.tree(rows, budget)
        top1.append(_prefix([x for x in rows[0].tolist() if x >= 0], truth[1:]) if len(rows) else 0)
        tree_acc.append(_tree_prefix(tree, truth[1:]))
    def proposer(d: int, ids: list[int]):
        def propose(pos: int, budget: int):  # searched with the hidden state that produced ids[pos]
            if pos == 0:  # no state produced the first token: decoding hands the drafter none
                return DraftTree.empty()
            return drafter.tree(drafter.continuations(hidden[row_of[d] + pos - 1], ids[pos]), budget)
        return propose

    def candidates(d: int, ids: list[int], pos: int) -> np.ndarray:
        if pos == 0:  # no state produced the first token: no retrieval
            return np.zeros((0, 1), np.int64)
        return drafter.continuations(hidden[row_of[d] + pos - 1], ids[pos])

    walks = _walks(docs, walked, proposer, max_new, budget)
    ceiling = _ceiling(docs, walked, candidates, max_new, budget)
    return {"queries": len(queries), "num_drafts": num_drafts, "draft_len": min(draft_len, store.value_len), "k": k,
            "match_len": match_len, "mrr_next_token": float(np.mean(rr1)),
            f"mrr_{match_len}_tokens": float(np.mean(rrn)), "top1_prefix": float(np.mean(top1)),
            "tree_prefix": float(np.mean(tree_acc))} | _walk_summary(walked, walks) | ceiling \
        | search_t.summary("search") | lookup_t.summary("lookup")
