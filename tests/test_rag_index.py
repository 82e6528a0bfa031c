"""Speculative RAG passage index: build -> load -> search with the bundled MiniLM embedder, refusals of another
embedder and of corrupt or half-built indexes, and ``retrospec rag index`` from the user's side."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from retrospec.errors import RetrospecError
from retrospec.speculative_rag.index import INDEX_FILE, PASSAGES_FILE, build_index, embedder_identity, load_index
from retrospec.retrieval.embedder import load_embedder
from retrospec.retrieval.store import load_meta

pytestmark = pytest.mark.usefixtures("single_thread")

PASSAGES = [
    ("paris", "Paris", "Paris is the capital and most populous city of France, on the river Seine."),
    ("everest", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("photosynthesis", "Photosynthesis", "Plants use photosynthesis to turn sunlight, water and carbon dioxide "
                                         "into glucose and oxygen."),
    ("python", "Python (programming language)", "Python is a high-level programming language created by Guido "
                                                "van Rossum and first released in 1991."),
    ("moon", "Apollo 11", "Apollo 11 landed the first humans on the Moon in July 1969; Neil Armstrong stepped out "
                          "first."),
    ("bach", "Johann Sebastian Bach", "Bach was a German composer of the Baroque period, known for the "
                                      "Brandenburg Concertos."),
    ("nile", "Nile", "The Nile is a major river in northeastern Africa that flows north into the Mediterranean."),
    ("insulin", "Insulin", "Insulin is a hormone made by the pancreas that regulates blood sugar."),
    ("chess", "Chess", "Chess is a board game for two players played on a checkered board of 64 squares."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan and one of the largest metropolitan areas in the world."),
    ("mona", "Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci, kept in the Louvre."),
    ("dna", "DNA", "DNA carries the genetic instructions of living organisms in a double helix."),
    ("worldcup", "FIFA World Cup", "The FIFA World Cup is an international football tournament held every four "
                                   "years."),
    ("volcano", "Volcano", "A volcano is a rupture in the crust through which lava, ash and gases escape."),
    ("shakespeare", "William Shakespeare", "Shakespeare was an English playwright who wrote Hamlet and Macbeth."),
    ("coffee", "Coffee", "Coffee is a brewed drink prepared from roasted coffee beans."),
    ("titanic", "Titanic", "RMS Titanic sank in the North Atlantic in April 1912 after striking an iceberg."),
    ("gold", "Gold", "Gold is a chemical element with the symbol Au and atomic number 79."),
    ("penguin", "Penguin", "Penguins are flightless seabirds living almost exclusively in the Southern "
                           "Hemisphere."),
    (20, "", "The speed of light in vacuum is exactly 299,792,458 metres per second."),
]


def write_passages(path, rows=PASSAGES) -> str:
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in rows))
    return str(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rag_index")
    src = write_passages(root / "passages.jsonl")
    out = build_index(src, root / "idx", progress=False, batch_size=8)
    return root, out


class FakeEmbedder:
    """The Embedder protocol with configurable name, width and outputs (unit-norm rows)."""

    max_tokens = 128

    def __init__(self, name: str, dim: int, base=None, noise: float = 0.0, seed: int = 0):
        self.name, self.dim, self.base, self.noise, self.seed = name, dim, base, noise, seed

    def encode(self, texts):
        if self.base is not None:
            vecs = self.base.encode(texts)  # [n, d]
            vecs = vecs + self.noise * np.random.default_rng(self.seed).standard_normal(vecs.shape)
        else:
            seeds = [int(hashlib.sha1(f"{self.seed}:{t}".encode()).hexdigest()[:8], 16) for t in texts]
            vecs = np.stack([np.random.default_rng(s).standard_normal(self.dim) for s in seeds])  # [n, dim]
        return (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)

    def count(self, texts):
        return [len(t.split()) for t in texts]


def test_build_load_search(built):
    _, out = built
    meta = load_meta(out, kind="rag")
    real = load_embedder()
    ident = embedder_identity(real)
    assert meta["counts"] == {"passages": 20}
    assert {k: meta["embedder"][k] for k in ("name", "dim", "fingerprint")} == \
        {k: ident[k] for k in ("name", "dim", "fingerprint")}
    assert meta["embedder"]["dim"] == 384 and meta["params"]["batch_size"] == 8
    assert set(meta["files"]) == {INDEX_FILE, PASSAGES_FILE}

    idx = load_index(out)
    assert len(idx) == 20 and idx.passages[19].id == "20" and idx.passages[0].title == "Paris"
    hits = idx.search("What is the capital of France?", 3)
    assert [p.id for p, _ in hits][0] == "paris"
    assert len(hits) == 3 and hits[0][1] >= hits[1][1] >= hits[2][1]
    assert idx.search("When did the Titanic sink?", 1)[0][0].id == "titanic"
    assert idx.search("who composed the Brandenburg Concertos", 1)[0][0].id == "bach"
    assert len(idx.search("anything", 100)) == 20  # n clipped to the index size
    many = idx.search_many(["highest mountain on earth", "what is the symbol of gold"], 2)
    assert [r[0][0].id for r in many] == ["everest", "gold"]
    vecs = idx.embed(["a", "b"])
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    with pytest.raises(RetrospecError, match=">= 1"):
        idx.search("x", 0)
    assert load_index(out) is idx  # cached


def test_rebuild_needs_overwrite_and_reloads(built, tmp_path):
    root, out = built
    dest = tmp_path / "idx"
    shutil.copytree(out, dest)
    first = load_index(dest)
    with pytest.raises(RetrospecError, match="already exists"):
        build_index(root / "passages.jsonl", dest, progress=False)
    small = write_passages(tmp_path / "small.jsonl", PASSAGES[:5])
    build_index(small, dest, overwrite=True, progress=False)
    again = load_index(dest)
    assert again is not first and len(again) == 5  # the cache notices the rebuild


@pytest.mark.parametrize("fake, fragment", [
    (lambda real: FakeEmbedder("other-model", 384), "other-model"),
    (lambda real: FakeEmbedder(real.name, 128), "128-d"),
    (lambda real: FakeEmbedder(real.name, 384, seed=1), "fingerprint"),  # same name and width, another model
])
def test_mismatched_embedder_refused(built, fake, fragment):
    _, out = built
    real = load_embedder()
    with pytest.raises(RetrospecError) as err:
        load_index(out, embedder=fake(real))
    msg = str(err.value)
    assert "\n" not in msg and fragment in msg and "retrospec rag index" in msg and real.name in msg


def test_numeric_noise_is_not_another_model(built):
    _, out = built
    real = load_embedder()
    noisy = FakeEmbedder(real.name, 384, base=real, noise=2e-4, seed=3)
    assert embedder_identity(noisy)["fingerprint"] != embedder_identity(real)["fingerprint"]
    idx = load_index(out, embedder=noisy)
    assert idx.embedder is noisy and idx.search("capital of France", 1)[0][0].id == "paris"


def test_index_built_with_fake_embedder_round_trips(tmp_path):
    fake = FakeEmbedder("fake-hash", 16)
    out = build_index(write_passages(tmp_path / "p.jsonl"), tmp_path / "idx", embedder=fake, progress=False)
    idx = load_index(out, embedder=fake)
    target = idx.passages[7]
    assert idx.search(target.as_text(), 1)[0][0] == target  # identical text -> identical vector
    with pytest.raises(RetrospecError, match="fake-hash"):
        load_index(out)  # the default embedder is not the one it was built with


def _corrupt(out, tmp_path, how: str):
    dest = tmp_path / how
    shutil.copytree(out, dest)
    if how == "truncated":
        data = (dest / INDEX_FILE).read_bytes()
        (dest / INDEX_FILE).write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        size = (dest / INDEX_FILE).stat().st_size
        (dest / INDEX_FILE).write_bytes(b"\0" * size)
    elif how == "no-passages":
        (dest / PASSAGES_FILE).unlink()
    elif how == "fewer-passages":
        lines = (dest / PASSAGES_FILE).read_text().splitlines(keepends=True)
        (dest / PASSAGES_FILE).write_text("".join(lines[:-1]))
        meta = json.loads((dest / "meta.json").read_text())
        meta["files"][PASSAGES_FILE] = (dest / PASSAGES_FILE).stat().st_size
        (dest / "meta.json").write_text(json.dumps(meta))
    elif how == "no-meta":
        (dest / "meta.json").unlink()
    return dest


@pytest.mark.parametrize("how, fragment", [
    ("truncated", "bytes"), ("garbage", "cannot be read"), ("no-passages", "missing"),
    ("fewer-passages", "20 vectors"), ("no-meta", "no meta.json"),
])
def test_corrupt_index_refused(built, tmp_path, how, fragment):
    _, out = built
    with pytest.raises(RetrospecError) as err:
        load_index(_corrupt(out, tmp_path, how))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_wrong_kind_messages(built, tmp_path):
    from retrospec.retrieval import open_store
    from retrospec.atomic import atomic_build
    from retrospec.retrieval.store import write_meta

    _, out = built
    with pytest.raises(RetrospecError, match="is a RAG passage index; method 'dresd' needs a dense store"):
        load_meta(out, kind="dense")
    with pytest.raises(RetrospecError, match="RAG passage index"):
        open_store(out)
    with atomic_build(tmp_path / "suffix") as tmp:
        write_meta(tmp, {"kind": "suffix"}, 0.0)
    with pytest.raises(RetrospecError, match="is a suffix store; a RAG passage index is needed"):
        load_index(tmp_path / "suffix")


def test_failed_build_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "text": "fine"}) + "\n{oops\n")
    with pytest.raises(RetrospecError, match="line 2"):
        build_index(bad, tmp_path / "idx", progress=False)

    class Exploding(FakeEmbedder):
        def encode(self, texts):
            if len(texts) > 1:
                raise RuntimeError("boom")
            return super().encode(texts)

    good = write_passages(tmp_path / "p.jsonl")
    with pytest.raises(RuntimeError, match="boom"):
        build_index(good, tmp_path / "idx", embedder=Exploding("x", 8), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "p.jsonl"]  # no idx, no .tmp leftovers
    with pytest.raises(RetrospecError, match="batch size"):
        build_index(good, tmp_path / "idx", batch_size=0)


# ---------------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_rag_index(cli, tmp_path):
    src = write_passages(tmp_path / "p.jsonl")
    out = tmp_path / "idx"
    run = cli("rag", "index", "--passages", src, "--out", out, "--batch-size", 7)
    assert run.rc == 0, run.err
    assert run.out.count("\n") == 1 and "20 passages" in run.out and "384-d" in run.out and str(out) in run.out
    assert load_meta(out, kind="rag")["params"] == {"source": src, "batch_size": 7}
    info = cli("datastore", "info", out)
    assert info.rc == 0 and "RAG passage index" in info.out and "passages 20 from" in info.out
    cli("rag", "index", "--passages", src, "--out", out).assert_user_error("already exists", "--overwrite")
    assert cli("rag", "index", "--passages", src, "--out", out, "--overwrite").rc == 0


def test_cli_rag_index_errors(cli, tmp_path):
    out = tmp_path / "idx"
    cli("rag", "index", "--passages", tmp_path / "missing.jsonl", "--out", out).assert_user_error("not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "text": "a"}) + "\n" + json.dumps({"id": 2, "text": "b"}) + "\nnot json\n")
    cli("rag", "index", "--passages", bad, "--out", out).assert_user_error("line 3", "not valid JSON")
    (tmp_path / "empty.jsonl").write_text("\n")
    cli("rag", "index", "--passages", tmp_path / "empty.jsonl", "--out", out).assert_user_error("empty")
    cli("rag", "index", "--passages", bad, "--out", out, "--batch-size", 0).assert_user_error("--batch-size")
    good = write_passages(tmp_path / "good.jsonl", PASSAGES[:2])
    cli("rag", "index", "--passages", good, "--out", out, "--embedder", tmp_path / "nope").assert_user_error(
        "embedder directory not found")
    cli("rag", "index", "--passages", bad).assert_user_error("--out")
    cli("rag").assert_user_error()
    assert not out.exists()
