"""Speculative RAG data files (passages / questions JSONL, train/eval split) and multi-perspective subset sampling
(clustered, random, same-cluster) on synthetic embeddings whose clusters are known."""

from __future__ import annotations

import json
from collections import Counter
from math import comb

import numpy as np
import pytest

from retrospec.errors import RetrospecError
from retrospec.speculative_rag.data import Passage, Question, read_passages, read_questions, select, split_of
from retrospec.speculative_rag.subsets import (clustered_subsets, clusters, doc_embeddings, make_subsets, random_subsets,
                                   same_cluster_subsets)


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# data


def test_read_passages_and_questions(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "title": "Paris", "text": "Capital of France."}, "",
                                           {"id": "b", "text": "No title here."}])
    passages = read_passages(p)
    assert passages == [Passage("1", "Paris", "Capital of France."), Passage("b", "", "No title here.")]
    assert passages[0].as_text() == "Paris\nCapital of France."
    assert passages[1].as_text() == "No title here."
    q = write_jsonl(tmp_path / "q.jsonl", [{"id": 7, "question": "capital of france?", "answers": ["Paris"],
                                            "gold_passage": 1},
                                           {"id": "x", "question": "ad hoc?", "answers": []}])
    assert read_questions(q) == [Question("7", "capital of france?", ("Paris",), "1"),
                                 Question("x", "ad hoc?", (), None)]


@pytest.mark.parametrize("rows, fragments", [
    ([], ("empty",)),
    (["", "  "], ("empty",)),
    ([{"id": 1, "text": "a"}, "{not json"], ("line 2", "not valid json")),
    ([[1, 2]], ("line 1", "json object")),
    ([{"text": "a"}], ("line 1", "missing field 'id'")),
    ([{"id": "", "text": "a"}], ("field 'id'",)),
    ([{"id": 1}], ("missing field 'text'",)),
    ([{"id": 1, "text": "  "}], ("field 'text' is empty",)),
    ([{"id": 1, "text": 5}], ("'text' must be a string",)),
    ([{"id": 1, "text": "a"}, {"id": "1", "text": "b"}], ("line 2", "duplicate id '1'", "line 1")),
])
def test_read_passages_errors(tmp_path, rows, fragments):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(RetrospecError) as err:
        read_passages(path)
    msg = str(err.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag.lower() in msg.lower(), msg


@pytest.mark.parametrize("row, fragment", [
    ({"id": 1, "answers": ["a"]}, "missing field 'question'"),
    ({"id": 1, "question": "", "answers": ["a"]}, "'question' is empty"),
    ({"id": 1, "question": "q"}, "missing field 'answers'"),
    ({"id": 1, "question": "q", "answers": "Paris"}, "list of non-empty strings"),
    ({"id": 1, "question": "q", "answers": ["ok", ""]}, "list of non-empty strings"),
    ({"id": 1, "question": "q", "answers": [], "gold_passage": [3]}, "gold_passage"),
])
def test_read_questions_errors(tmp_path, row, fragment):
    with pytest.raises(RetrospecError, match=fragment):
        read_questions(write_jsonl(tmp_path / "q.jsonl", [row]))


def test_missing_and_not_a_file(tmp_path):
    with pytest.raises(RetrospecError, match="not found"):
        read_passages(tmp_path / "nope.jsonl")
    with pytest.raises(RetrospecError, match="not a file"):
        read_questions(tmp_path)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"id": 1, "text": "caf\xe9"}\n')
    with pytest.raises(RetrospecError, match="UTF-8"):
        read_passages(bad)


def test_split_is_deterministic_and_about_a_quarter():
    ids = [f"q{i}" for i in range(4000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert set(splits) == {"train", "eval"}
    assert 0.22 < splits.count("eval") / len(ids) < 0.28


def test_select_keeps_order_and_partitions():
    qs = [Question(f"q{i}", f"question {i}", ("a",)) for i in range(200)]
    train, held = select(qs, "train"), select(qs, "eval")
    assert not {q.id for q in train} & {q.id for q in held}
    assert len(train) + len(held) == len(qs) == len(select(qs))
    assert [q.id for q in held] == [q.id for q in qs if split_of(q.id) == "eval"]  # file order
    assert select(qs, "eval", limit=3, offset=2) == held[2:5]
    assert select(qs, "all", limit=0) == []
    for bad in ({"split": "test"}, {"limit": -1}, {"offset": -1}):
        with pytest.raises(RetrospecError):
            select(qs, **bad)


# ---------------------------------------------------------------------------------------------------------------------
# subsets


def blobs(sizes, dim=8, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """Well-separated clusters: blob j has sizes[j] rows near 10 * e_j, shuffled so clusters are not contiguous
    in rank order. Returns (emb [n, dim], true cluster label per row [n])."""
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.full(s, j) for j, s in enumerate(sizes)])
    labels = labels[rng.permutation(len(labels))]
    emb = 10 * np.eye(len(sizes), dim)[labels] + 0.01 * rng.standard_normal((len(labels), dim))  # [n, dim]
    return emb.astype(np.float32), labels


def test_clusters_recover_blobs():
    emb, labels = blobs([3, 4, 5])
    groups = clusters(emb, 3, np.random.default_rng(0))
    assert sorted(i for g in groups for i in g) == list(range(12))
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)
    assert sorted(sorted(g) for g in groups) == sorted(sorted(np.flatnonzero(labels == j).tolist()) for j in range(3))


def test_clustered_one_per_cluster_unique_sorted():
    emb, labels = blobs([3, 4, 5])
    subsets = clustered_subsets(emb, 3, 10, np.random.default_rng(1))
    assert len(subsets) == 10 == len(set(subsets))
    for s in subsets:
        assert list(s) == sorted(s)
        assert sorted(labels[list(s)].tolist()) == [0, 1, 2]


def test_clustered_returns_all_when_fewer_exist():
    emb, _ = blobs([1, 2])  # 1 * 2 = 2 possible subsets
    subsets = clustered_subsets(emb, 2, 5, np.random.default_rng(0))
    assert len(subsets) == 2 == len(set(subsets))
    emb, _ = blobs([2, 3, 2])
    everything = clustered_subsets(emb, 3, 100, np.random.default_rng(0))
    assert len(set(everything)) == len(everything) == 2 * 3 * 2
    assert clustered_subsets(emb, 3, 12, np.random.default_rng(5)) == everything  # fixed order, seed-free


def test_clustered_k_clipped_to_documents_and_distinct_rows():
    emb, _ = blobs([1, 1, 1])
    assert clustered_subsets(emb, 10, 4, np.random.default_rng(0)) == [(0, 1, 2)]
    dup = np.repeat(np.eye(2, 4, dtype=np.float32), 3, axis=0)  # 6 rows, 2 distinct
    subsets = clustered_subsets(dup, 4, 20, np.random.default_rng(0))
    assert len(subsets) == 9 and all(len(s) == 2 for s in subsets)
    assert clustered_subsets(dup[:1], 3, 2, np.random.default_rng(0)) == [(0,)]


def test_determinism_by_seed():
    emb, _ = blobs([4, 4, 4, 4], seed=3)
    for strategy in ("clustered", "random", "same-cluster"):
        a = make_subsets(strategy, emb, 2, 6, seed=11)
        assert a == make_subsets(strategy, emb, 2, 6, seed=11)
    assert make_subsets("clustered", emb, 4, 6, seed=1) != make_subsets("clustered", emb, 4, 6, seed=2)


def test_random_subsets_unique_and_guard():
    subsets = random_subsets(10, 3, 50, np.random.default_rng(0))
    assert len(subsets) == 50 == len(set(subsets))
    assert all(len(s) == 3 and list(s) == sorted(s) and max(s) < 10 for s in subsets)
    everything = random_subsets(5, 2, 100, np.random.default_rng(0))
    assert len(everything) == comb(5, 2) == len(set(everything))
    assert random_subsets(3, 5, 4, np.random.default_rng(0)) == [(0, 1, 2)]  # k clipped to n
    # large populations (beyond 64 bits) still sample without replacement
    big = random_subsets(200, 60, 5, np.random.default_rng(0))
    assert len(set(big)) == 5 and all(len(s) == 60 for s in big)


def test_random_subsets_cover_uniformly():
    counts = Counter(i for seed in range(300) for s in random_subsets(6, 2, 1, np.random.default_rng(seed))
                     for i in s)
    assert set(counts) == set(range(6)) and max(counts.values()) < 2 * min(counts.values())


def test_same_cluster_subsets_stay_in_one_cluster():
    emb, labels = blobs([5, 2, 4])
    subsets = same_cluster_subsets(emb, 3, 8, np.random.default_rng(0))
    assert len(subsets) == 8 == len(set(subsets))
    for s in subsets:
        assert len(s) == 3 and list(s) == sorted(s) and len(set(labels[list(s)].tolist())) == 1
    assert {int(labels[s[0]]) for s in subsets} <= {0, 2}  # the 2-document cluster cannot hold 3
    everything = same_cluster_subsets(emb, 3, 100, np.random.default_rng(0))
    assert len(everything) == comb(5, 3) + comb(4, 3) == len(set(everything))


def test_same_cluster_falls_back_to_largest_cluster():
    emb, labels = blobs([2, 1, 2])  # k = 3 clusters, none with 3 documents
    subsets = same_cluster_subsets(emb, 3, 5, np.random.default_rng(0))
    assert len(subsets) == 2 and all(len(s) == 2 and len(set(labels[list(s)].tolist())) == 1 for s in subsets)


def test_make_subsets_validation():
    emb, _ = blobs([2, 2])
    with pytest.raises(RetrospecError, match="unknown subset strategy"):
        make_subsets("greedy", emb, 2, 2)
    for k, m in ((0, 2), (2, 0)):
        with pytest.raises(RetrospecError, match=">= 1"):
            make_subsets("clustered", emb, k, m)
    with pytest.raises(RetrospecError, match="n = 0"):
        make_subsets("random", emb[:0], 2, 2)
    with pytest.raises(RetrospecError, match="2-D"):
        clustered_subsets(np.ones(4), 2, 2, np.random.default_rng(0))


def test_doc_embeddings_use_question_and_passage():
    class Recorder:
        name, max_tokens = "recorder", 64

        def __init__(self):
            self.seen = []

        def encode(self, texts):
            self.seen.extend(texts)
            return np.ones((len(texts), 3), dtype=np.float64)

        def count(self, texts):
            return [len(t.split()) for t in texts]

    rec = Recorder()
    emb = doc_embeddings(rec, "who?", [Passage("1", "T", "body"), Passage("2", "", "other")])
    assert emb.shape == (2, 3) and emb.dtype == np.float32
    assert rec.seen == ["Question: who?\nDocument: T\nbody", "Question: who?\nDocument: other"]
    with pytest.raises(RetrospecError):
        doc_embeddings(rec, "who?", [])
