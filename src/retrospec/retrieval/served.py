"""A store that learns from what has been served: finished outputs, indexed by their n-grams, in bounded memory.

REST (He et al., NAACL 2024) drafts from a fixed corpus; SuffixDecoding (Oliaro et al., 2024) showed that the outputs
an engine has already served are the corpus that matters most for repeated agentic and coding workloads. This store
is that corpus, grown one finished output at a time and shared by every request of one engine process.

Layout (LZ77's hash chain over a ring buffer):
- ``tokens`` [capacity] int32: the outputs, each followed by one separator (-1); position g (a global count of tokens
  written) lives in slot ``g % capacity``; the oldest ``capacity`` positions are kept, older ones are overwritten
  (eviction, oldest first).
- ``chain`` [capacity] int64: for the ``min_suffix``-gram ending at position g, the previous position where the same
  n-gram ended (-1: none); ``heads`` maps an n-gram (its bytes) to the most recent position where it ended.
Memory: 12 bytes a kept token, plus ``heads`` (at most ``capacity`` keys: stale keys are dropped when it grows past
that). Nothing is ever read from an overwritten slot: a chain stops at the first n-gram that starts before the window.

Search (``lookup``): the context's last ``min_suffix`` tokens select a chain; up to ``max_hits`` of its most recent
positions are compared backwards with the context (``max_suffix`` tokens at most); the positions sharing the longest
match give their next tokens, and ``majority_chain`` picks the draft from them. Deterministic: the same outputs added
in the same order give the same drafts.
"""

from __future__ import annotations

import numpy as np

SEPARATOR = -1


def majority_chain(rows: np.ndarray, k: int, min_share: float = 0.0) -> list[int]:
    """The most common path through continuations ``rows`` [S, L] (-1 after a continuation's end), at most ``k``
    tokens: at each depth the most frequent next token among the rows that agree so far (ties: the earliest row),
    stopping where fewer than ``min_share * S`` rows still agree or none continues. S = 1 returns the row itself."""
    rows = np.asarray(rows).reshape(len(rows), -1)[:, :k]  # [S, <= k]
    alive = np.ones(len(rows), dtype=bool)  # [S] rows agreeing with the chain so far
    need = min_share * len(rows)
    out: list[int] = []
    for d in range(rows.shape[1]):
        col = rows[alive, d]
        col = col[col >= 0]
        if col.size == 0:
            break
        values, first, counts = np.unique(col, return_index=True, return_counts=True)
        best = int(np.lexsort((first, -counts))[0])  # most frequent, then earliest row
        if counts[best] < need:
            break
        out.append(int(values[best]))
        alive &= rows[:, d] == values[best]
    return out


class ServedStore:
    """Served outputs indexed for drafting (see the module docstring). Not thread-safe: one engine process, one
    caller at a time (vLLM calls its proposer from one thread)."""

    def __init__(self, capacity: int = 1 << 20, *, min_suffix: int = 2, max_suffix: int = 16, max_hits: int = 16,
                 min_share: float = 0.0):
        if capacity < 2 or not 1 <= min_suffix <= max_suffix or max_hits < 1:
            raise ValueError(f"need capacity >= 2, 1 <= min_suffix <= max_suffix and max_hits >= 1, got {capacity}, "
                             f"{min_suffix}, {max_suffix}, {max_hits}")
        self.capacity, self.min_suffix, self.max_suffix = capacity, min_suffix, max_suffix
        self.max_hits, self.min_share = max_hits, min_share
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)  # [capacity] ring of outputs and separators
        self.chain = np.full(capacity, -1, dtype=np.int64)  # [capacity] previous end of the same n-gram
        self.heads: dict[bytes, int] = {}
        self.end = 0  # global positions written
        self.outputs = 0  # outputs added

    def __len__(self) -> int:
        """Positions currently kept (tokens and separators)."""
        return min(self.end, self.capacity)

    @property
    def oldest(self) -> int:
        """The oldest global position still in the ring."""
        return max(0, self.end - self.capacity)

    def add(self, output) -> None:
        """Append one finished output (token ids) and its separator; evicts the oldest positions when full."""
        toks = np.asarray(output, dtype=np.int32).reshape(-1)  # [T]
        toks = toks[-(self.capacity - 1):]  # an output longer than the ring keeps its end
        if toks.size == 0:
            return
        n, cap = self.min_suffix, self.capacity
        start = self.end
        for i, tok in enumerate(toks.tolist()):
            g = start + i
            self.tokens[g % cap] = tok
            self.chain[g % cap] = -1
            if i + 1 >= n:
                key = toks[i + 1 - n : i + 1].tobytes()
                self.chain[g % cap] = self.heads.get(key, -1)
                self.heads[key] = g
        g = start + len(toks)
        self.tokens[g % cap], self.chain[g % cap] = SEPARATOR, -1
        self.end = g + 1
        self.outputs += 1
        if len(self.heads) > cap:  # drop n-grams whose last occurrence has been overwritten
            oldest = self.oldest
            self.heads = {k: v for k, v in self.heads.items() if v >= oldest}

    def _match_length(self, ctx: np.ndarray, g: int) -> int:
        """How many of the context's last tokens equal the kept tokens ending at position g."""
        m = min(len(ctx), g - self.oldest + 1)
        kept = self.tokens[(g - np.arange(m)) % self.capacity]  # [m] backwards from g
        diff = np.flatnonzero(kept != ctx[::-1][:m])
        return int(diff[0]) if diff.size else m

    def lookup(self, context, k: int) -> tuple[int, list[int]]:
        """(matched suffix length, draft of at most k ids) for the context's continuation; (0, []) when the context's
        last ``min_suffix`` tokens were never served."""
        ctx = np.asarray(context[-self.max_suffix:], dtype=np.int32)  # [<= max_suffix]
        if len(ctx) < self.min_suffix or k < 1:
            return 0, []
        g = self.heads.get(ctx[-self.min_suffix:].tobytes(), -1)
        oldest, hits = self.oldest, []  # (match length, end position), most recent first
        while g - self.min_suffix + 1 >= oldest and len(hits) < self.max_hits:  # the whole n-gram still kept
            hits.append((self._match_length(ctx, g), g))
            nxt = int(self.chain[g % self.capacity])
            if nxt >= g:  # a slot rewritten since: its link is not this chain's
                break
            g = nxt
        if not hits:
            return 0, []
        best = max(m for m, _ in hits)
        ends = np.array([g for m, g in hits if m == best], dtype=np.int64)  # [S]
        pos = ends[:, None] + 1 + np.arange(k, dtype=np.int64)  # [S, k]
        rows = self.tokens[pos % self.capacity].astype(np.int64)
        rows[pos >= self.end] = SEPARATOR  # not written yet (would be the ring's oldest tokens)
        rows[np.cumsum(rows == SEPARATOR, axis=1) > 0] = SEPARATOR  # cut at the output's end
        return best, majority_chain(rows, k, self.min_share)
