"""REST's datastore and draft tree: suffix-array search against brute force, continuations, the frequency trie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrospec.retrieval import SuffixStore, build_suffix_store, open_store
from retrospec.retrieval.corpus import TokenDoc
from retrospec.retrieval.store import tokenizer_meta
from retrospec.retrieval.suffix_array import TOKENS_FILE
from retrospec.tree import ancestor_mask, depths, frequency_trie

EOS = 0


def build(tmp_path, docs, vocab=100, name="s") -> SuffixStore:
    build_suffix_store([TokenDoc(np.asarray(d, dtype=np.int32)) for d in docs], tmp_path / name,
                       tokenizer_info=tokenizer_meta(None, vocab, EOS), corpus={"description": "test"},
                       progress=False)
    return open_store(tmp_path / name, "suffix")


def stream_of(store: SuffixStore) -> np.ndarray:
    return np.fromfile(store.path / TOKENS_FILE, dtype=">i4").astype(np.int64)


def brute_force_search(tokens: np.ndarray, context, max_suffix: int = 16, min_suffix: int = 2) -> tuple[int, int]:
    """Reference for tests: (longest matched suffix length, occurrence count) by scanning the corpus."""
    tokens = np.asarray(tokens)
    ctx = list(context[-max_suffix:])
    for m in range(len(ctx), min_suffix - 1, -1):
        pat = np.asarray(ctx[len(ctx) - m:])
        if len(tokens) < m:
            continue
        win = np.lib.stride_tricks.sliding_window_view(tokens, m)
        count = int((win == pat).all(axis=1).sum())
        if count:
            return m, count
    return 0, 0


@pytest.mark.parametrize("alphabet,high", [(3, False), (8, False), (5, True)])
def test_search_equals_brute_force(tmp_path, alphabet, high):
    """Longest matching suffix (16 -> 2) and its occurrence count equal a linear scan; ids above 65,535 work."""
    rng = np.random.default_rng(alphabet)
    offset = 70_000 if high else 1  # int32 ids beyond uint16
    docs = [rng.integers(0, alphabet, size=rng.integers(1, 400)) + offset for _ in range(30)]
    store = build(tmp_path, docs, vocab=offset + alphabet)
    stream = stream_of(store)
    assert stream.max() == offset + alphabet - 1 or not high
    for i in range(300):
        if i % 3 == 0:  # contexts copied from the corpus, so long matches occur
            s = int(rng.integers(0, len(stream) - 20))
            ctx = stream[s : s + int(rng.integers(1, 20))].tolist()
        else:
            ctx = (rng.integers(0, alphabet, size=rng.integers(1, 20)) + offset).tolist()
        m = store.search(ctx)
        got = (m.length, m.count) if m else (0, 0)
        assert got == brute_force_search(stream, ctx), ctx


def test_continuations_are_exact_counts_in_frequency_order(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 4, size=300) for _ in range(5)]
    store = build(tmp_path, docs)
    stream = stream_of(store)
    ctx = [1, 2]
    m = store.search(ctx)
    seqs, counts = store.continuations(m, length=3, max_samples=10**6)
    # brute force: every occurrence's next 3 tokens, cut after EOS, -1 padded
    want: dict[tuple, int] = {}
    for s in range(len(stream) - 1):
        if stream[s] == 1 and stream[s + 1] == 2 and s + 2 < len(stream):
            cont = stream[s + 2 : s + 5].tolist()
            if EOS in cont:
                cont = cont[: cont.index(EOS) + 1]
            cont = tuple(cont + [-1] * (3 - len(cont)))
            want[cont] = want.get(cont, 0) + 1
    assert {tuple(r): int(c) for r, c in zip(seqs.tolist(), counts)} == want
    assert list(counts) == sorted(counts, reverse=True)
    again = store.continuations(m, length=3, max_samples=10**6)
    assert np.array_equal(again[0], seqs) and np.array_equal(again[1], counts)


def test_sampled_continuations_are_deterministic_and_bounded(tmp_path):
    rng = np.random.default_rng(2)
    store = build(tmp_path, [rng.integers(1, 3, size=5000)])
    m = store.search([1, 2])
    assert m.count > 100
    seqs, counts = store.continuations(m, length=4, max_samples=64)
    assert counts.sum() == 64
    seqs2, counts2 = store.continuations(m, length=4, max_samples=64)
    assert np.array_equal(seqs, seqs2) and np.array_equal(counts, counts2)


def test_no_match_and_short_context(tmp_path):
    store = build(tmp_path, [[1, 2, 3, 4]])
    assert store.search([9, 9, 9]) is None
    assert store.search([1]) is None  # shorter than min_suffix
    m = store.search([7, 1, 2])
    assert (m.length, m.count) == (2, 1)


def test_continuation_stops_after_eos(tmp_path):
    store = build(tmp_path, [[5, 6, 7], [8, 9]])
    seqs, counts = store.continuations(store.search([5, 6]), length=4)
    assert seqs.tolist() == [[7, EOS, -1, -1]]


# ---- frequency trie ------------------------------------------------------------------------------------------------


def paths(tree) -> set[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(len(toks)):
        p, node = [], i
        while node >= 0:
            p.append(toks[node])
            node = pars[node]
        out.add(tuple(p[::-1]))
    return out


def test_frequency_trie_full_and_pruned():
    seqs = np.array([[1, 2, 3], [1, 2, 4], [1, 5, -1], [6, 7, 8]])
    counts = np.array([5, 3, 2, 1])
    full = frequency_trie(seqs, counts, 100)
    assert paths(full) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 5), (6,), (6, 7), (6, 7, 8)}
    assert (full.parents < torch.arange(len(full))).all()  # topological
    # node counts: (1)=10, (1,2)=8, (1,2,3)=5, (1,2,4)=3, (1,5)=2, (6)=1 ...: the top 4 nodes
    top4 = frequency_trie(seqs, counts, 4)
    assert paths(top4) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4)}
    assert frequency_trie(seqs, counts, 0).tokens.numel() == 0
    assert frequency_trie(np.zeros((0, 3)), np.zeros(0), 5).tokens.numel() == 0


def test_frequency_trie_random_is_closed_and_deterministic():
    rng = np.random.default_rng(0)
    for _ in range(50):
        seqs = rng.integers(0, 4, size=(rng.integers(1, 40), 6))
        cut = rng.integers(1, 7, size=len(seqs))
        seqs[np.arange(6)[None] >= cut[:, None]] = -1
        counts = rng.integers(1, 5, size=len(seqs))
        n = int(rng.integers(1, 30))
        tree = frequency_trie(seqs, counts, n)
        # every kept path is a prefix of some input sequence, parents come first, siblings are distinct
        prefixes = {tuple(s[:k]) for s in seqs.tolist() for k in range(1, 7) if -1 not in s[:k]}
        assert paths(tree) <= prefixes
        assert len(tree) == min(n, len(prefixes))
        assert (tree.parents < torch.arange(len(tree))).all()
        sib = set(zip(tree.parents.tolist(), tree.tokens.tolist()))
        assert len(sib) == len(tree)
        # pruning keeps the heaviest nodes: no dropped prefix outweighs a kept one
        weight = {p: sum(c for s, c in zip(seqs.tolist(), counts) if tuple(s[: len(p)]) == p) for p in prefixes}
        kept = paths(tree)
        if kept != prefixes:
            assert min(weight[p] for p in kept) >= max(weight[p] for p in prefixes - kept)
        same = frequency_trie(seqs[::-1], counts[::-1], n)  # input order does not matter
        assert torch.equal(same.tokens, tree.tokens) and torch.equal(same.parents, tree.parents)
        assert ancestor_mask(tree.parents).shape == (len(tree), len(tree))
        if len(tree):
            assert depths(tree.parents).max() <= 6


def test_sampled_rows_are_sorted_and_give_the_same_trie(tmp_path):
    """The drafter's fast path (raw suffix-array samples, presorted) builds the same tree as unique + counts."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 4, size=int(rng.integers(2, 60))) for _ in range(200)]  # many EOS cuts
    store = build(tmp_path, docs)
    for ctx in ([1, 2], [3, 3], [2, 1, 1]):
        m = store.search(ctx)
        for max_samples in (16, 10_000):
            rows = store.sample(m, 6, max_samples)
            assert np.array_equal(rows, rows[np.lexsort(rows.T[::-1])])
            seqs, counts = store.continuations(m, 6, max_samples)
            assert counts.sum() == len(rows)
            for n in (1, 5, 40):
                a = frequency_trie(rows, None, n, presorted=True)
                b = frequency_trie(seqs, counts, n)
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
