"""Corpora for datastores: where the text comes from and how it becomes token-id documents.

Sources (``--corpus``):
- ``stdlib`` (= ``stdlib:train``): the zoo's training split of the standard library (``retrospec.train.corpus``);
  ``stdlib:heldout``: the held-out packages (for ``datastore eval``);
- a ``.jsonl`` file: one document per line, from a ``text`` field or ``prompt`` + ``completion``;
- any other file: UTF-8 text, one document (files over ``CHUNK_CHARS`` are cut into documents at line ends);
- a directory: every non-hidden file below it in sorted order, each read as above (non-UTF-8 files skipped).

``--from-generations PROMPTS.jsonl`` gives an in-distribution (ID) corpus: the target's own greedy continuations of
the prompts, decoded in batches (``batched.generate_batch``, the generator of ``retrospec corpus generate``; each
row equals plain greedy decoding).
Each such document is prompt + continuation with ``index_from`` at the continuation: dense stores index only the
keys whose drafts are the target's own tokens (the paper's "response" datastore); suffix stores keep every token.

Invariant: documents come out in a deterministic order, so the same corpus gives the same store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..errors import RetrospecError

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

    def __iter__(self) -> Iterator[str]:
        if self.texts is not None:
            yield from self.texts
            return
        for f in self.files or []:
            yield from _read_file(f, skip_bad=True)

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.files or [])


def _read_jsonl(path: Path) -> list[str]:
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
                texts.append(row["text"])
            elif (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                  and isinstance(row.get("completion"), str)):
                texts.append(row["prompt"] + row["completion"])
            else:
                raise RetrospecError(f"{path}:{n}: each line needs a string 'text', or 'prompt' and 'completion'")
    return texts


def _read_file(path: Path, skip_bad: bool = False) -> Iterator[str]:
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
                yield chunk + rest
    except UnicodeDecodeError:
        if skip_bad:
            return
        raise RetrospecError(f"corpus file is not UTF-8 text: {path}") from None


def open_text_corpus(spec: str) -> TextCorpus:
    """Resolve ``--corpus``; raises ``RetrospecError`` for a missing or empty source."""
    from ..train.corpus import read_texts, stdlib_files, stdlib_root

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
        texts = _read_jsonl(path)
        if not texts:
            raise RetrospecError(f"corpus file has no documents: {path}")
        return TextCorpus(f"jsonl {path} ({len(texts)} documents)", texts=texts)
    if path.stat().st_size == 0:
        raise RetrospecError(f"corpus file is empty: {path}")
    return TextCorpus(f"text file {path}", files=[path])


def tokenize(texts: Iterable[str], tokenizer, *, total: int | None = None, batch: int = 64,
             progress: bool = True) -> Iterator[TokenDoc]:
    """Encode texts in batches (no special tokens); empty documents are dropped."""
    bar = tqdm(total=total, desc="tokenize", unit="doc", disable=not progress, dynamic_ncols=True)
    buf: list[str] = []

    def flush():
        for enc in tokenizer(buf, add_special_tokens=False, verbose=False)["input_ids"]:
            if enc:
                yield TokenDoc(np.asarray(enc, dtype=np.int32))
        bar.update(len(buf))
        buf.clear()

    for text in texts:
        if text.strip():
            buf.append(text)
        if len(buf) >= batch:
            yield from flush()
    if buf:
        yield from flush()
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


GENERATIONS_FILE = "generations.jsonl"


def generation_documents(prompts_path: str | Path, target, *, max_new_tokens: int = 128, batch_size: int = 32,
                         progress: bool = True) -> tuple[list[TokenDoc], list[dict], str]:
    """The target's own greedy continuations of the prompts in a jsonl file (``prompt`` field per line).

    ``target`` is a ``LoadedModel`` with a tokenizer. Prompts are decoded ``batch_size`` at a time with one KV cache
    (``batched.generate_batch``: each row equals one-at-a-time greedy decoding), shortest first. Rows that already
    carry ``prompt_ids`` and ``completion_ids`` from the same target (``target`` fingerprint) and
    ``max_new_tokens`` - the ``generations.jsonl`` a previous ID build saved in its store - are reused instead of
    generated again. Returns the documents, the rows to save, and a description."""
    from ..batched import generate_batch
    from ..bench.tasks import load_prompts
    from .store import model_identity

    if target.tokenizer is None:
        raise RetrospecError(f"--from-generations needs a target with a tokenizer ({target.path} has none)")
    prompts = load_prompts(prompts_path)
    fingerprint = model_identity(target.model)["fingerprint"]
    eos = target.eos_ids()
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    limit = target.max_positions or 1 << 30
    entries: list[tuple[dict, list[int], list[int] | None]] = []  # (row, prompt ids, completion or None = to do)
    reused = 0
    for row in prompts:
        if (row.get("target") == fingerprint and row.get("max_new_tokens") == max_new_tokens
                and isinstance(row.get("prompt_ids"), list) and isinstance(row.get("completion_ids"), list)):
            entries.append((row, [int(i) for i in row["prompt_ids"]], [int(i) for i in row["completion_ids"]]))
            reused += 1
            continue
        ids = target.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        if ids and len(ids) < limit:
            entries.append((row, list(ids), None))
    todo = sorted((i for i, e in enumerate(entries) if e[2] is None), key=lambda i: len(entries[i][1]))
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", disable=not progress, dynamic_ncols=True)
    for k in range(0, len(todo), batch_size):
        batch = todo[k:k + batch_size]
        room = min(max_new_tokens, limit - max(len(entries[i][1]) for i in batch))  # positions left in the model
        res = generate_batch(target.model, [entries[i][1] for i in batch], max_new_tokens=room, eos_ids=eos,
                             pad_id=pad)
        for i, out in zip(batch, res.tokens):
            if out and out[-1] in eos:
                out = out[:-1]  # the document separator (EOS) is added by the builders
            entries[i] = (entries[i][0], entries[i][1], out)
        bar.update(len(batch))
    bar.close()
    docs: list[TokenDoc] = []
    rows: list[dict] = []
    generated = 0
    for row, ids, out in entries:
        generated += len(out)
        docs.append(TokenDoc(np.asarray(ids + out, dtype=np.int32), index_from=len(ids)))
        rows.append({"prompt": row["prompt"], "prompt_ids": ids, "completion_ids": out, "target": fingerprint,
                     "max_new_tokens": max_new_tokens})
    if not docs:
        raise RetrospecError(f"no usable prompts in {prompts_path}")
    desc = (f"greedy generations of {target.path} on {len(docs)} prompts from {prompts_path} "
            f"(max {max_new_tokens} new tokens, batched {batch_size}, {generated} generated tokens"
            + (f", {reused} reused from the file" if reused else "") + ")")
    return docs, rows, desc


def save_generations(rows: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
