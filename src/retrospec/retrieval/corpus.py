"""Corpora for datastores: where the text comes from and how it becomes token-id documents.

Sources (``--corpus``):
- ``stdlib`` (= ``stdlib:train``): the zoo's training split of the standard library (``retrospec.stdlib_corpus``);
  ``stdlib:heldout``: the held-out packages (for ``datastore eval``);
- a ``.jsonl`` file: one document per line, from a ``text`` field or ``prompt`` + ``completion`` (the document is
  their concatenation; where the completion starts is kept, for ``datastore eval`` to score completions only);
- any other file: UTF-8 text, one document (files over ``CHUNK_CHARS`` are cut into documents at line ends);
- a directory: every non-hidden file below it in sorted order, each read as above (non-UTF-8 files skipped).
(``--from-generations``, the target's own outputs, lives above retrieval: ``retrospec.corpus.documents``.)

Invariant: documents come out in a deterministic order, so the same corpus gives the same store.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..errors import RetrospecError
from ..stdlib_corpus import read_texts, stdlib_files, stdlib_root

CHUNK_CHARS = 4_000_000


@dataclass
class TokenDoc:
    ids: np.ndarray  # [n] int32 token ids
    index_from: int = 0  # dense stores index the keys whose drafts (x_{t+2}, ...) start at position >= index_from


@dataclass
class TextCorpus:
    description: str
    texts: list[str] | None = None  # in memory (stdlib, jsonl)
    files: list[Path] | None = None  # read lazily (directories, big files)
    starts: list[int] | None = None  # per text: the character where its completion starts (0: no prompt)

    def __iter__(self) -> Iterator[str]:
        for text, _ in self.split():
            yield text

    def split(self) -> Iterator[tuple[str, int]]:
        """(text, start) per document: ``start`` is the character where a prompt + completion row's completion
        begins, 0 for every other document."""
        if self.texts is not None:
            yield from zip(self.texts, self.starts or [0] * len(self.texts))
            return
        for f in self.files or []:
            yield from _read_file(f, skip_bad=True)

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.files or [])


def _read_jsonl(path: Path) -> list[tuple[str, int]]:
    texts = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise RetrospecError(f"{path}:{n}: not valid JSON") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                texts.append((row["text"], 0))
            elif (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                  and isinstance(row.get("completion"), str)):
                texts.append((row["prompt"] + row["completion"], len(row["prompt"])))
            else:
                raise RetrospecError(f"{path}:{n}: each line needs a string 'text', or 'prompt' and 'completion'")
    return texts


def _read_file(path: Path, skip_bad: bool = False) -> Iterator[tuple[str, int]]:
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
        return
    try:
        with path.open(encoding="utf-8") as fh:
            while True:
                chunk = fh.read(CHUNK_CHARS)
                if not chunk:
                    return
                rest = fh.readline()  # finish the line so documents end at line boundaries
                yield chunk + rest, 0
    except UnicodeDecodeError:
        if skip_bad:
            return
        raise RetrospecError(f"corpus file is not UTF-8 text: {path}") from None


def open_text_corpus(spec: str) -> TextCorpus:
    """Resolve ``--corpus``; raises ``RetrospecError`` for a missing or empty source."""
    if spec in ("stdlib", "stdlib:train", "stdlib:heldout"):
        split = "heldout" if spec.endswith("heldout") else "train"
        files = stdlib_files(split)
        return TextCorpus(f"python stdlib ({split} split) at {stdlib_root()}", texts=read_texts(files))
    path = Path(spec).expanduser()
    if not path.exists():
        raise RetrospecError(f"corpus not found: {path} (a file, a directory, a .jsonl file, or 'stdlib')")
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise RetrospecError(f"corpus directory has no files: {path}")
        return TextCorpus(f"directory {path} ({len(files)} files)", files=files)
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path)
        if not rows:
            raise RetrospecError(f"corpus file has no documents: {path}")
        return TextCorpus(f"jsonl {path} ({len(rows)} documents)", texts=[t for t, _ in rows],
                          starts=[s for _, s in rows])
    if path.stat().st_size == 0:
        raise RetrospecError(f"corpus file is empty: {path}")
    return TextCorpus(f"text file {path}", files=[path])


def _first_token_at(offsets: list[tuple[int, int]], start: int) -> int:
    """Index of the first token that begins at or after character ``start`` (a token straddling it is the
    prompt's)."""
    return next((i for i, (a, _) in enumerate(offsets) if a >= start), len(offsets))


def _encode(tokenizer, buf: list[tuple[str, int]]) -> tuple[list[list[int]], list[int]]:
    """(ids, ``index_from``) per (text, start), the texts encoded once: the first token at or after ``start`` from
    the fast tokenizers' character offsets, else (a Python tokenizer) the length of the prompt encoded alone."""
    strings = [t for t, _ in buf]
    if not any(s for _, s in buf):
        return tokenizer(strings, add_special_tokens=False, verbose=False)["input_ids"], [0] * len(buf)
    try:
        enc = tokenizer(strings, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
        return enc["input_ids"], [_first_token_at(o, s) for o, (_, s) in zip(enc["offset_mapping"], buf)]
    except NotImplementedError:
        ids = tokenizer(strings, add_special_tokens=False, verbose=False)["input_ids"]
        return ids, [min(len(tokenizer(t[:s], add_special_tokens=False)["input_ids"]), len(i)) if s else 0
                     for (t, s), i in zip(buf, ids)]


def tokenize(texts: Iterable[str] | Iterable[tuple[str, int]], tokenizer, *, total: int | None = None,
             batch: int = 64, progress: bool = True) -> Iterator[TokenDoc]:
    """Encode texts in batches (no special tokens); empty documents are dropped.

    ``texts`` holds strings (``index_from`` = 0) or ``(text, start)`` pairs (``TextCorpus.split()``): then
    ``index_from`` is the first token that begins at or after character ``start``. The whole text is encoded
    either way, so the ids do not depend on where the completion starts."""
    bar = tqdm(total=total, desc="tokenize", unit="doc", disable=not progress, dynamic_ncols=True)
    pairs = ((t, 0) if isinstance(t, str) else t for t in texts)
    pairs = (p for p in pairs if p[0].strip())
    while buf := list(itertools.islice(pairs, batch)):
        for ids, index_from in zip(*_encode(tokenizer, buf)):
            if ids:
                yield TokenDoc(np.asarray(ids, dtype=np.int32), index_from)
        bar.update(len(buf))
    bar.close()


def limit_tokens(docs: Iterable[TokenDoc], max_tokens: int | None) -> Iterator[TokenDoc]:
    """Stop after ``max_tokens`` tokens (the last document is cut)."""
    if max_tokens is None:
        yield from docs
        return
    left = max_tokens
    for d in docs:
        if left <= 0:
            return
        if len(d.ids) > left:
            d = TokenDoc(d.ids[:left], min(d.index_from, left))
        left -= len(d.ids)
        yield d
