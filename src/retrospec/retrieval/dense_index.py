"""The DReSD datastore: the target's hidden states as keys, the tokens that followed as values (Gritta, Xue,
Lampouras, "DReSD: Dense Retrieval for Speculative Decoding", Findings of ACL 2025).

Entry i of a store built from documents x_0 .. x_{n-1}:
- key: h_t, the target's last-layer hidden state at position t (exactly what ``Verifier`` hands the drafter), the
  state whose logits predicted x_{t+1};
- value: ``values[i] = [x_{t+1}, ..., x_{t+1+N}]`` (int32, 1 + N columns, N = ``value_len``), EOS-padded past the
  end of the document. DReSD keeps a neighbour only if column 0 equals the last committed token, and drafts 1..N.

Keys go through one ``KeyTransform`` (z-normalisation -> PCA -> L2 normalisation), fitted on a sample of up to
``pca_sample`` positions at build time, saved in ``transform.npz`` and applied unchanged to every query, so build
and query vectors live in the same space (tested). Unit vectors make inner product = cosine similarity.

Index (``index.faiss``): ``flat`` (exact), ``hnsw`` or ``ivf``; ``auto`` picks flat up to ``FLAT_MAX`` entries.

Memory: hidden states are computed in batches of windows (``window`` tokens with ``overlap`` tokens of carried
context) into RAM, or into a memory-mapped scratch file when n x H x 4 bytes exceeds ``memory_budget_mb``; values
go straight to a memory-mapped ``values.npy``; keys are added to FAISS in chunks. At query time ``values.npy`` is
memory-mapped, and so is the index when it is larger than the budget (where FAISS can).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..atomic import atomic_build
from ..errors import RetrospecError
from ..models.files import first_line
from .corpus import TokenDoc
from .store import load_meta, write_meta

VALUES_FILE = "values.npy"
INDEX_FILE = "index.faiss"
TRANSFORM_FILE = "transform.npz"
FLAT_MAX = 100_000
INDEX_KINDS = ("auto", "flat", "hnsw", "ivf")
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 64, 64
IVF_NPROBE = 16


class KeyTransform:
    """x [n, H] -> ((x - mean) / std - pca_mean) @ components.T -> L2-normalised [n, D] float32."""

    def __init__(self, mean: np.ndarray, std: np.ndarray, pca_mean: np.ndarray | None,
                 components: np.ndarray | None, explained: float | None = None):
        self.mean = mean.astype(np.float32)  # [H]
        self.std = std.astype(np.float32)  # [H]
        self.pca_mean = None if pca_mean is None else pca_mean.astype(np.float32)  # [H]
        self.components = None if components is None else components.astype(np.float32)  # [D, H]
        self.explained = explained

    @property
    def out_dim(self) -> int:
        return int((self.mean if self.components is None else self.components).shape[0])

    @classmethod
    def fit(cls, sample: np.ndarray, dims: int, seed: int = 0) -> "KeyTransform":
        """``sample`` [s, H] float32 (modified in place). ``dims`` 0 or >= H: z-norm + L2 only."""
        from sklearn.decomposition import PCA

        n, h = sample.shape
        total, total_sq = np.zeros(h), np.zeros(h)
        for i in range(0, n, 65_536):  # float64 moments chunk by chunk: no n x H float64 temporaries
            chunk = sample[i : i + 65_536].astype(np.float64)
            total += chunk.sum(0)
            total_sq += np.square(chunk).sum(0)
        mean64 = total / n
        std = np.sqrt(np.maximum(total_sq / n - mean64**2, 0.0)).clip(min=1e-6).astype(np.float32)
        mean = mean64.astype(np.float32)
        if dims <= 0 or dims >= h or n <= dims:
            return cls(mean, std, None, None)
        for i in range(0, n, 65_536):  # z-normalise in place
            sample[i : i + 65_536] -= mean
            sample[i : i + 65_536] /= std
        pca = PCA(n_components=dims, svd_solver="covariance_eigh", random_state=seed, copy=False).fit(sample)
        return cls(mean, std, pca.mean_, pca.components_, float(pca.explained_variance_ratio_.sum()))

    def apply(self, x: np.ndarray) -> np.ndarray:
        z = (np.asarray(x, dtype=np.float32) - self.mean) / self.std  # [n, H]
        if self.components is not None:
            z = (z - self.pca_mean) @ self.components.T  # [n, D]
        z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(z, dtype=np.float32)

    def save(self, path: Path) -> None:
        arrays = {"mean": self.mean, "std": self.std}
        if self.components is not None:
            arrays |= {"pca_mean": self.pca_mean, "components": self.components}
        with path.open("wb") as fh:
            np.savez(fh, **arrays)

    @classmethod
    def load(cls, path: Path) -> "KeyTransform":
        with np.load(path) as z:
            return cls(z["mean"], z["std"], z.get("pca_mean"), z.get("components"))


# ---------------------------------------------------------------------------------------------------------------------
# build


def _key_range(doc: TokenDoc) -> tuple[int, int]:
    """Positions t whose keys are stored: t < n - 1 (some token follows), and the draft a key serves
    (x_{t+2}, ...) starts inside the indexed part (t + 2 >= index_from). For an ID document that includes the
    position that produced the last prompt token: the decode loop's first query."""
    return max(doc.index_from - 2, 0), len(doc.ids) - 1


def _windows(n: int, window: int, overlap: int, lo: int, hi: int):
    """(start, end, keep_from) windows whose outputs [keep_from, min(end, hi)) cover key positions [lo, hi) of a
    document of n tokens; every kept position sees at least ``overlap`` earlier tokens (or the document start)."""
    start = max(0, min(lo - overlap, hi - window))
    keep_from = lo
    while keep_from < hi:
        end = min(n, start + window)
        yield start, end, keep_from
        keep_from, start = end, end - overlap


@torch.inference_mode()
def hidden_states(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] token ids -> [B, T, H] float32 last-layer hidden states (the definition the Verifier uses)."""
    kwargs = {"input_ids": ids, "output_hidden_states": True, "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the values are the corpus tokens; skip the full LM head
    return model(**kwargs).hidden_states[-1].float()


def _encode(model, docs: list[TokenDoc], bases: list[int], out: np.ndarray, *, window: int, overlap: int,
            batch_tokens: int, pad_id: int, progress: bool) -> None:
    """Fill ``out[base_d + t - lo_d] = h_t`` for every stored key position of every document, in batches."""
    device = next(model.parameters()).device
    total = sum(max(0, hi - lo) for lo, hi in map(_key_range, docs))
    bar = tqdm(total=total, desc="hidden states", unit="pos", unit_scale=True, disable=not progress, dynamic_ncols=True)
    batch: list[tuple[np.ndarray, int, int, int]] = []  # (ids, keep offset in window, keep count, out row)

    def run():
        width = max(len(b[0]) for b in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for i, (w, _, _, _) in enumerate(batch):
            ids[i, : len(w)] = torch.from_numpy(w.astype(np.int64))
        h = hidden_states(model, ids.to(device)).cpu().numpy()  # [B, width, H]; right padding is never attended
        for i, (_, off, cnt, row) in enumerate(batch):
            out[row : row + cnt] = h[i, off : off + cnt]
            bar.update(cnt)
        batch.clear()

    for doc, base in zip(docs, bases):
        lo, hi = _key_range(doc)
        for start, end, keep_from in _windows(len(doc.ids), window, overlap, lo, hi):
            cnt = min(end, hi) - keep_from
            batch.append((doc.ids[start:end], keep_from - start, cnt, base + keep_from - lo))
            if sum(len(b[0]) for b in batch) >= batch_tokens:
                run()
    if batch:
        run()
    bar.close()


def _fill_values(docs: list[TokenDoc], bases: list[int], values: np.ndarray, eos_id: int) -> None:
    width = values.shape[1]  # 1 + N
    for doc, base in zip(docs, bases):
        lo, hi = _key_range(doc)
        if hi <= lo:
            continue
        padded = np.concatenate([doc.ids.astype(np.int32), np.full(width, eos_id, dtype=np.int32)])
        win = np.lib.stride_tricks.sliding_window_view(padded, width)  # [n + 1, 1 + N]; row t = x_t ..
        values[base : base + hi - lo] = win[lo + 1 : hi + 1]


def _make_index(kind: str, dim: int, n: int, train: np.ndarray):
    import faiss

    if kind == "auto":
        kind = "flat" if n <= FLAT_MAX else "hnsw"
    if kind == "flat":
        return faiss.IndexFlatIP(dim), {"index": "flat"}
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return index, {"index": "hnsw", "M": HNSW_M, "ef_construction": HNSW_EF_CONSTRUCTION,
                       "ef_search": HNSW_EF_SEARCH}
    if kind == "ivf":
        nlist = int(max(1, min(4 * np.sqrt(n), n // 39)))
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(train)
        return index, {"index": "ivf", "nlist": nlist, "nprobe": min(IVF_NPROBE, nlist)}
    raise RetrospecError(f"unknown index type {kind!r}; choose one of {', '.join(INDEX_KINDS)}")


def build_dense_store(model: torch.nn.Module, docs: Iterable[TokenDoc], out: str | Path, *, tokenizer_info: dict,
                      target_info: dict, corpus: dict, value_len: int = 20, pca_dims: int = 64,
                      pca_sample: int = 1_000_000, index: str = "auto", window: int = 512, overlap: int = 128,
                      batch_tokens: int = 8192, memory_budget_mb: float = 2048, seed: int = 0,
                      overwrite: bool = False, progress: bool = True, extra_files: dict | None = None) -> dict:
    """Write a DReSD store to ``out`` atomically; returns its meta."""
    if value_len < 1 or pca_dims < 0 or pca_sample < 1 or window < 2 or not 0 <= overlap < window:
        raise RetrospecError("need value_len >= 1, pca_dims >= 0, pca_sample >= 1, window >= 2, 0 <= overlap < window")
    if index not in INDEX_KINDS:
        raise RetrospecError(f"unknown index type {index!r}; choose one of {', '.join(INDEX_KINDS)}")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    window = min(window, max_pos) if max_pos else window
    overlap = min(overlap, window // 2)
    started = time.perf_counter()
    eos_id = int(tokenizer_info["eos_id"])
    docs = [d for d in docs if len(d.ids) >= 2]
    sizes = [max(0, hi - lo) for lo, hi in map(_key_range, docs)]
    bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
    n = int(bases[-1])
    if n == 0:
        raise RetrospecError("the corpus has no positions to index (documents need at least 2 tokens)")
    hidden = int(model.config.hidden_size)
    on_disk = n * hidden * 4 > memory_budget_mb * 2**20
    with atomic_build(out, overwrite=overwrite) as tmp:
        values = np.lib.format.open_memmap(tmp / VALUES_FILE, mode="w+", dtype=np.int32, shape=(n, 1 + value_len))
        _fill_values(docs, bases, values, eos_id)
        values.flush()
        del values
        scratch = tmp / "hidden.f32.scratch"
        raw = (np.memmap(scratch, dtype=np.float32, mode="w+", shape=(n, hidden)) if on_disk
               else np.empty((n, hidden), dtype=np.float32))  # [n, H] on disk or in RAM
        _encode(model, docs, bases[:-1], raw, window=window, overlap=overlap, batch_tokens=batch_tokens,
                pad_id=eos_id, progress=progress)
        rng = np.random.default_rng(seed)
        sample_idx = np.sort(rng.choice(n, size=min(n, pca_sample), replace=False))
        transform = KeyTransform.fit(np.asarray(raw[sample_idx], dtype=np.float32), pca_dims, seed)
        transform.save(tmp / TRANSFORM_FILE)
        train = transform.apply(raw[sample_idx[:: max(1, len(sample_idx) // 100_000)]])
        faiss_index, index_params = _make_index(index, transform.out_dim, n, train)
        del train
        chunk = 65_536
        with tqdm(total=n, desc=f"index ({index_params['index']})", unit="vec", unit_scale=True,
                  disable=not progress, dynamic_ncols=True) as bar:
            for i in range(0, n, chunk):
                faiss_index.add(transform.apply(raw[i : i + chunk]))
                bar.update(min(chunk, n - i))
        del raw
        scratch.unlink(missing_ok=True)
        import faiss

        faiss.write_index(faiss_index, str(tmp / INDEX_FILE))
        params = {"value_len": value_len, "pca_dims": transform.out_dim if transform.components is not None else 0,
                  "pca_requested": pca_dims, "pca_sample": int(len(sample_idx)),
                  "pca_explained_variance": transform.explained, "key_dim": transform.out_dim, "window": window,
                  "overlap": overlap, "batch_tokens": batch_tokens, "seed": seed, "memory_budget_mb": memory_budget_mb,
                  "scratch_memmap": on_disk, "metric": "inner product on L2-normalised keys (cosine)"} | index_params
        counts = {"entries": n, "documents": len(docs), "tokens": int(sum(len(d.ids) for d in docs)),
                  "max_token_id": int(max(int(d.ids.max()) for d in docs))}
        meta = {"kind": "dense", "tokenizer": tokenizer_info, "target": target_info, "params": params,
                "corpus": corpus, "counts": counts}
        return write_meta(tmp, meta, started, extra_files)


# ---------------------------------------------------------------------------------------------------------------------
# query


class DenseStore:
    """A loaded DReSD store: transform, FAISS index and memory-mapped values."""

    kind = "dense"

    def __init__(self, path: str | Path, meta: dict | None = None, memory_budget_mb: int = 2048):
        import faiss

        self.path = Path(path)
        self.meta = meta if meta is not None else load_meta(self.path, kind="dense")
        params = self.meta["params"]
        try:
            self.transform = KeyTransform.load(self.path / TRANSFORM_FILE)
            self.values = np.load(self.path / VALUES_FILE, mmap_mode="r")  # [n, 1 + N] int32
            index_path = str(self.path / INDEX_FILE)
            self.index = None
            if (self.path / INDEX_FILE).stat().st_size > memory_budget_mb * 2**20:
                with contextlib.suppress(RuntimeError):  # an index type FAISS cannot memory-map: read it whole
                    self.index = faiss.read_index(index_path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
            if self.index is None:
                self.index = faiss.read_index(index_path)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise RetrospecError(f"corrupt datastore {self.path}: {first_line(exc)}") from None
        if self.index.ntotal != self.values.shape[0] or self.index.d != self.transform.out_dim:
            raise RetrospecError(f"corrupt datastore {self.path}: index, values and transform disagree")
        if params.get("index") == "hnsw":
            faiss.downcast_index(self.index).hnsw.efSearch = params.get("ef_search", HNSW_EF_SEARCH)
        elif params.get("index") == "ivf":
            faiss.extract_index_ivf(self.index).nprobe = params.get("nprobe", IVF_NPROBE)
        self.value_len = int(self.values.shape[1]) - 1
        self.eos_id = int(self.meta["tokenizer"]["eos_id"])

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def search(self, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``hidden`` [q, H] raw hidden states -> (similarities [q, k], entry ids [q, k]; -1 = no result)."""
        q = self.transform.apply(np.atleast_2d(hidden))  # [q, D]
        return self.index.search(q, min(k, len(self)))
