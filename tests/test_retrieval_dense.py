"""DReSD's datastore: build -> save -> load -> search, the key transform, meta checks, corrupt and interrupted
builds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from retrospec.errors import RetrospecError
from retrospec.retrieval import DenseStore, KeyTransform, build_dense_store, build_suffix_store, load_meta, open_store
from retrospec.retrieval import dense_index
from retrospec.retrieval.corpus import TokenDoc
from retrospec.retrieval.dense_index import hidden_states
from retrospec.retrieval.store import target_meta, tokenizer_meta

pytestmark = pytest.mark.usefixtures("single_thread")
V = 64
EOS = V - 1


def model_(seed=0, hidden=32, arch="llama"):
    from conftest import tiny_llama, tiny_qwen2

    return (tiny_llama if arch == "llama" else tiny_qwen2)(seed=seed, hidden=hidden, vocab=V, max_pos=128)


@pytest.fixture(scope="module")
def model():
    return model_()


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(0)
    return [TokenDoc(rng.integers(0, V - 2, size=n).astype(np.int32)) for n in (150, 90, 300, 40, 2, 1)]


def build(model, docs, out, **kw):
    kw.setdefault("pca_dims", 8)
    return build_dense_store(model, docs, out, tokenizer_info=tokenizer_meta(None, V, EOS),
                             target_info=target_meta(model, "tiny"), corpus={"description": "random"},
                             progress=False, **kw)


@pytest.fixture(scope="module")
def store_dir(model, docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "store"
    build(model, docs, out, window=64, overlap=16)  # several windows per long document
    return out


def raw_states(model, doc: TokenDoc) -> np.ndarray:
    """Hidden states of a whole document in one forward: [n, H]."""
    return hidden_states(model, torch.from_numpy(doc.ids.astype(np.int64))[None])[0].numpy()


def windowed_states(model, doc: TokenDoc, window=64, overlap=16) -> np.ndarray:
    """The key of every stored position t in [0, n - 1), recomputed window by window: [n - 1, H]."""
    out = np.zeros((len(doc.ids) - 1, model.config.hidden_size), dtype=np.float32)
    for start, end, keep in dense_index._windows(len(doc.ids), window, overlap, 0, len(doc.ids) - 1):
        stop = min(end, len(doc.ids) - 1)
        out[keep:stop] = raw_states(model, TokenDoc(doc.ids[start:end]))[keep - start : stop - start]
    return out


def test_round_trip_search_finds_the_stored_entry(model, docs, store_dir):
    store = open_store(store_dir, "dense", target=model)
    meta = load_meta(store_dir)
    usable = [d for d in docs if len(d.ids) >= 2]
    assert meta["counts"]["entries"] == len(store) == sum(len(d.ids) - 1 for d in usable)
    assert meta["params"]["index"] == "flat" and meta["params"]["key_dim"] == 8
    assert store.values.shape == (len(store), 21)
    base, hits, queries = 0, 0, 0
    for doc in usable:
        h = windowed_states(model, doc)
        for t in range(0, len(doc.ids) - 1, 3):
            sims, ids = store.search(h[t], k=3)
            want = np.concatenate([doc.ids, np.full(21, EOS)])[t + 1 : t + 22]
            np.testing.assert_array_equal(store.values[base + t], want)
            hits += int(base + t in ids[0])
            queries += 1
            assert sims[0, 0] == pytest.approx(1.0, abs=1e-4)
        base += len(doc.ids) - 1
    assert hits >= 0.95 * queries


def test_transform_is_the_same_at_build_and_query(model, docs, store_dir):
    """The index holds transform(h) for the build-time states; the loaded transform maps fresh states onto them."""
    store = DenseStore(store_dir)
    vecs = store.index.reconstruct_n(0, store.index.ntotal)  # [n, D] as stored at build time
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    h = np.concatenate([windowed_states(model, d) for d in docs if len(d.ids) >= 2])  # [n, H], every entry
    q = store.transform.apply(h)
    np.testing.assert_allclose(q, vecs, atol=2e-4)
    # the transform is z-norm -> PCA -> L2 with the saved arrays, nothing else
    t = KeyTransform.load(store_dir / dense_index.TRANSFORM_FILE)
    z = ((h - t.mean) / t.std - t.pca_mean) @ t.components.T
    np.testing.assert_allclose(q, z / np.linalg.norm(z, axis=1, keepdims=True), atol=1e-5)
    assert not np.allclose(t.mean, 0) and not np.allclose(t.std, 1)


def test_scratch_memmap_gives_the_same_store(model, docs, store_dir, tmp_path):
    meta = build(model, docs, tmp_path / "mm", window=64, overlap=16, memory_budget_mb=0.001)
    assert meta["params"]["scratch_memmap"] is True
    assert not (tmp_path / "mm" / "hidden.f32.scratch").exists()
    a, b = DenseStore(store_dir), DenseStore(tmp_path / "mm")
    np.testing.assert_array_equal(a.index.reconstruct_n(0, len(a)), b.index.reconstruct_n(0, len(b)))
    np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_indexes_round_trip(model, tmp_path, kind):
    rng = np.random.default_rng(1)
    docs = [TokenDoc(rng.integers(0, V - 2, size=400).astype(np.int32)) for _ in range(5)]
    build(model, docs, tmp_path / kind, index=kind, pca_dims=16)
    store = open_store(tmp_path / kind, "dense", target=model)
    assert store.meta["params"]["index"] == kind
    h = windowed_states(model, docs[2], window=128, overlap=64)  # the defaults, capped by max_pos = 128
    ids = store.search(h[::5], k=1)[1][:, 0]
    recall = np.mean(ids == 2 * 399 + np.arange(0, 399, 5))
    assert recall >= 0.8, recall


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_mismatches_are_refused(model, docs, store_dir, tmp_path):
    with pytest.raises(RetrospecError, match="another target"):
        open_store(store_dir, "dense", target=model_(seed=5))  # same config, other weights
    with pytest.raises(RetrospecError, match="hidden states of size"):
        open_store(store_dir, "dense", target=model_(hidden=48))
    with pytest.raises(RetrospecError, match="another target"):
        open_store(store_dir, "dense", target=model_(arch="qwen2"))
    with pytest.raises(RetrospecError, match="needs a suffix store"):
        open_store(store_dir, "suffix", target=model)
    # tokenizer: a store records the vocabulary fingerprint; another vocabulary is refused
    tok_a = FakeTokenizer({f"t{i}": i for i in range(V)})
    tok_b = FakeTokenizer({f"u{i}": i for i in range(V)})
    build_suffix_store([TokenDoc(np.arange(10, dtype=np.int32))], tmp_path / "s",
                       tokenizer_info=tokenizer_meta(tok_a, V, EOS), corpus={}, progress=False)
    open_store(tmp_path / "s", "suffix", target=model, tokenizer=tok_a)
    with pytest.raises(RetrospecError, match="another tokenizer"):
        open_store(tmp_path / "s", "suffix", target=model, tokenizer=tok_b)
    # without fingerprints the vocabulary size is compared
    build_suffix_store([TokenDoc(np.arange(10, dtype=np.int32))], tmp_path / "s2",
                       tokenizer_info=tokenizer_meta(None, V + 5, EOS), corpus={}, progress=False)
    with pytest.raises(RetrospecError, match="vocabulary of 69"):
        open_store(tmp_path / "s2", "suffix", target=model)


def test_corrupt_or_missing_files_are_refused(model, docs, tmp_path):
    import shutil

    src = tmp_path / "ok"
    build(model, docs[:2], src)
    cases = {
        "no_meta": lambda d: (d / "meta.json").unlink(),
        "bad_json": lambda d: (d / "meta.json").write_text("{not json"),
        "not_ours": lambda d: (d / "meta.json").write_text("[1, 2]"),
        "version": lambda d: (d / "meta.json").write_text(
            json.dumps(json.loads((d / "meta.json").read_text()) | {"version": 99})),
        "no_values": lambda d: (d / "values.npy").unlink(),
        "truncated_index": lambda d: (d / "index.faiss").write_bytes((d / "index.faiss").read_bytes()[:100]),
    }
    for name, damage in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        damage(d)
        with pytest.raises(RetrospecError) as err:
            DenseStore(d, load_meta(d))
        assert "\n" not in str(err.value) and str(d) in str(err.value), name
    with pytest.raises(RetrospecError, match="not found"):
        load_meta(tmp_path / "missing")


def test_exception_mid_build_leaves_nothing(model, docs, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt  # e.g. Ctrl-C while hidden states are being computed

    monkeypatch.setattr(dense_index, "_encode", boom)
    with pytest.raises(KeyboardInterrupt):
        build(model, docs, tmp_path / "store")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RetrospecError, match="not found"):
        open_store(tmp_path / "store", "dense", target=model)


KILL_SCRIPT = r"""
import sys, time, numpy as np
from pathlib import Path
from retrospec.retrieval import build_suffix_store
from retrospec.retrieval.corpus import TokenDoc
from retrospec.retrieval.store import tokenizer_meta

out, marker = Path(sys.argv[1]), Path(sys.argv[2])

def docs():
    for i in range(1000):
        yield TokenDoc(np.arange(1, 50, dtype=np.int32))
        if i == 10:
            marker.write_text("mid-build")
            time.sleep(60)

build_suffix_store(docs(), out, tokenizer_info=tokenizer_meta(None, 64, 0), corpus={}, progress=False)
"""


def test_killed_build_leaves_no_loadable_store(tmp_path):
    out, marker = tmp_path / "store", tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(out), str(marker)], env=env)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "builder exited early"
            assert time.time() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".store.tmp-")]
    assert len(leftovers) == 1 and not (leftovers[0] / "meta.json").exists()
    with pytest.raises(RetrospecError, match="not found"):
        open_store(out, "suffix")
    with pytest.raises(RetrospecError, match="no meta.json"):
        open_store(leftovers[0], "suffix")
    # the next build of the same destination removes the dead builder's leftovers
    build_suffix_store([TokenDoc(np.arange(1, 9, dtype=np.int32))], out, tokenizer_info=tokenizer_meta(None, 64, 0),
                       corpus={}, progress=False)
    assert len(open_store(out, "suffix")) == 9
    assert not leftovers[0].exists()


def test_existing_destination_needs_overwrite(model, docs, tmp_path):
    build(model, docs[:2], tmp_path / "s")
    with pytest.raises(RetrospecError, match="already exists"):
        build(model, docs[:2], tmp_path / "s")
    build(model, docs[:3], tmp_path / "s", overwrite=True)
    assert load_meta(tmp_path / "s")["counts"]["documents"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
