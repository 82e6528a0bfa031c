"""``pld``: prompt lookup decoding (Saxena, 2023), the n-gram drafter Hugging Face ships as
``prompt_lookup_num_tokens``.

The longest suffix n-gram of the committed tokens (n from ``max_ngram`` down to ``min_ngram``) is searched for
earlier in prompt + output; the ``k`` tokens after its most recent earlier occurrence are the draft. A match closer
than ``k`` to the end copies overlapping itself (as LZ77 does), so a period-d repetition continues for all ``k``
tokens. Deterministic, no probabilities (one-hot q): lossless at any temperature.
"""

from __future__ import annotations

import numpy as np

from ..types import DraftTree
from .base import DecodeContext, chain_room
from .registry import Knob, MethodSpec, gamma_knob, register


def lookup(tokens: np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest matching suffix n-gram, or []."""
    return lookup_match(tokens, k, max_ngram, min_ngram)[1]


def lookup_match(tokens: np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, list[int]]:
    """(n, draft): the matched suffix n-gram's length and ``lookup``'s draft; (0, []) without a match."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        pattern = tokens[n_tok - n :]
        # candidate starts s with s + n <= n_tok - 1 (the match must be strictly earlier than the suffix)
        hay = tokens[: n_tok - 1]
        if len(hay) < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(hay, n)  # [n_tok - n, n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = n_tok - start  # distance from the match's continuation to the end, >= 1
            if period >= k:
                return n, tokens[start : start + k].tolist()
            cycle = tokens[start:].tolist()  # overlapping copy: the continuation repeats with this period
            return n, [cycle[i % period] for i in range(k)]
    return 0, []


class PromptLookupDrafter:
    name = "pld"
    needs: frozenset[str] = frozenset()

    def __init__(self, k: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        self.k = k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._buf = np.zeros(0, dtype=np.int64)
        self._n = 0

    def prefill(self, ctx: DecodeContext) -> None:
        self._buf = np.zeros(max(64, 2 * len(ctx.tokens)), dtype=np.int64)
        self._n = 0

    def state_bytes(self) -> int:
        """Bytes of the token buffer searched for n-grams (a copy of the committed tokens, with room to grow)."""
        return int(self._buf.nbytes)

    def _sync(self, tokens: list[int]) -> np.ndarray:
        """Append newly committed tokens to a growing numpy buffer (no per-step full conversion)."""
        n = len(tokens)
        if n > len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros(n * 2 - len(self._buf), dtype=np.int64)])
        if n > self._n:
            self._buf[self._n : n] = tokens[self._n :]
        self._n = n
        return self._buf[:n]

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        k = chain_room(ctx, min(self.k, budget))
        if k <= 0:
            return DraftTree.empty()
        cont = lookup(self._sync(ctx.tokens), k, self.max_ngram, self.min_ngram)
        return DraftTree.chain(cont) if cont else DraftTree.empty()

    def observe(self, accepted: int, drafted: int) -> None:
        pass


def _make_pld(*, gamma: int = 10, max_ngram: int = 3) -> PromptLookupDrafter:
    return PromptLookupDrafter(k=gamma, max_ngram=max_ngram)


SPEC = register(MethodSpec("pld", _make_pld, "n-gram match in the prompt and output",
                           knobs=(gamma_knob(10), Knob("max_ngram", "int", 3, "longest n-gram matched", min=1, max=32)),
                           default_gamma=10))
