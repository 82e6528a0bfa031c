"""The passage index of Speculative RAG (Wang et al., "Speculative RAG: Enhancing Retrieval Augmented Generation
through Drafting", ICLR 2025): dense retrieval of the top passages for a question, before subsets are sampled.

An index is one datastore directory of kind ``"rag"`` (see ``retrieval/store.py``)::

    passages.jsonl   the passages as read (id, title, text), row i = vector i
    index.faiss      faiss.IndexFlatIP over unit-norm float32 embeddings of ``Passage.as_text()`` (exact cosine)
    meta.json        kind "rag"; embedder {name, dim, fingerprint, probe}; counts {passages};
                     params {source, batch_size}; files and build statistics

Invariants:
- A build is atomic (``atomic_build``): any error leaves no directory at the destination.
- ``load_index`` refuses an index built with another embedder: another name, dimension, or model behind the same
  name and dimension (its embedding of a fixed probe sentence differs: ``fingerprint`` hashes it rounded to 4
  decimals; when that differs, the recorded ``probe`` values are compared with a tolerance, so numeric noise from
  another device, thread count or dtype is not mistaken for another model).
- Corrupt files (missing, resized, unreadable by faiss, row counts that disagree) are one ``RetrospecError`` line.
- Loaded indexes are cached per (resolved path, meta.json mtime, embedder name); a rebuilt index is reloaded.
"""

from __future__ import annotations

import hashlib
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RetrospecError
from ..retrieval.embedder import Embedder, load_embedder
from ..atomic import META_FILE, atomic_build
from ..retrieval.store import load_meta, write_meta
from .data import Passage, read_passages, write_passages

KIND = "rag"
PASSAGES_FILE = "passages.jsonl"
INDEX_FILE = "index.faiss"
PROBE = "Speculative RAG probe: the quick brown fox jumps over the lazy dog near the river bank in 1901."
PROBE_DIMS = 64  # leading probe values kept in meta.json for the tolerant comparison
PROBE_TOLERANCE = 5e-3  # max |difference| of probe values still taken as the same model


def _unit_rows(vecs: Any, rows: int, who: str) -> np.ndarray:
    vecs = np.asarray(vecs, dtype=np.float32)  # [rows, d]
    if vecs.ndim != 2 or vecs.shape[0] != rows or vecs.shape[1] < 1:
        raise RetrospecError(f"embedder {who} returned an array of shape {vecs.shape} for {rows} texts")
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)  # [rows, 1]
    return np.ascontiguousarray(vecs / np.maximum(norms, 1e-12), dtype=np.float32)


_IDENTITY: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def embedder_identity(embedder: Embedder) -> dict:
    """``{name, dim, fingerprint, probe}`` of an embedder, from its embedding of ``PROBE`` (cached per object)."""
    try:
        return _IDENTITY[embedder]
    except (KeyError, TypeError):
        pass
    name = str(getattr(embedder, "name", type(embedder).__name__))
    vec = _unit_rows(embedder.encode([PROBE]), 1, name)[0]  # [d]
    rounded = [round(float(x), 4) + 0.0 for x in vec]  # + 0.0 turns -0.0 into 0.0
    fingerprint = hashlib.sha256(",".join(f"{x:.4f}" for x in rounded).encode()).hexdigest()[:16]
    ident = {"name": name, "dim": int(vec.shape[0]), "fingerprint": fingerprint, "probe": rounded[:PROBE_DIMS]}
    try:
        _IDENTITY[embedder] = ident
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return ident


def _check_embedder(meta: dict, path: Path, have: dict) -> None:
    want = meta.get("embedder") or {}
    same = want.get("name") == have["name"] and want.get("dim") == have["dim"]
    if same and want.get("fingerprint") != have["fingerprint"]:
        probe = want.get("probe") or []
        same = len(probe) > 0 and len(probe) <= len(have["probe"]) and \
            max(abs(a - b) for a, b in zip(probe, have["probe"])) <= PROBE_TOLERANCE
    if not same:
        raise RetrospecError(
            f"RAG index {path} was built with embedder {want.get('name')!r} ({want.get('dim')}-d, fingerprint "
            f"{want.get('fingerprint')}); the running embedder is {have['name']!r} ({have['dim']}-d, fingerprint "
            f"{have['fingerprint']}); rebuild the index with 'retrospec rag index' and this embedder")


def build_index(passages_path: str | Path, out: str | Path, *, embedder: Any = None, overwrite: bool = False,
                progress: bool = True, batch_size: int = 64) -> Path:
    """Embed every passage and write a ``rag`` index directory at ``out`` (atomically). Returns ``out``."""
    import faiss
    from tqdm import tqdm

    if batch_size < 1:
        raise RetrospecError(f"batch size must be >= 1, got {batch_size}")
    out = Path(out).expanduser()
    started = time.perf_counter()
    with atomic_build(out, overwrite=overwrite) as tmp:
        passages = read_passages(passages_path)
        model = load_embedder(embedder)
        ident = embedder_identity(model)
        vecs = np.empty((len(passages), ident["dim"]), dtype=np.float32)  # [n, d]
        with tqdm(total=len(passages), desc="embedding passages", unit="passage", file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:
            for start in range(0, len(passages), batch_size):
                batch = [p.as_text() for p in passages[start:start + batch_size]]
                rows = _unit_rows(model.encode(batch), len(batch), ident["name"])  # [b, d']
                if rows.shape[1] != ident["dim"]:
                    raise RetrospecError(f"embedder {ident['name']} returned {rows.shape[1]}-d vectors for passages "
                                         f"but {ident['dim']}-d for the probe sentence")
                vecs[start:start + len(batch)] = rows
                bar.update(len(batch))
        index = faiss.IndexFlatIP(ident["dim"])
        index.add(vecs)
        faiss.write_index(index, str(tmp / INDEX_FILE))
        write_passages(passages, tmp / PASSAGES_FILE)
        write_meta(tmp, {"kind": KIND, "embedder": ident, "counts": {"passages": len(passages)},
                         "params": {"source": str(passages_path), "batch_size": batch_size}}, started)
    return out


@dataclass(repr=False, eq=False)
class PassageIndex:
    """Exact cosine search over the passages of one index, with the embedder it was built with."""

    path: Path
    meta: dict
    passages: list[Passage]
    index: Any  # faiss.IndexFlatIP, ntotal == len(passages)
    embedder: Embedder

    def __len__(self) -> int:
        return len(self.passages)

    def __repr__(self) -> str:
        return f"PassageIndex({str(self.path)!r}, passages={len(self)}, embedder={self.meta['embedder']['name']!r})"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm float32 ``[len(texts), d]`` embeddings with this index's embedder."""
        if len(texts) == 0:
            return np.zeros((0, int(self.index.d)), dtype=np.float32)
        return _unit_rows(self.embedder.encode(list(texts)), len(texts), self.meta["embedder"]["name"])

    def search_many(self, questions: Sequence[str], n: int) -> list[list[tuple[Passage, float]]]:
        """Top-``n`` passages (best first, with cosine scores) for each question; one embedding call for all."""
        if n < 1:
            raise RetrospecError(f"number of passages to retrieve must be >= 1, got {n}")
        if any(not q.strip() for q in questions):
            raise RetrospecError("empty question: nothing to retrieve for")
        if not questions:
            return []
        n = min(n, len(self))
        scores, ids = self.index.search(self.embed(questions), n)  # [q, n], [q, n]
        return [[(self.passages[i], float(s)) for i, s in zip(row_ids.tolist(), row_scores.tolist()) if i >= 0]
                for row_ids, row_scores in zip(ids, scores)]

    def search(self, question: str, n: int) -> list[tuple[Passage, float]]:
        """Top-``n`` passages for ``question``, best first (n is clipped to the index size)."""
        return self.search_many([question], n)[0]


_CACHE: dict[tuple[str, int, str], PassageIndex] = {}


def load_index(path: str | Path, *, embedder: Any = None) -> PassageIndex:
    """Open (or reuse) the index at ``path`` after checking that ``embedder`` (default: the bundled MiniLM, or a
    directory, or an ``Embedder``) is the one it was built with."""
    path = Path(path).expanduser()
    meta = load_meta(path, kind=KIND)
    model = load_embedder(embedder)
    ident = embedder_identity(model)
    _check_embedder(meta, path, ident)
    key = (str(path.resolve()), (path / META_FILE).stat().st_mtime_ns, ident["name"])
    hit = _CACHE.get(key)
    if hit is not None:
        return hit if hit.embedder is model else replace(hit, embedder=model)
    import faiss

    try:
        index = faiss.read_index(str(path / INDEX_FILE))
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or ["unreadable"])[-1]
        raise RetrospecError(f"corrupt RAG index {path}: {INDEX_FILE} cannot be read ({first[:200]})") from None
    try:
        passages = read_passages(path / PASSAGES_FILE)
    except RetrospecError as exc:
        raise RetrospecError(f"corrupt RAG index {path}: {exc}") from None
    recorded = (meta.get("counts") or {}).get("passages")
    if index.ntotal != len(passages) or recorded != len(passages):
        raise RetrospecError(f"corrupt RAG index {path}: {INDEX_FILE} holds {index.ntotal} vectors, "
                             f"{PASSAGES_FILE} {len(passages)} passages, meta.json records {recorded}; rebuild it")
    if index.d != ident["dim"]:
        raise RetrospecError(f"corrupt RAG index {path}: {INDEX_FILE} holds {index.d}-d vectors, meta.json records "
                             f"{ident['dim']}-d; rebuild it with 'retrospec rag index'")
    loaded = PassageIndex(path, meta, passages, index, model)
    _CACHE[key] = loaded
    return loaded
