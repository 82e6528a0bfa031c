"""The benchmark store corpus: one text corpus from which both retrieval stores of a real-model bench (``rest``'s
suffix store and ``dresd``'s dense store) are built, so the two methods are compared on the same data
(``python -m retrospec.bench.store_corpus --out FILE``; then ``retrospec datastore build --corpus FILE``).

Three parts, each filled up to a budget of target tokens (counted with the target's tokenizer, no special tokens
added; the datastore builders add one EOS per document on top):

- ``code``: pieces of the standard library's *training* split (``stdlib_corpus.stdlib_files("train")``; the held-out
  packages never enter). Files are visited in a seeded order; from each, one piece is taken: whole top-level
  ``def``/``class`` blocks (with their decorators) starting at a seeded random block, until ``piece_chars``
  characters (a single longer block is cut at a line end at twice that). Files without a top-level block are
  skipped. The bench's MBPP prompts are completed with top-level functions, hence the block alignment.
- ``passage``: NQ-open passages (``passages.jsonl``), text only, from row ``skip`` on;
- ``chat``: NQ-open questions from row ``skip`` on rendered with the target's chat template as one user turn and
  one assistant turn (``apply_chat_template(..., tokenize=False)``: system prompt, ChatML tokens and all), the
  assistant's reply being the first sentences (up to ``answer_chars`` characters, at least one sentence) of the
  question's gold passage. The bench's chat prompts are answered inside that template, so the template's tokens
  around an answer are part of what retrieval has to match.

Leakage: the bench uses the first rows of NQ-open (questions 0..skip-1 and their gold passages). No passage of
those rows is used, nor any later passage with the same text or the same article title as one of them; passages
and chat turns use disjoint rows.

Invariants: deterministic for a given seed, tokenizer, NQ-open files and interpreter (the stdlib is the running
interpreter's); documents come out code first, then passages, then chat turns. Each jsonl row has ``text`` (what
``datastore build --corpus`` reads) plus ``source``, ``ref`` (stdlib path or NQ id) and ``tokens``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from ..atomic import write_text_atomic
from ..errors import RetrospecError
from ..speculative_rag.data import Passage, Question, read_passages, read_questions

DEFAULT_NQ_DIR = "../shared/data/nq_open"  # relative to the repository root, where the bench commands run
_TOP_LEVEL = ("def ", "class ", "async def ")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def code_piece(text: str, rng: random.Random, piece_chars: int) -> str | None:
    """Whole top-level blocks from a seeded random one until ``piece_chars`` characters; None without blocks."""
    lines = text.splitlines(keepends=True)
    starts = []
    for i, line in enumerate(lines):
        if line.startswith(_TOP_LEVEL):
            while i > 0 and lines[i - 1].startswith("@"):  # decorators belong to the block
                i -= 1
            if not starts or starts[-1] != i:
                starts.append(i)
    if not starts:
        return None
    k = rng.randrange(len(starts))
    ends = starts[k + 1 :] + [len(lines)]
    out, size = [], 0
    for a, b in zip(starts[k:], ends):
        block = "".join(lines[a:b])
        if out and size + len(block) > piece_chars:
            break
        if len(block) > 2 * piece_chars:  # one very long block: cut at a line end
            cut = block.rfind("\n", 0, 2 * piece_chars)
            block = block[: cut + 1] if cut > 0 else block[: 2 * piece_chars]
        out.append(block)
        size += len(block)
        if size >= piece_chars:
            break
    piece = "".join(out).rstrip() + "\n"
    return piece if piece.strip() else None


def first_sentences(text: str, max_chars: int) -> str:
    """The leading sentences of ``text`` that fit in ``max_chars`` (always at least the first sentence)."""
    sentences = _SENTENCE_END.split(text.strip())
    out = sentences[0]
    for s in sentences[1:]:
        if len(out) + 1 + len(s) > max_chars:
            break
        out += " " + s
    return out


def build_store_corpus(tokenizer, *, nq_dir: str | Path = DEFAULT_NQ_DIR, code_tokens: int = 35_000,
                       passage_tokens: int = 17_500, chat_tokens: int = 17_500, skip: int = 200, seed: int = 0,
                       piece_chars: int = 2400, answer_chars: int = 320, stdlib_texts: list[tuple[str, str]] | None
                       = None) -> list[dict]:
    """The corpus rows (see the module docstring). ``stdlib_texts``: (ref, text) pairs instead of the stdlib's
    training split (tests)."""
    from ..stdlib_corpus import stdlib_files, stdlib_root

    for name, v in (("code_tokens", code_tokens), ("passage_tokens", passage_tokens), ("chat_tokens", chat_tokens),
                    ("skip", skip)):
        if v < 0:
            raise RetrospecError(f"{name} must be >= 0, got {v}")
    if chat_tokens and not getattr(tokenizer, "chat_template", None):
        raise RetrospecError("chat turns need a tokenizer with a chat template (or chat_tokens=0)")

    rng = random.Random(seed)
    rows: list[dict] = []

    def row(text: str, source: str, ref: str) -> dict:
        return {"text": text, "source": source, "ref": ref,
                "tokens": len(tokenizer(text, add_special_tokens=False)["input_ids"])}

    def take(items, budget: int, make) -> None:
        """Rows ``make(item)`` (None: skip the item) appended until ``budget`` tokens are used."""
        used = 0
        for item in items:
            if used >= budget:
                break
            r = make(item)
            if r is not None:
                rows.append(r)
                used += r["tokens"]

    def code_row(item) -> dict | None:
        ref, src = item
        if isinstance(src, Path):
            try:
                src = src.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                return None
        piece = code_piece(src, rng, piece_chars)
        return None if piece is None else row(piece, "code", ref)

    if stdlib_texts is None:
        root = stdlib_root()
        files = stdlib_files("train")
        rng.shuffle(files)
        stdlib_texts = ((p.relative_to(root).as_posix(), p) for p in files)
    take(stdlib_texts, code_tokens, code_row)
    if not (passage_tokens or chat_tokens):
        return rows

    # NQ-open: passages and chat turns from disjoint rows >= skip, away from the bench's rows
    nq = Path(nq_dir)
    if not (nq / "passages.jsonl").is_file():
        raise RetrospecError(f"NQ-open file not found: {nq / 'passages.jsonl'} (pass --nq-dir, e.g. {DEFAULT_NQ_DIR})")
    passages = read_passages(nq / "passages.jsonl")
    by_id = {p.id: p for p in passages}
    held_texts = {p.text for p in passages[:skip]}
    held_titles = {p.title for p in passages[:skip]} - {""}
    usable = [p for p in passages[skip:] if p.text not in held_texts and p.title not in held_titles and p.text.strip()]
    usable_ids = {p.id for p in usable}
    rng.shuffle(usable)
    taken: set[str] = set()

    def chat_row(q: Question) -> dict | None:
        pid = q.gold_passage
        if pid not in usable_ids or pid in taken or not q.question.strip():
            return None
        taken.add(pid)
        answer = first_sentences(by_id[pid].text, answer_chars)
        return row(tokenizer.apply_chat_template([{"role": "user", "content": q.question},
                                                  {"role": "assistant", "content": answer}], tokenize=False),
                   "chat", q.id)

    def passage_row(p: Passage) -> dict | None:
        if p.id in taken:
            return None
        taken.add(p.id)
        return row(p.text, "passage", p.id)

    if chat_tokens:
        questions = read_questions(nq / "questions.jsonl")[skip:]
        rng.shuffle(questions)
        take(questions, chat_tokens, chat_row)
    take(usable, passage_tokens, passage_row)
    rows.sort(key=lambda r: ("code", "passage", "chat").index(r["source"]))  # stable: keeps each part's order
    return rows


def write_store_corpus(out: str | Path, tokenizer, **kwargs) -> dict:
    """Write the corpus to ``out`` (jsonl, atomically); returns the summary."""
    rows = build_store_corpus(tokenizer, **kwargs)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    parts = {s: [r["tokens"] for r in rows if r["source"] == s] for s in dict.fromkeys(r["source"] for r in rows)}
    return {"documents": len(rows), "tokens": sum(r["tokens"] for r in rows),
            "parts": {s: {"documents": len(t), "tokens": sum(t)} for s, t in parts.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m retrospec.bench.store_corpus",
                                description="write the benchmark store corpus (stdlib code + NQ-open prose and chat "
                                            "turns) as jsonl with a 'text' field, for 'retrospec datastore build'")
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--target", default="smollm2-135m", help="model directory or name whose tokenizer counts tokens "
                                                            "and renders the chat turns (default smollm2-135m)")
    p.add_argument("--nq-dir", default=DEFAULT_NQ_DIR, help=f"NQ-open directory (default {DEFAULT_NQ_DIR})")
    p.add_argument("--code-tokens", type=int, default=35_000)
    p.add_argument("--passage-tokens", type=int, default=17_500)
    p.add_argument("--chat-tokens", type=int, default=17_500)
    p.add_argument("--skip", type=int, default=200, help="NQ-open rows kept out (the bench's questions)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        from ..models import model_dir
        from ..models.loading import _load_tokenizer

        path = model_dir(args.target)
        tokenizer = _load_tokenizer(path) if path.is_dir() else None
        if tokenizer is None:
            raise RetrospecError(f"{args.target} ({path}) has no tokenizer files")
        summary = write_store_corpus(args.out, tokenizer, nq_dir=args.nq_dir, code_tokens=args.code_tokens,
                                     passage_tokens=args.passage_tokens, chat_tokens=args.chat_tokens,
                                     skip=args.skip, seed=args.seed)
    except RetrospecError as exc:
        print(f"retrospec: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "target": args.target, "seed": args.seed} | summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
