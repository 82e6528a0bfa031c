"""Passages and questions for Speculative RAG (Wang et al., "Speculative RAG: Enhancing Retrieval Augmented
Generation through Drafting", ICLR 2025), read from JSONL, and a fixed train / eval split of the questions.

Formats (one JSON object per line; blank lines are skipped)::

    passages:  {"id": str | int, "title": str (optional, default ""), "text": str}
    questions: {"id": str | int, "question": str, "answers": [str, ...] (may be empty), "gold_passage": optional}

Invariants:
- Readers return records in file order, with ids as ``str`` (JSON ints are converted), unique within a file.
- Every malformed input (missing file, not a file, a line that is not a JSON object, a missing or empty required
  field, a duplicate id, an empty file) is refused with one ``RetrospecError`` line naming the file and line.
- ``split_of`` depends only on the question id (SHA-1), so the split is the same on every machine and in every
  run: about 25 % of ids are "eval", and eval questions are never used for training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RetrospecError

SPLITS = ("train", "eval", "all")


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    def as_text(self) -> str:
        """What gets embedded and shown to a model: the title on its own line, then the text."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]
    gold_passage: str | None = None


def _records(path: str | Path, what: str) -> list[tuple[str, dict[str, Any]]]:
    """(location, object) per non-blank line; location is ``"FILE line N"`` for error messages."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RetrospecError(f"{what} file not found: {p}")
    if not p.is_file():
        raise RetrospecError(f"{what} path is not a file: {p}")
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{p} line {lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RetrospecError(f"{where}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict):
                    raise RetrospecError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                rows.append((where, obj))
    except UnicodeDecodeError:
        raise RetrospecError(f"{what} file {p} is not UTF-8 text") from None
    except OSError as exc:
        raise RetrospecError(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
    if not rows:
        raise RetrospecError(f"{what} file {p} is empty")
    return rows


def _id(obj: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    v = obj.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)) or not str(v).strip():
        raise RetrospecError(f"{where}: field '{key}' must be a non-empty string or integer, got {v!r}"
                             if key in obj else f"{where}: missing field '{key}'")
    return str(v)


def _str(obj: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    v = obj.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str):
        raise RetrospecError(f"{where}: field '{key}' must be a string, got {type(v).__name__}"
                             if key in obj else f"{where}: missing field '{key}'")
    if required and not v.strip():
        raise RetrospecError(f"{where}: field '{key}' is empty")
    return v


def _title(obj: dict[str, Any], where: str) -> str:
    t = _str(obj, "title", where, required=False)
    return t if t.strip() else ""


def _answers(obj: dict[str, Any], where: str) -> tuple[str, ...]:
    v = obj.get("answers")
    if "answers" not in obj:
        raise RetrospecError(f"{where}: missing field 'answers' (a list of strings; [] when unknown)")
    ok = isinstance(v, list) and all(isinstance(a, (str, int, float)) and not isinstance(a, bool) and str(a).strip()
                                     for a in v)
    if not ok:
        raise RetrospecError(f"{where}: field 'answers' must be a list of non-empty strings, got {v!r}"[:300])
    return tuple(str(a) for a in v)


def _unique(items: Sequence[Any], wheres: Sequence[str]) -> None:
    first: dict[str, str] = {}
    for item, where in zip(items, wheres):
        if item.id in first:
            raise RetrospecError(f"{where}: duplicate id {item.id!r} (first at {first[item.id]})")
        first[item.id] = where


def read_passages(path: str | Path) -> list[Passage]:
    """Passages from JSONL (id, title optional, text), in file order."""
    rows = _records(path, "passages")
    out = [Passage(id=_id(o, "id", w), title=_title(o, w), text=_str(o, "text", w)) for w, o in rows]
    _unique(out, [w for w, _ in rows])
    return out


def read_questions(path: str | Path) -> list[Question]:
    """Questions from JSONL (id, question, answers, gold_passage optional), in file order."""
    rows = _records(path, "questions")
    out = [Question(id=_id(o, "id", w), question=_str(o, "question", w), answers=_answers(o, w),
                    gold_passage=_id(o, "gold_passage", w, required=False)) for w, o in rows]
    _unique(out, [w for w, _ in rows])
    return out


def write_passages(passages: Iterable[Passage], path: str | Path) -> None:
    """Write passages back as JSONL (the format ``read_passages`` reads)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n")


def split_of(qid: str) -> str:
    """``"eval"`` for about a quarter of ids (SHA-1 of the id, mod 4 == 0), ``"train"`` for the rest."""
    return "eval" if int(hashlib.sha1(qid.encode()).hexdigest(), 16) % 4 == 0 else "train"


def select(questions: Sequence[Question], split: str = "all", limit: int | None = None,
           offset: int = 0) -> list[Question]:
    """The questions of ``split`` in file order, skipping the first ``offset`` of them, at most ``limit``."""
    if split not in SPLITS:
        raise RetrospecError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if offset < 0:
        raise RetrospecError(f"offset must be >= 0, got {offset}")
    if limit is not None and limit < 0:
        raise RetrospecError(f"limit must be >= 0, got {limit}")
    chosen = [q for q in questions if split == "all" or split_of(q.id) == split][offset:]
    return chosen if limit is None else chosen[:limit]
