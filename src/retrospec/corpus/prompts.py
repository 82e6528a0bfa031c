"""Prompt sources for a corpus of the target's own outputs: what the target is asked to write.

Sources (``parse_sources``: a comma-separated list of ``name`` or ``name=ARG``):

- ``mbpp=PATH``: HumanEval-format rows, raw code completion, except the first ``MBPP_HELDOUT`` rows (the benches');
- ``nq=PATH``: NQ-open questions of the **train split only** (``rag.data.split_of``), each one chat user message;
- ``stdlib[=N]``: up to N (default 2,000) function openings from the standard library's train split (the 30 lines
  before a ``def`` and the ``def`` line), raw continuation;
- ``self-instruct=N``: N instructions the target writes itself (Magpie: the chat template up to the user's turn),
  each then answered as a chat prompt;
- ``tasks=N``: N instructions the target writes itself from the opening words of a task (``TASK_OPENERS``, in turn:
  writing, questions, summaries, translations, arithmetic, rewriting, lists, advice ...), each then answered as a
  chat prompt. Magpie's unseeded instructions are mostly requests for advice or lists; these cover the task kinds
  chat users also ask for, with the text to work on (the passage to summarise, the sentence to translate) written by
  the target too.

Invariant: rows come out in a deterministic order for the same arguments (the corpus is resumable by shard index),
interleaved across sources, so a corpus stopped after any shard holds every source in proportion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import RetrospecError
from ..speculative_rag.data import read_questions, split_of
from ..stdlib_corpus import read_texts, stdlib_files
from ..tasks import load_prompts

SOURCES = ("mbpp", "nq", "stdlib", "self-instruct", "tasks")
WRITTEN = ("self-instruct", "tasks")  # sources whose instruction the target writes (from the row's text as opener)
# the opening words of a user's task; the target writes the rest of the instruction (and any text it works on)
TASK_OPENERS = (
    "Write a short story about", "Compose a friendly email to", "Write a four-line poem about",
    "Explain in simple terms how", "Why does", "What is the difference between", "Who was",
    "Summarise the following paragraph in two sentences:\n\n", "Give me a one-line summary of this text:\n\n",
    "Translate this sentence into French:", "Translate the following into Spanish:",
    "Translate into German:", "What does this sentence mean in English:",
    "Calculate", "A shop sells", "Solve this problem step by step:", "How many",
    "Rewrite this sentence to sound more formal:", "Correct the grammar in this sentence:",
    "List five", "Give three examples of", "Describe", "Compare", "What are the main causes of",
    "How do I", "Suggest a name for", "Classify the following as positive or negative:",
    "Write a short product description for", "Explain the meaning of the word", "Plan a one-day trip to",
)
STDLIB_DEFAULT = 2000
MBPP_HELDOUT = 100  # MBPP rows 0..99 stay out of every corpus (benches read them)
CONTEXT_LINES = 30
_DEF = re.compile(r"^\s*(async\s+)?def \w+\(")


@dataclass(frozen=True)
class PromptRow:
    source: str  # one of SOURCES
    text: str  # the prompt; for self-instruct and tasks, the opening words of the instruction the target writes first
    chat: bool  # one user message under the chat template, or a raw completion


def parse_sources(spec: str) -> list[tuple[str, str | None]]:
    """``"mbpp=PATH,stdlib=500,self-instruct=200"`` -> [(name, arg), ...]; unknown names are a user error."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, arg = part.partition("=")
        if name not in SOURCES:
            raise RetrospecError(f"unknown prompt source {name!r}; sources: {', '.join(SOURCES)} "
                                 "(mbpp=PATH, nq=PATH, stdlib[=N], self-instruct=N, tasks=N)")
        if name in ("mbpp", "nq") and not arg:
            raise RetrospecError(f"prompt source {name} needs a file: {name}=PATH")
        if name in ("stdlib",) + WRITTEN and arg and not (arg.isdigit() and int(arg) > 0):
            raise RetrospecError(f"prompt source {name} takes a count >= 1, got {arg!r}")
        if name in WRITTEN and not arg:
            raise RetrospecError(f"prompt source {name} needs a count: {name}=N")
        out.append((name, arg or None))
    if not out:
        raise RetrospecError("no prompt sources given (e.g. --sources mbpp=PATH,stdlib,self-instruct=500)")
    return out


def stdlib_openings(limit: int) -> list[str]:
    """Function openings from the stdlib's train split: the lines before a ``def`` and the ``def`` line."""
    candidates = []
    for text in read_texts(stdlib_files("train")):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if _DEF.match(line) and line.rstrip().endswith(":") and i >= 3:
                candidates.append("\n".join(lines[max(0, i - CONTEXT_LINES): i + 1]) + "\n")
    step = max(1, len(candidates) // limit) if candidates else 1
    return candidates[::step][:limit]


def load_rows(sources: list[tuple[str, str | None]], limit: int | None = None) -> list[PromptRow]:
    """Every prompt row of the sources, in order; at most ``limit`` per source when given."""
    per_source: list[list[PromptRow]] = []
    for name, arg in sources:
        if name in ("mbpp", "nq") and not Path(arg).is_file():
            raise RetrospecError(f"{name} prompt file {arg} does not exist")
        if name == "mbpp":
            rows = [PromptRow("mbpp", r["prompt"], False) for r in load_prompts(arg)[MBPP_HELDOUT:]]
        elif name == "nq":
            rows = [PromptRow("nq", q.question.strip(), True) for q in read_questions(arg)
                    if q.question.strip() and split_of(q.id) == "train"]
        elif name == "stdlib":
            rows = [PromptRow("stdlib", t, False) for t in stdlib_openings(int(arg or STDLIB_DEFAULT))]
        elif name == "tasks":
            rows = [PromptRow("tasks", TASK_OPENERS[k % len(TASK_OPENERS)], True) for k in range(int(arg))]
        else:
            rows = [PromptRow("self-instruct", "", True)] * int(arg)
        per_source.append(rows[:limit])
    rows = interleave(per_source)
    if not rows:
        raise RetrospecError("the prompt sources hold no usable prompts")
    return rows


def interleave(groups: list[list[PromptRow]]) -> list[PromptRow]:
    """Round-robin over the groups, each spread evenly over the whole order (a group of 100 among 1,000 rows
    lands every 10th row)."""
    keyed = [((k + 0.5) / len(g), gi, row) for gi, g in enumerate(groups) for k, row in enumerate(g)]
    return [row for _, _, row in sorted(keyed, key=lambda t: (t[0], t[1]))]
