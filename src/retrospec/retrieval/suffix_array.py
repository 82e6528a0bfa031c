"""The REST datastore: a token corpus and its suffix array (He et al., "REST: Retrieval-Based Speculative
Decoding", NAACL 2024).

Files in the store directory:
- ``tokens.bin``: the corpus token ids as big-endian int32 (``>i4``), every document followed by one EOS.
  Big-endian makes byte order equal token order, so the binary search compares ``bytes`` slices of the memory map.
- ``sa.npy``: the suffix array [T] (int32 when T < 2**31, else int64), built by libdivsufsort (``pydivsufsort``).

Search (``SuffixStore.search``): the longest suffix of the context, from ``max_suffix`` (16) down to ``min_suffix``
(2) tokens, that occurs in the corpus. Occurrence is monotone in the suffix length, so the longest length is found
by bisection over m, each probe a binary search over the suffix array: O(log(max_suffix) * log T) comparisons.

Continuations (``SuffixStore.continuations``): the next ``length`` tokens after up to ``max_samples`` occurrences.
In the suffix-array range of a match, occurrences are sorted by what follows them, so equal continuations are
contiguous; a larger range is sampled at evenly spaced ranks (deterministic, counts proportional to the true
frequencies). A continuation stops after an EOS (the rest is padded with -1). Unique continuations come back sorted
by count, ties by suffix-array rank: same store + same context -> same tree (``tree.frequency_trie``).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..errors import RetrospecError
from .corpus import TokenDoc
from ..atomic import atomic_build
from .store import load_meta, write_meta

TOKENS_FILE = "tokens.bin"
SA_FILE = "sa.npy"
TOKEN_DTYPE = np.dtype(">i4")


@dataclass(frozen=True)
class Match:
    length: int  # matched suffix length (tokens)
    lo: int  # suffix-array range [lo, hi) of the occurrences
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[T] suffix array of an integer token array (libdivsufsort; int32 when T < 2**31)."""
    from pydivsufsort import divsufsort

    sa = divsufsort(np.ascontiguousarray(tokens))
    return sa.astype(np.int32 if len(tokens) < 2**31 else np.int64, copy=False)


def write_tokens(docs: Iterable[TokenDoc], path: Path, eos_id: int) -> dict:
    """Stream documents to ``path`` as big-endian int32, each followed by EOS. Returns counts."""
    n_tokens = n_docs = 0
    max_id = eos_id
    eos = np.asarray([eos_id], dtype=TOKEN_DTYPE)
    with path.open("wb") as fh:
        for d in docs:
            ids = np.asarray(d.ids)
            if ids.size == 0:
                continue
            if ids.min() < 0 or ids.max() >= 2**31:
                raise RetrospecError("token ids must be in [0, 2**31)")
            fh.write(ids.astype(TOKEN_DTYPE).tobytes())
            fh.write(eos.tobytes())
            max_id = max(max_id, int(ids.max()))
            n_tokens += ids.size + 1
            n_docs += 1
    return {"tokens": n_tokens, "documents": n_docs, "max_token_id": max_id}


def build_suffix_store(docs: Iterable[TokenDoc], out: str | Path, *, tokenizer_info: dict, corpus: dict,
                       target_info: dict | None = None, overwrite: bool = False, progress: bool = True,
                       extra_files: dict | None = None) -> dict:
    """Write a REST store to ``out`` atomically; returns its meta."""
    started = time.perf_counter()
    with atomic_build(out, overwrite=overwrite) as tmp:
        counts = write_tokens(docs, tmp / TOKENS_FILE, tokenizer_info["eos_id"])
        if counts["tokens"] == 0:
            raise RetrospecError("the corpus has no tokens")
        tokens = np.fromfile(tmp / TOKENS_FILE, dtype=TOKEN_DTYPE).astype(np.int32)  # [T] native int32
        with tqdm(total=1, desc=f"suffix array ({counts['tokens']:,} tokens)", disable=not progress) as bar:
            np.save(tmp / SA_FILE, suffix_array(tokens))
            bar.update()
        del tokens
        # "target" is informational only: a suffix store depends on the tokenizer, not the model
        params = {"token_dtype": TOKEN_DTYPE.str, "sa_dtype": "int32" if counts["tokens"] < 2**31 else "int64",
                  "suffix_array": "libdivsufsort (pydivsufsort)"}
        meta = {"kind": "suffix", "tokenizer": tokenizer_info, "target": target_info, "params": params,
                "corpus": corpus, "counts": counts}
        return write_meta(tmp, meta, started, extra_files)


class SuffixStore:
    """A loaded REST store: memory-mapped tokens and suffix array; nothing is read until searched."""

    kind = "suffix"

    def __init__(self, path: str | Path, meta: dict | None = None):
        self.path = Path(path)
        self.meta = meta if meta is not None else load_meta(self.path, kind="suffix")
        self.eos_id = int(self.meta["tokenizer"]["eos_id"])
        try:
            self.tokens = np.memmap(self.path / TOKENS_FILE, dtype=TOKEN_DTYPE, mode="r")  # [T]
            self.sa = np.load(self.path / SA_FILE, mmap_mode="r")  # [T]
            with (self.path / TOKENS_FILE).open("rb") as fh:
                self._bytes = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise RetrospecError(f"corrupt datastore {self.path}: {exc}") from None
        if self.sa.shape != self.tokens.shape:
            raise RetrospecError(f"corrupt datastore {self.path}: suffix array and tokens differ in length")
        self.n = int(self.tokens.shape[0])
        # plain-int access to the suffix array without numpy scalar overhead
        self._sa = memoryview(np.ascontiguousarray(self.sa)).cast("B").cast("i" if self.sa.dtype == np.int32 else "q")

    def __len__(self) -> int:
        return self.n

    def _range(self, pattern: bytes) -> tuple[int, int]:
        """Suffix-array range [lo, hi) of the suffixes that start with ``pattern`` (big-endian int32 bytes).
        Two hand-written binary searches: ``bisect`` with a key function is ~30 % slower here."""
        sa, buf, m = self._sa, self._bytes, len(pattern)
        lo, hi = 0, self.n
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) >> 1
            s = sa[mid] << 2
            if buf[s : s + m] < pattern:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, self.n
        while lo < hi:  # first suffix whose first m bytes > pattern
            mid = (lo + hi) >> 1
            s = sa[mid] << 2
            if buf[s : s + m] <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def search(self, context, max_suffix: int = 16, min_suffix: int = 2) -> Match | None:
        """The longest suffix of ``context`` (length max_suffix .. min_suffix) that occurs in the corpus."""
        ctx = np.asarray(context[-max_suffix:], dtype=TOKEN_DTYPE)  # [<= max_suffix]
        top = len(ctx)
        if top < min_suffix:
            return None
        raw = ctx.tobytes()

        def probe(m: int) -> Match | None:
            lo, hi = self._range(raw[4 * (top - m):])
            return Match(m, lo, hi) if hi > lo else None

        best = probe(min_suffix)
        if best is None:
            return None
        lo_m, hi_m = min_suffix + 1, top  # bisection for the largest m with an occurrence
        while lo_m <= hi_m:
            mid = (lo_m + hi_m) >> 1
            found = probe(mid)
            if found is not None:
                best, lo_m = found, mid + 1
            else:
                hi_m = mid - 1
        return best

    def sample(self, match: Match, length: int, max_samples: int = 512) -> np.ndarray:
        """The next ``length`` tokens after up to ``max_samples`` occurrences, [S, length] int32, -1 after an EOS
        or the corpus end. Rows come in suffix-array order, which is lexicographic order of the continuations
        (cutting after EOS keeps it), so equal continuations are adjacent."""
        c = match.count
        if c > max_samples:
            ranks = match.lo + (np.arange(max_samples, dtype=np.int64) * c) // max_samples
        else:
            ranks = np.arange(match.lo, match.hi, dtype=np.int64)
        starts = np.asarray(self.sa[ranks], dtype=np.int64) + match.length  # [S] first continuation position
        cols = starts[:, None] + np.arange(length, dtype=np.int64)  # [S, length]
        toks = np.asarray(self.tokens[np.minimum(cols, self.n - 1)], dtype=np.int32)  # [S, length]
        toks[cols >= self.n] = -1
        is_eos = toks == self.eos_id
        toks[(np.cumsum(is_eos, axis=1) - is_eos) > 0] = -1  # cut after the first EOS
        return toks[toks[:, 0] >= 0]

    def continuations(self, match: Match, length: int, max_samples: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """Unique continuations [U, length] (-1 padded after an EOS or the corpus end) and their counts [U],
        most frequent first, ties by suffix-array rank (stable)."""
        toks = self.sample(match, length, max_samples)
        if toks.shape[0] == 0:
            return np.zeros((0, length), dtype=np.int32), np.zeros(0, dtype=np.int64)
        new = np.ones(len(toks), dtype=bool)  # rows are sorted: a new continuation starts where a row differs
        new[1:] = (toks[1:] != toks[:-1]).any(1)
        first = np.flatnonzero(new)
        counts = np.diff(np.append(first, len(toks)))
        order = np.lexsort((first, -counts))  # count desc, then first suffix-array rank
        return toks[first[order]], counts[order]

