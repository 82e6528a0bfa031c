"""Offline, seeded long-context tasks for RAPID and its baselines (``retrospec tasks make``).

Every row has ``context`` (the long document), ``prompt`` (the query, written so that a base LM continues with the
answer), ``answers`` (accepted answer strings), ``completion`` (the reference continuation of the prompt, used to
train the zoo's long-context target; None for ``repo``) and bookkeeping: ``task``, ``id``, ``length`` (the requested
size), ``context_tokens`` (measured with the target tokenizer), ``depth`` (relative position of the needle, when
there is one) and ``seed``. The requested size is the size of the whole target prompt: the context is filled up to
``length`` minus the query's tokens minus a small margin for the template.

- ``kv``: a JSON object of UUID -> UUID pairs (one per line); the query names one key. (Lost-in-the-middle kv
  retrieval.)
- ``passkey``: a five-digit pass key hidden in repeated filler text. (Landmark attention's passkey test.)
- ``facts``: a haystack of synthetic fact documents about invented people (city, job, colour, pet); the query
  asks one attribute of one person.
- ``repo``: repository-level code completion. The context is files of one held-out standard-library package
  (``stdlib_corpus.HELDOUT_PACKAGES``, never seen in zoo training), in path order; the query is the in-file prefix
  of a function from another file of the same package (preceding lines, header and docstring); the answer is the
  function body's first line.

Scoring (``score``): an output is correct when it contains one of the answers (after stripping whitespace around
the answer); for ``repo`` the first non-empty generated line must equal the answer line (exact match).
Generators are deterministic given (kind, length, n, seed, tokenizer).
"""

from __future__ import annotations

import ast
import functools
import json
import uuid
from collections.abc import Callable

import numpy as np

from ..errors import RetrospecError
from ..stdlib_corpus import HELDOUT_PACKAGES, stdlib_files, stdlib_root

TASKS = ("kv", "passkey", "facts", "repo")
MARGIN = 16  # tokens left for the template around context and query

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n")
FIRST = ("Al", "Bra", "Cor", "Dal", "El", "Fen", "Gar", "Hal", "Is", "Jor", "Kel", "Lor", "Mar", "Nor", "Os",
         "Per", "Quin", "Ros", "Sel", "Tor", "Ul", "Val", "Wen", "Yor", "Zan")
MID = ("a", "e", "i", "o", "u", "ar", "en", "is", "or", "an")
LAST = ("dor", "mir", "wyn", "tha", "ric", "lan", "vos", "dra", "nik", "sel", "bek", "ton")
CITIES = ("Amberfall", "Brightwater", "Coldharbor", "Duskvale", "Eastmere", "Frostholm", "Glenrock", "Highmoor",
          "Ironbridge", "Juniper Bay", "Kingsreach", "Lowfield", "Millbrook", "Northwick", "Oakheart", "Pinecrest",
          "Queensport", "Redcliff", "Stonehaven", "Thornbury", "Umberlee", "Westfall", "Yellowdale", "Zephyr Point")
JOBS = ("baker", "carpenter", "glassblower", "librarian", "navigator", "potter", "tailor", "astronomer", "beekeeper",
        "cartographer", "blacksmith", "gardener", "locksmith", "weaver", "brewer", "bookbinder", "clockmaker",
        "falconer", "mason", "shipwright")
COLOURS = ("amber", "cobalt", "crimson", "emerald", "indigo", "ivory", "lavender", "maroon", "olive", "saffron",
           "scarlet", "silver", "teal", "turquoise", "violet")
PETS = ("cat", "dog", "parrot", "tortoise", "ferret", "rabbit", "goldfish", "hedgehog", "owl", "lizard")

CountFn = Callable[[list[str]], list[int]]


def _counter(tokenizer) -> CountFn:
    def count(texts: list[str]) -> list[int]:
        return [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []

    return count


def _fill(pieces: list[str], sizes: list[int], budget: int) -> int:
    """How many leading pieces fit in ``budget`` tokens (at least one)."""
    total, n = 0, 0
    for s in sizes:
        if total + s > budget and n:
            break
        total += s
        n += 1
    return n


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def _kv(rng, budget: int, count: CountFn) -> dict:
    key, value = _uuid(rng), _uuid(rng)
    prompt = f'Find the value of key "{key}" in the JSON object above.\n"{key}": "'
    budget -= count([prompt])[0]
    probe = [f'  "{_uuid(rng)}": "{_uuid(rng)}",\n' for _ in range(32)]
    per_line = max(1.0, float(np.mean(count(probe))))
    n_pairs = max(2, int(budget / per_line))
    while True:  # shrink until it fits (token counts of random UUIDs vary a little)
        pairs = [(_uuid(rng), _uuid(rng)) for _ in range(n_pairs - 1)]
        i = int(rng.integers(n_pairs))
        pairs.insert(i, (key, value))
        context = "{\n" + ",\n".join(f'  "{k}": "{v}"' for k, v in pairs) + "\n}\n"
        if count([context])[0] <= budget or n_pairs <= 2:
            break
        n_pairs = max(2, int(n_pairs * 0.98))
    return {"context": context, "prompt": prompt, "answers": [value], "completion": f'{value}"',
            "depth": i / max(1, n_pairs - 1)}


def _passkey(rng, budget: int, count: CountFn) -> dict:
    key = str(int(rng.integers(10000, 100000)))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
    prompt = "What is the pass key? The pass key is"
    budget -= count([prompt])[0]
    n_fill = max(1, (budget - count([needle])[0]) // max(1, count([FILLER])[0]))
    while True:
        depth = float(rng.random())
        at = int(round(depth * n_fill))
        context = FILLER * at + needle + FILLER * (n_fill - at)
        if count([context])[0] <= budget or n_fill <= 1:
            break
        n_fill -= max(1, n_fill // 50)
    return {"context": context, "prompt": prompt, "answers": [key], "completion": f" {key}.",
            "depth": at / max(1, n_fill)}


def _person(rng, used: set[str]) -> str:
    while True:
        first = str(rng.choice(FIRST)) + str(rng.choice(MID)) + str(rng.choice(LAST))
        last = str(rng.choice(FIRST)) + str(rng.choice(LAST))
        name = f"{first} {last}"
        if name not in used:
            used.add(name)
            return name


def _fact_doc(i: int, name: str, a: dict) -> str:
    return (f"Document {i}: {name}\n{name} was born in {a['city']}. {name} works as a {a['job']}. "
            f"The favourite colour of {name} is {a['colour']}. {name} has a pet {a['pet']}.\n\n")


QUESTIONS = {
    "city": ("In which city was {n} born?", "{n} was born in"),
    "job": ("What does {n} work as?", "{n} works as a"),
    "colour": ("What is the favourite colour of {n}?", "The favourite colour of {n} is"),
    "pet": ("What pet does {n} have?", "{n} has a pet"),
}


def _facts(rng, budget: int, count: CountFn) -> dict:
    used: set[str] = set()
    budget -= 40  # room for the question (about 25 tokens), which is drawn after the haystack
    docs, people = [], []
    per_doc = None
    total = 0
    while True:
        name = _person(rng, used)
        a = {"city": str(rng.choice(CITIES)), "job": str(rng.choice(JOBS)), "colour": str(rng.choice(COLOURS)),
             "pet": str(rng.choice(PETS))}
        doc = _fact_doc(len(docs) + 1, name, a)
        per_doc = count([doc])[0]
        if total + per_doc > budget and docs:
            break
        docs.append(doc)
        people.append((name, a))
        total += per_doc
    while count(["".join(docs)])[0] > budget and len(docs) > 1:
        docs.pop()
        people.pop()
    i = int(rng.integers(len(people)))
    name, attrs = people[i]
    field = str(rng.choice(sorted(QUESTIONS)))
    question, stem = (s.replace("{n}", name) for s in QUESTIONS[field])
    prompt = f"Question: {question}\nAnswer: {stem}"
    return {"context": "".join(docs), "prompt": prompt, "answers": [attrs[field]], "completion": f" {attrs[field]}.",
            "depth": i / max(1, len(docs) - 1)}


@functools.lru_cache(maxsize=1)
def _package_sources() -> dict[str, list[tuple[str, str]]]:
    """Held-out package name -> [(relative path, source)], read once per process (treat as read-only)."""
    root = stdlib_root()
    out: dict[str, list[tuple[str, str]]] = {}
    for path in stdlib_files("heldout"):
        rel = path.relative_to(root)
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.setdefault(rel.parts[0] if len(rel.parts) > 1 else rel.stem, []).append((rel.as_posix(), text))
    return out


@functools.lru_cache(maxsize=256)
def _functions(source: str) -> list[tuple[int, int, str]]:
    """(first line index of the body, header line index, first body line) for documented multi-statement functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) >= 3:
            if ast.get_docstring(node) is None or node.body[0].end_lineno is None:
                continue
            body_line = lines[node.body[1].lineno - 1].strip()
            if len(body_line) >= 8:
                out.append((node.body[0].end_lineno, node.lineno - 1, body_line))
    return out


def _repo(rng, budget: int, count: CountFn, prefix_lines: int = 12) -> dict:
    packages = _package_sources()
    names = sorted(p for p in packages if p in HELDOUT_PACKAGES)
    sizes = {p: sum(len(t) for _, t in packages[p]) for p in names}
    big = [p for p in names if sizes[p] / 3.0 > budget] or [max(names, key=sizes.get)]
    pkg = str(rng.choice(big))
    files = packages[pkg]
    candidates = [(path, text, f) for path, text in files for f in _functions(text)]
    if not candidates:
        raise RetrospecError(f"no completable functions in held-out package {pkg}")
    def query(c) -> str:
        path, text, (body_start, header, _) = c
        lines = text.splitlines(keepends=True)
        return f"# file: {path}\n" + "".join(lines[max(0, header - prefix_lines): body_start])

    # a function whose in-file prefix (the query) takes at most a quarter of the budget
    order = [int(j) for j in rng.permutation(len(candidates))][:64]
    sizes = count([query(candidates[j]) for j in order])
    fitting = [j for j, n in zip(order, sizes) if n <= budget // 4]
    pick = fitting[0] if fitting else order[int(np.argmin(sizes))]
    path, text, (body_start, header, answer) = candidates[pick]
    prompt = query(candidates[pick])
    budget -= count([prompt])[0]
    others = [(p, t) for p, t in files if p != path]
    order = rng.permutation(len(others))
    chosen, total = [], 0
    for j in order:
        p, t = others[int(j)]
        block = f"# file: {p}\n{t}\n"
        n = count([block])[0]
        if total + n > budget:
            body = block.splitlines(keepends=True)
            k = _fill(body, count(body), budget - total)
            if k > 1:
                chosen.append((p, "".join(body[:k])))
            break
        chosen.append((p, block))
        total += n
    context = "".join(b for _, b in sorted(chosen))
    return {"context": context, "prompt": prompt, "answers": [answer], "completion": None, "depth": None,
            "source": f"{path}:{header + 1}"}


_MAKERS = {"kv": _kv, "passkey": _passkey, "facts": _facts, "repo": _repo}


def make_tasks(kind: str, context_tokens: int, n: int, seed: int, tokenizer) -> list[dict]:
    """``n`` rows of task ``kind`` whose target prompt is about ``context_tokens`` tokens."""
    if kind not in _MAKERS:
        raise RetrospecError(f"unknown task {kind!r}; available: {', '.join(TASKS)}")
    if context_tokens < 256:
        raise RetrospecError(f"--context-tokens must be >= 256, got {context_tokens}")
    if n < 1:
        raise RetrospecError(f"--n must be >= 1, got {n}")
    from transformers.utils import logging as hf_logging

    count = _counter(tokenizer)
    rows = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # counting tokens of texts longer than the tokenizer's nominal maximum is fine
    try:
        for i in range(n):
            rows.append(_make_row(kind, context_tokens, seed, i, count))
    finally:
        hf_logging.set_verbosity(verbosity)
    return rows


def _make_row(kind: str, context_tokens: int, seed: int, i: int, count: CountFn) -> dict:
    rng = np.random.default_rng([seed, TASKS.index(kind), context_tokens, i])
    row = _MAKERS[kind](rng, context_tokens - MARGIN, count)
    return {"id": f"{kind}-{context_tokens}-{seed}-{i}", "task": kind, **row, "length": context_tokens,
            "context_tokens": count([row["context"]])[0], "seed": seed}


def score(row: dict, output: str) -> bool:
    """Exact match / containment accuracy of one output (see the module docstring)."""
    answers = [a.strip() for a in row.get("answers", []) if a.strip()]
    if not answers:
        return False
    if row.get("task") == "repo":
        first = next((ln.strip() for ln in output.splitlines() if ln.strip()), "")
        return first in answers
    return any(a in output for a in answers)


def write_jsonl(rows: list[dict], path) -> None:
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    tmp.replace(path)
