"""Multi-perspective sampling of retrieved passages for Speculative RAG (Wang et al., "Speculative RAG: Enhancing
Retrieval Augmented Generation through Drafting", ICLR 2025, Sec. 3.2).

The paper embeds each retrieved document with the question as the instruction (InBedder), clusters the embeddings
into k groups (k-means) and forms m subsets by drawing one document from each cluster, so every draft sees k
different perspectives with little redundancy. Our stand-in for instruction-aware embedding is the sentence
embedder applied to ``"Question: {question}\\nDocument: {passage}"`` (``doc_embeddings``): the question shifts
every document vector the same way, so clusters still group documents by content, conditioned on the question.

Two ablations of the paper are here too: ``random_subsets`` (k random documents, no clustering) and
``same_cluster_subsets`` (all k documents of a subset from one cluster).

Invariants (all strategies):
- A subset is a tuple of indices into the retrieved list, sorted ascending (= retrieval rank order).
- The m subsets are distinct (sampling without replacement); when fewer than m distinct subsets exist, all of them
  are returned (``clustered`` and ``random`` in a fixed enumeration order).
- The number of clusters is clipped to n and to the number of distinct embedding rows, so no cluster is empty.
- The result depends only on the inputs and the ``numpy.random.Generator`` state (``make_subsets``: on ``seed``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import comb, prod

import numpy as np

from ..errors import RetrospecError
from ..retrieval.embedder import Embedder
from .data import Passage

STRATEGIES = ("clustered", "random", "same-cluster")
Subset = tuple[int, ...]


def doc_embeddings(embedder: Embedder, question: str, passages: Sequence[Passage]) -> np.ndarray:
    """Question-conditioned document embeddings, float32 ``[n, d]`` (our stand-in for InBedder)."""
    if not passages:
        raise RetrospecError("no retrieved passages to embed")
    texts = [f"Question: {question}\nDocument: {p.as_text()}" for p in passages]
    return np.asarray(embedder.encode(texts), dtype=np.float32)  # [n, d]


def _check(n: int, k: int, m: int) -> None:
    if n < 1:
        raise RetrospecError("no documents to sample subsets from (n = 0)")
    if k < 1:
        raise RetrospecError(f"documents per subset k must be >= 1, got {k}")
    if m < 1:
        raise RetrospecError(f"number of subsets m must be >= 1, got {m}")


def _matrix(emb: np.ndarray) -> np.ndarray:
    emb = np.asarray(emb, dtype=np.float32)  # [n, d]
    if emb.ndim != 2:
        raise RetrospecError(f"document embeddings must be a 2-D array [n, d], got shape {emb.shape}")
    if not np.isfinite(emb).all():
        raise RetrospecError("document embeddings contain NaN or infinite values")
    return emb


def clusters(emb: np.ndarray, k: int, rng: np.random.Generator) -> list[list[int]]:
    """k-means groups of document indices: each group sorted ascending, groups ordered by their first member.

    k is clipped to the number of documents and of distinct rows, so every group is non-empty."""
    emb = _matrix(emb)  # [n, d]
    n = emb.shape[0]
    seed = int(rng.integers(2**31 - 1))  # drawn even when unused, so later draws do not depend on the clipping
    k = min(k, n, int(np.unique(emb, axis=0).shape[0]))
    if k <= 1:
        labels = np.zeros(n, dtype=np.int64)  # [n]
    else:
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(emb)  # [n]
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        groups.setdefault(int(label), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _ranks(total: int, m: int, r: random.Random) -> list[int]:
    """min(m, total) distinct integers in [0, total): all of them in order when total <= m, else a uniform sample
    without replacement in draw order (Python ints, so totals beyond 64 bits work)."""
    if total <= m:
        return list(range(total))
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < m:
        x = r.randrange(total)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _unrank_combination(rank: int, n: int, k: int) -> Subset:
    """The ``rank``-th k-subset of range(n) in lexicographic order."""
    out, x = [], 0
    for i in range(k):
        while (c := comb(n - x - 1, k - i - 1)) <= rank:
            rank -= c
            x += 1
        out.append(x)
        x += 1
    return tuple(out)


def _py_random(rng: np.random.Generator) -> random.Random:
    return random.Random(int(rng.integers(2**63 - 1)))


def clustered_subsets(emb: np.ndarray, k: int, m: int, rng: np.random.Generator) -> list[Subset]:
    """The paper's sampling: k-means into k clusters, then m distinct subsets with one document from each."""
    _check(len(emb), k, m)
    groups = clusters(emb, k, rng)
    out = []
    for rank in _ranks(prod(len(g) for g in groups), m, _py_random(rng)):
        picked = []  # the rank's mixed-radix digits pick one member per cluster
        for g in groups:
            rank, j = divmod(rank, len(g))
            picked.append(g[j])
        out.append(tuple(sorted(picked)))
    return out


def random_subsets(n: int, k: int, m: int, rng: np.random.Generator) -> list[Subset]:
    """Ablation: m distinct random k-subsets of range(n), no clustering (k clipped to n)."""
    _check(n, k, m)
    k = min(k, n)
    return [_unrank_combination(rank, n, k) for rank in _ranks(comb(n, k), m, _py_random(rng))]


def same_cluster_subsets(emb: np.ndarray, k: int, m: int, rng: np.random.Generator) -> list[Subset]:
    """Ablation: every subset's documents come from one k-means cluster (k clusters, as in ``clustered``).

    Each draw picks uniformly among clusters that still have unused subsets, then a uniform unused k-subset of it.
    If no cluster has k documents, subsets have the size of the largest cluster instead."""
    _check(len(emb), k, m)
    groups = clusters(emb, k, rng)
    size = k if any(len(g) >= k for g in groups) else max(len(g) for g in groups)
    eligible = [g for g in groups if len(g) >= size]
    r = _py_random(rng)
    pools = [_ranks(comb(len(g), size), m, r)[::-1] for g in eligible]  # per cluster: unused ranks, next at the end
    out: list[Subset] = []
    while len(out) < m and any(pools):
        live = [i for i, pool in enumerate(pools) if pool]
        c = live[r.randrange(len(live))]
        members = eligible[c]
        out.append(tuple(members[j] for j in _unrank_combination(pools[c].pop(), len(members), size)))
    return out


def make_subsets(strategy: str, emb: np.ndarray, k: int, m: int, seed: int = 0) -> list[Subset]:
    """Dispatch on ``strategy`` ("clustered" | "random" | "same-cluster") with ``np.random.default_rng(seed)``."""
    if strategy not in STRATEGIES:
        raise RetrospecError(f"unknown subset strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    rng = np.random.default_rng(seed)
    if strategy == "random":
        return random_subsets(len(emb), k, m, rng)
    return (clustered_subsets if strategy == "clustered" else same_cluster_subsets)(emb, k, m, rng)
