"""A store that learns from what has been served: finished outputs, indexed by their n-grams, in bounded memory.

REST (He et al., NAACL 2024) drafts from a fixed corpus; SuffixDecoding (Oliaro et al., 2024) showed that the outputs
an engine has already served are the corpus that matters most for repeated agentic and coding workloads. This store
is that corpus, grown one finished output at a time and shared by every request of one engine process.

Layout (LZ77's hash chain over a ring buffer):
- ``tokens`` [capacity] int32: a separator (-1), then the outputs, each followed by one separator; position g (a
  global count of tokens written) lives in slot ``g % capacity``; the oldest ``capacity`` positions are kept, older
  ones are overwritten (eviction, oldest first).
- ``chain`` [capacity] int64: for the ``min_suffix``-gram ending at position g, the previous position where the same
  n-gram ended (-1: none); ``heads`` maps an n-gram (its bytes) to the most recent position where it ended. ``chain1``
  and ``heads1`` do the same for single tokens, separators included (a separator is where an output starts).
- ``owner`` [capacity] int64: the number of the output a position belongs to; ``sketches`` [max_sketches, SKETCH]
  uint64: the min-hash sketch of the prompt each of the last ``max_sketches`` outputs answered (where one was given).
Memory: 28 bytes a kept token, 256 bytes a sketch, plus ``heads`` and ``heads1`` (at most ``capacity`` keys each:
stale keys are dropped when one grows past that). Nothing is ever read from an overwritten slot: a chain stops at the
first n-gram that starts before the window.

Search (``candidates``): the query's last ``min_suffix`` tokens select a chain (else its last token, ``chain1``); up to
``max_hits`` of its most recent positions are compared backwards with the query (``max_suffix`` tokens at most).

Voting (``vote_chain``): a draft grown one token at a time, each the weighted vote of every position that matches the
query so far (the request's output, then the draft), as in variable-order context models (PPM): a vote weighs
``VOTE_BASE`` per matched token (up to ``VOTE_CAP``), times 1 + ``SIMILARITY_WEIGHT`` x the similarity of the prompt
its output answered to the request's (min-hash estimate of the Jaccard similarity of their last ``SKETCH_TAIL``
tokens' 3-grams): a question asked again in other words drafts first from its earlier answers. The query starts with a
separator, so an output's first tokens match the starts of served outputs. The positions that voted for the chosen
token move on by one (``follow``: their match grows by one) and vote for the next; the store is searched again only
where none of them goes on or the longest of their matches is under ``REFRESH_BELOW`` tokens (weak evidence: a
shorter suffix may have more to say). Deterministic: the same outputs added in the same order give the same drafts.
"""

from __future__ import annotations

import numpy as np

SEPARATOR = -1
VOTE_BASE = 8.0  # a matching position's vote grows this much per token of match ...
VOTE_CAP = 8  # ... up to this many tokens
REFRESH_BELOW = 4  # search again when the positions followed match fewer tokens than this
SIMILARITY_WEIGHT = 20.0  # a served output's votes count 1 + this x its prompt's similarity to the request's
SKETCH = 32  # min-hashes per prompt sketch
SKETCH_TAIL = 128  # prompt tokens sketched: the end (the question and the chat template's turn)
_HASH = np.random.default_rng(0x5EED).integers(1, 2**63, size=(2, SKETCH), dtype=np.uint64) | np.uint64(1)


def prompt_sketch(prompt) -> np.ndarray:
    """[SKETCH] uint64 min-hashes of the 3-grams of the prompt's last ``SKETCH_TAIL`` tokens (equal entries estimate
    the Jaccard similarity of two prompts' 3-gram sets)."""
    t = np.asarray(prompt[-SKETCH_TAIL:], dtype=np.int64).astype(np.uint64)  # [T]
    grams = t[:-2] * np.uint64(1_000_003 ** 2) + t[1:-1] * np.uint64(1_000_003) + t[2:] if len(t) >= 3 else t  # [G]
    if grams.size == 0:
        return np.full(SKETCH, np.iinfo(np.uint64).max, dtype=np.uint64)
    h = _HASH[0][:, None] * grams[None, :] + _HASH[1][:, None]  # [SKETCH, G], wrapping
    return (h ^ (h >> np.uint64(29))).min(axis=1)


def match_lengths(tokens: np.ndarray, ends: np.ndarray, query: np.ndarray, first: int = 0) -> np.ndarray:
    """How many of ``query``'s last tokens equal ``tokens`` read backwards from each of ``ends`` [C] (positions; read
    at ``position % len(tokens)``, a ring; none below ``first``) -> [C]."""
    width = len(query)
    back = ends[:, None] - np.arange(width)[None, :]  # [C, width]
    same = (back >= first) & (tokens[back % len(tokens)] == query[::-1][None, :])
    return np.where(same.all(axis=1), width, np.argmin(same, axis=1))


def context_candidates(context, max_suffix: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt lookup as votes: (match lengths [C], next tokens [C], positions [C]) of the earlier positions of
    ``context`` that hold its last token, each with the length of the suffix it shares with the context's end (at most
    ``max_suffix``)."""
    ctx = np.asarray(context, dtype=np.int64)  # [L]
    if len(ctx) < 2:
        return (np.zeros(0, dtype=np.int64),) * 3
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])  # [C]
    return match_lengths(ctx, ends, ctx[-max_suffix:]), ctx[ends + 1], ends


def follow_context(context, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``context_candidates``' positions [C] moved on by one (each now holds ``context``'s last token, the one its
    vote chose) -> (positions [C], next tokens [C], continues [C]: a next token exists)."""
    ctx = np.asarray(context, dtype=np.int64)  # [L]
    at = ends + 1
    ok = at + 1 < len(ctx)
    return at, ctx[np.minimum(at + 1, len(ctx) - 1)], ok


def vote_chain(search, follow, k: int, refresh: int = REFRESH_BELOW) -> tuple[list[int], int]:
    """A chain of at most ``k`` tokens grown by vote. ``search(chain) -> (match [C], next [C], factor [C], at [C])``:
    the positions matching the query extended by the chain so far, with the token after each and where each is
    (``at``: opaque here); ``follow(at [C'], chain) -> (at [C'], next [C'], continues [C'])``: those positions moved on
    by one token, the chain's last. Each next token is the one with the largest sum of ``factor x VOTE_BASE **
    min(match, VOTE_CAP)`` (ties: the smallest id); the positions that voted for it follow it (match + 1) and vote
    again, unless none continues or their longest match is under ``refresh`` tokens: then ``search`` again. The chain
    ends where no position continues. Also returns the longest match behind the first token (0: an empty chain).
    ``refresh`` = a huge number searches at every token. A followed match keeps growing past the width a search
    compares (a longer match is more evidence), so the two extremes of ``refresh`` can differ where that width is
    under ``VOTE_CAP``."""
    chain: list[int] = []
    if k < 1:
        return chain, 0
    match, nxt, factor, at = search(chain)
    first_match = int(match.max()) if len(nxt) else 0
    while len(chain) < k and len(nxt):
        if (nxt == nxt[0]).all():  # one token proposed: the vote is that token
            chain.append(int(nxt[0]))
        else:
            votes = factor * VOTE_BASE ** np.minimum(match, VOTE_CAP).astype(np.float64)  # [C]
            tokens, which = np.unique(nxt, return_inverse=True)
            chain.append(int(tokens[np.argmax(np.bincount(which, weights=votes))]))
        if len(chain) == k:
            break
        keep = nxt == chain[-1]
        at, nxt, ok = follow(at[keep], chain)
        match, factor, at, nxt = match[keep][ok] + 1, factor[keep][ok], at[ok], nxt[ok]
        if len(nxt) == 0 or match.max() < refresh:
            match, nxt, factor, at = search(chain)
    return chain, first_match


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
                 max_sketches: int = 4096):
        if capacity < 2 or not 1 <= min_suffix <= max_suffix or max_hits < 1:
            raise ValueError(f"need capacity >= 2, 1 <= min_suffix <= max_suffix and max_hits >= 1, got {capacity}, "
                             f"{min_suffix}, {max_suffix}, {max_hits}")
        self.capacity, self.min_suffix, self.max_suffix = capacity, min_suffix, max_suffix
        self.max_hits = max_hits
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)  # [capacity] ring of outputs and separators
        self.chain = np.full(capacity, -1, dtype=np.int64)  # [capacity] previous end of the same n-gram
        self.heads: dict[bytes, int] = {}
        self.chain1 = np.full(capacity, -1, dtype=np.int64)  # [capacity] previous position of the same token
        self.heads1: dict[int, int] = {}
        self.owner = np.full(capacity, -1, dtype=np.int64)  # [capacity] output number of each position
        self.sketches = np.zeros((max(1, max_sketches), SKETCH), dtype=np.uint64)  # [max_sketches, SKETCH]
        self.sketch_of = np.full(max(1, max_sketches), -1, dtype=np.int64)  # [max_sketches] output number, -1 none
        self.end = 1  # global positions written: a separator first, so every output starts after one
        self.heads1[SEPARATOR] = 0
        self.outputs = 0  # outputs added

    def __len__(self) -> int:
        """Positions currently kept (tokens and separators)."""
        return min(self.end, self.capacity)

    @property
    def oldest(self) -> int:
        """The oldest global position still in the ring."""
        return max(0, self.end - self.capacity)

    def add(self, output, sketch: np.ndarray | None = None) -> None:
        """Append one finished output (token ids) and its separator; evicts the oldest positions when full. ``sketch``:
        the ``prompt_sketch`` of the prompt it answered, kept for ``candidates``' similarity weights."""
        toks = np.asarray(output, dtype=np.int32).reshape(-1)  # [T]
        toks = toks[-(self.capacity - 1):]  # an output longer than the ring keeps its end
        if toks.size == 0:
            return
        n, cap = self.min_suffix, self.capacity
        start = self.end
        for i, tok in enumerate([*toks.tolist(), SEPARATOR]):
            g = start + i
            self.tokens[g % cap], self.chain[g % cap], self.owner[g % cap] = tok, -1, self.outputs
            self.chain1[g % cap] = self.heads1.get(tok, -1)
            self.heads1[tok] = g
            if n <= i + 1 <= len(toks):
                key = toks[i + 1 - n : i + 1].tobytes()
                self.chain[g % cap] = self.heads.get(key, -1)
                self.heads[key] = g
        if sketch is not None:
            row = self.outputs % len(self.sketch_of)
            self.sketches[row], self.sketch_of[row] = sketch, self.outputs
        self.end = start + len(toks) + 1
        self.outputs += 1
        if len(self.heads) > cap:  # drop n-grams whose last occurrence has been overwritten
            self.heads = {key: g for key, g in self.heads.items() if g >= self.oldest}
        if len(self.heads1) > cap:  # ... and tokens
            self.heads1 = {key: g for key, g in self.heads1.items() if g >= self.oldest}

    def _walk(self, chain: np.ndarray, g: int, width: int) -> list[int]:
        """Up to ``max_hits`` positions on a chain from g, most recent first, whose ``width`` tokens are still kept."""
        hits, oldest = [], self.oldest
        while g - width + 1 >= oldest and len(hits) < self.max_hits:
            hits.append(g)
            nxt = int(chain[g % self.capacity])
            if nxt >= g:  # a slot rewritten since: its link is not this chain's
                break
            g = nxt
        return hits

    def candidates(self, query, sketch: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Votes for ``vote_chain``: (match lengths [C], next tokens [C], factors [C], positions [C]) of up to
        ``max_hits`` recent positions holding the query's last ``min_suffix`` tokens (else its last token; a separator
        stands for an output's start), factors 1 + ``SIMILARITY_WEIGHT`` x the similarity of each one's prompt to
        ``sketch``."""
        q = np.asarray(query[-self.max_suffix:], dtype=np.int64)  # [<= max_suffix]
        n = self.min_suffix
        none = np.zeros(0, dtype=np.int64)
        if len(q) == 0:
            return none, none, np.zeros(0), none
        hits = []
        if len(q) >= n and (q[-n:] != SEPARATOR).all():
            hits = self._walk(self.chain, self.heads.get(q[-n:].astype(np.int32).tobytes(), -1), n)
        if not hits:
            hits = self._walk(self.chain1, self.heads1.get(int(q[-1]), -1), 1)
        ends = np.array([g for g in hits if g + 1 < self.end], dtype=np.int64)  # [C] those with a next position
        nxt = self.tokens[(ends + 1) % self.capacity].astype(np.int64)
        ends, nxt = ends[nxt != SEPARATOR], nxt[nxt != SEPARATOR]
        if len(ends) == 0:
            return none, none, np.zeros(0), none
        factor = 1.0 + SIMILARITY_WEIGHT * self.similarity(self.owner[ends % self.capacity], sketch)  # [C]
        return match_lengths(self.tokens, ends, q, self.oldest), nxt, factor, ends

    def follow(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``candidates``' positions [C] moved on by one -> (positions [C], next tokens [C], continues [C]: the next
        token is written and is not a separator). Valid while nothing is added in between."""
        at = ends + 1
        nxt = self.tokens[(at + 1) % self.capacity].astype(np.int64)
        return at, nxt, (at + 1 < self.end) & (nxt != SEPARATOR)

    def similarity(self, outputs: np.ndarray, sketch: np.ndarray | None) -> np.ndarray:
        """[C] estimated similarity of the prompts that ``outputs`` [C] (output numbers) answered to ``sketch``'s; 0
        where either is unknown."""
        if sketch is None:
            return np.zeros(len(outputs))
        rows = outputs % len(self.sketch_of)
        known = self.sketch_of[rows] == outputs
        return (self.sketches[rows] == sketch[None, :]).mean(axis=1) * known
