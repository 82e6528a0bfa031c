"""Token-aware chunking of a long context (RAPID: Chen, Feng, Ni, Li, Shieh, ICML 2025, section 3.1).

A chunk is a contiguous span of the text holding at most ``max_tokens`` tokens (RAPID's default: 512 target
tokens). Lines are packed greedily so that chunks end at line boundaries whenever a line fits; a single longer line
is cut at token boundaries.

Invariants (tested):
- ``"".join(c.text for c in chunks) == text``: chunks tile the text in order, without gaps or overlaps;
- ``chunks[i].index == i`` and ``chunks[i].start == chunks[i - 1].end`` (character offsets);
- ``chunk.tokens <= max_tokens``, counted on the chunk's own text (a BPE tokenizer may merge across a line break).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

CountFn = Callable[[Sequence[str]], list[int]]  # texts -> token count of each text


@dataclass(frozen=True)
class Chunk:
    index: int  # position among the chunks of the document (document order)
    start: int  # character offset of the first character in the document
    end: int  # character offset one past the last character
    text: str
    tokens: int  # token count of ``text`` under the chunking tokenizer


def token_counter(tokenizer) -> CountFn:
    """A ``CountFn`` for a Hugging Face tokenizer (no special tokens), batched."""

    def count(texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    return count


def _split_long_line(line: str, tokenizer, max_tokens: int) -> list[str]:
    """Cut one over-long line at token boundaries using the tokenizer's character offsets (fast tokenizers)."""
    enc = tokenizer(line, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    pieces, begin = [], 0
    for k in range(max_tokens, len(offsets), max_tokens):
        cut = offsets[k][0]
        if cut > begin:
            pieces.append(line[begin:cut])
            begin = cut
    pieces.append(line[begin:])
    return [p for p in pieces if p]


def _split_by_chars(line: str, count: CountFn, max_tokens: int) -> list[str]:
    """Fallback for counters without offsets: halve the line until every piece fits."""
    if len(line) <= 1 or count([line])[0] <= max_tokens:
        return [line]
    mid = len(line) // 2
    return _split_by_chars(line[:mid], count, max_tokens) + _split_by_chars(line[mid:], count, max_tokens)


def chunk_text(text: str, tokenizer=None, max_tokens: int = 512, count: CountFn | None = None) -> list[Chunk]:
    """Split ``text`` into chunks of at most ``max_tokens`` tokens (``tokenizer`` or an explicit ``count``)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if count is None:
        if tokenizer is None:
            raise ValueError("chunk_text needs a tokenizer or a count function")
        count = token_counter(tokenizer)
    if not text:
        return []
    lines = text.splitlines(keepends=True)
    sizes = count(lines)
    units: list[tuple[str, int]] = []  # (text, tokens), each at most max_tokens
    for line, n in zip(lines, sizes):
        if n <= max_tokens:
            units.append((line, n))
            continue
        try:
            parts = _split_long_line(line, tokenizer, max_tokens) if tokenizer is not None else None
        except (TypeError, KeyError, NotImplementedError):  # slow tokenizers have no offset mapping
            parts = None
        parts = parts or _split_by_chars(line, count, max_tokens)
        units.extend(zip(parts, count(parts)))

    chunks: list[Chunk] = []
    buf: list[str] = []
    buf_tokens = 0
    pos = 0

    def flush() -> None:
        nonlocal buf, buf_tokens, pos
        if not buf:
            return
        body = "".join(buf)
        n = count([body])[0]
        if n > max_tokens and len(buf) > 1:  # BPE merged across line breaks: move the last unit out
            last = buf.pop()
            flush()
            buf, buf_tokens = [last], count([last])[0]
            flush()
            return
        chunks.append(Chunk(len(chunks), pos, pos + len(body), body, n))
        pos += len(body)
        buf, buf_tokens = [], 0

    for unit, n in units:
        if buf and buf_tokens + n > max_tokens:
            flush()
        buf.append(unit)
        buf_tokens += n
    flush()
    return chunks
