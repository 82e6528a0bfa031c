"""Retrieval over one long context: the short context C^S that RAPID's drafter reads.

RAPID (Chen, Feng, Ni, Li, Shieh, ICML 2025) splits the long context C into chunks of 512 target tokens, embeds
them, and keeps the chunks most similar to the query, in their original order, up to a retrieval length bounded
below by 4096 tokens and above by 1/24 of the context.

Here (``RetrievalConfig``):
- chunks: ``chunk_tokens`` target tokens each (default 512), see ``chunks.chunk_text``;
- scores: cosine similarity between the query (the user prompt) and the chunk's best piece of at most
  ``piece_tokens`` embedder tokens (default 64, about a line): an embedder reads a bounded number of its own tokens
  (MiniLM: 256), so nothing in a chunk is invisible and a needle is not averaged away by the rest of its chunk (on
  the bundled tasks: needles retrieved at 8K tokens from 1/3 to 2/3 (kv) and 3/3 (fact QA) over whole chunks);
- floor: chunks scoring below ``similarity_floor`` (default 0.3) are never retrieved;
- budget: ``retrieval_tokens`` when given, else ``clamp(max_fraction * context, min_tokens, context)``; the
  defaults (1024, 1/24) keep C^S short for the 1K-32K contexts of the bundled tasks (the paper's 4096 is meant for
  100K-token contexts);
- selection: chunks in descending score order, each taken if it still fits the budget, then put back in document
  order and joined; two chunks that were not adjacent in C are separated by a newline unless one already ends it.

Invariants (tested): retrieved tokens <= budget; every retrieved chunk scores >= floor; document order is kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import RetrospecError
from .chunks import Chunk, chunk_text
from .embedder import Embedder, load_embedder


@dataclass(frozen=True)
class RetrievalConfig:
    chunk_tokens: int = 512
    similarity_floor: float = 0.3
    retrieval_tokens: int | None = None  # an explicit budget; None = from the two bounds below
    min_tokens: int = 1024  # lower bound of the automatic budget (paper: 4096)
    max_fraction: float = 1 / 24  # the automatic budget is this share of the context when that is larger (paper)
    piece_tokens: int | None = 64  # embedder tokens per scored piece (None: as many as the embedder reads)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise RetrospecError(f"chunk tokens must be >= 1, got {self.chunk_tokens}")
        if not -1.0 <= self.similarity_floor <= 1.0:
            raise RetrospecError(f"similarity floor must be a cosine in [-1, 1], got {self.similarity_floor}")
        if self.retrieval_tokens is not None and self.retrieval_tokens < 1:
            raise RetrospecError(f"retrieval tokens must be >= 1, got {self.retrieval_tokens}")
        if self.min_tokens < 0 or not 0.0 < self.max_fraction <= 1.0:
            raise RetrospecError("retrieval bounds need min_tokens >= 0 and 0 < max_fraction <= 1")
        if self.piece_tokens is not None and self.piece_tokens < 8:
            raise RetrospecError(f"piece tokens must be >= 8, got {self.piece_tokens}")

    def budget(self, context_tokens: int) -> int:
        """Retrieval length in target tokens for a context of ``context_tokens``."""
        if self.retrieval_tokens is not None:
            return min(self.retrieval_tokens, context_tokens)
        return min(context_tokens, max(self.min_tokens, math.ceil(self.max_fraction * context_tokens)))


@dataclass
class Retrieved:
    text: str  # the retrieved chunks joined in document order
    chunks: list[Chunk]  # the retrieved chunks, document order
    scores: list[float]  # their similarities, same order
    tokens: int  # target tokens in the retrieved chunks
    budget: int
    context_tokens: int
    total_chunks: int
    seconds: float
    all_scores: list[float] = field(default_factory=list)  # similarity of every chunk, document order


def join_chunks(chunks: list[Chunk]) -> str:
    parts: list[str] = []
    for i, c in enumerate(chunks):
        if i and chunks[i - 1].index + 1 != c.index and not parts[-1].endswith("\n"):
            parts.append("\n")
        parts.append(c.text)
    return "".join(parts)


def select_chunks(chunks: list[Chunk], scores: np.ndarray, budget: int, floor: float) -> list[int]:
    """Indices of the chunks to keep (document order): best first while they fit, never below ``floor``."""
    order = sorted(range(len(chunks)), key=lambda i: (-float(scores[i]), i))
    chosen, used = [], 0
    for i in order:
        if float(scores[i]) < floor:
            break
        if used + chunks[i].tokens <= budget:
            chosen.append(i)
            used += chunks[i].tokens
    return sorted(chosen)


class LongContextRetriever:
    """Chunk (target tokenizer) -> embed (sentence embedder) -> select (floor, budget) -> join (document order)."""

    def __init__(self, tokenizer, embedder: Embedder | str | None = None, config: RetrievalConfig | None = None):
        if tokenizer is None:
            raise RetrospecError("retrieval needs the target's tokenizer to count chunk tokens")
        self.tokenizer = tokenizer
        self.embedder = load_embedder(embedder)
        self.config = config or RetrievalConfig()

    def score(self, chunks: list[Chunk], query: str) -> np.ndarray:
        """[n_chunks] cosine similarity of each chunk (its best embedder-sized piece) to the query."""
        if not chunks:
            return np.zeros(0, dtype=np.float32)
        limit = max(8, min(int(self.embedder.max_tokens), self.config.piece_tokens or 1 << 30))
        pieces: list[str] = []
        owner: list[int] = []
        for c in chunks:
            for piece in chunk_text(c.text, count=self.embedder.count, max_tokens=limit):
                if piece.text.strip():
                    pieces.append(piece.text)
                    owner.append(c.index)
        q = self.embedder.encode([query])[0]  # [d]
        sims = self.embedder.encode(pieces) @ q if pieces else np.zeros(0)  # [n_pieces]
        best = np.full(len(chunks), -1.0, dtype=np.float32)
        np.maximum.at(best, np.asarray(owner, dtype=np.int64), sims.astype(np.float32))
        return best

    def retrieve(self, context: str, query: str) -> Retrieved:
        t0 = time.perf_counter()
        cfg = self.config
        chunks = chunk_text(context, self.tokenizer, cfg.chunk_tokens)
        n_ctx = sum(c.tokens for c in chunks)
        budget = cfg.budget(n_ctx)
        scores = self.score(chunks, query)
        keep = select_chunks(chunks, scores, budget, cfg.similarity_floor)
        picked = [chunks[i] for i in keep]
        return Retrieved(text=join_chunks(picked), chunks=picked, scores=[float(scores[i]) for i in keep],
                         tokens=sum(c.tokens for c in picked), budget=budget, context_tokens=n_ctx,
                         total_chunks=len(chunks), seconds=time.perf_counter() - t0,
                         all_scores=[float(s) for s in scores])
