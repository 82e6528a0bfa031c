"""Prompt and task rows, one module: prompt rows (jsonl files, presets) and long-context rows (``retrospec tasks
make``). Data, not a benchmark: the bench, the corpus of the target's outputs and training all read it.

Prompt rows.

A jsonl file needs a ``prompt`` or a ``question`` field per line (HumanEval / MBPP files and NQ-open question files
work as they are); every returned row has ``prompt`` set (a ``question`` row gets ``prompt = question``, other
fields kept). Presets need no external data:
- ``heldout``: function headers + docstrings generated deterministically from the standard library's held-out
  packages (never seen in zoo training), for raw code completion;
- ``chat``: ``presets/chat.jsonl``, short instructions and questions written for this project (explain, summarise,
  list, rewrite, how-to, general knowledge, a few code requests), meant for ``--chat`` (one user message each);
- ``chat-tasks``: ``presets/chat-tasks.jsonl``, 25 chat prompts of five task kinds (instructions, QA, summarisation,
  translation, maths; 5 each, interleaved by kind), held out from every training corpus;
- ``lcc`` (long code completion, as in LongSpec's and MagicDec's evaluations): plain continuation of 4K-7K target
  tokens of held-out package source; ``lcc-8k`` / ``lcc-16k`` / ``lcc-32k``: the same at a fixed length (for the
  ``zoo`` target, whose context is 64K). See ``lcc_prompts``.

Long-context rows (offline, seeded tasks for RAPID and its baselines: ``make_tasks``).

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
import bisect
import functools
import itertools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic import write_text_atomic
from .errors import RetrospecError
from .stdlib_corpus import HELDOUT_PACKAGES, stdlib_files, stdlib_root

PRESETS = ("heldout", "chat", "chat-tasks", "lcc", "lcc-8k", "lcc-16k", "lcc-32k")
LCC_RANGE = (4096, 7168)  # ``lcc``: prompt lengths in target tokens, spread evenly over the prompts
LCC_FIXED = {"lcc-8k": 8192, "lcc-16k": 16384, "lcc-32k": 32768}  # fixed-length variants (at most this many)
PRESET_DIR = Path(__file__).parent / "presets"


def load_prompts(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise RetrospecError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise RetrospecError(f"prompts file is not UTF-8 text: {path}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise RetrospecError(f"{path}:{n}: not valid JSON") from None
        if isinstance(row, dict) and "prompt" not in row and isinstance(row.get("question"), str):
            row = {"prompt": row["question"]} | row
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise RetrospecError(f"{path}:{n}: each line needs a non-empty string field 'prompt' or 'question'")
        rows.append(row)
    if not rows:
        raise RetrospecError(f"prompts file has no prompts: {path}")
    return rows


def heldout_prompts(n: int = 20, context_lines: int = 12) -> list[dict]:
    """Prompts = a function's header + docstring (with a few lines of preceding context) from held-out packages.

    Functions are taken in a fixed order spread across the held-out files; the model continues the body.
    """
    candidates = [{"prompt": _function_prefix(text, header, body_start, context_lines), "source": f"{rel}:{header + 1}",
                   "entry_point": name}
                  for files in _package_sources().values() for rel, text in files
                  for body_start, header, _, name in _functions(text)]
    if not candidates:
        raise RetrospecError("no held-out prompts could be built from the standard library")
    stride = max(1, len(candidates) // n)
    return candidates[::stride][:n]


def preset(name: str, n: int, tokenizer=None) -> list[dict]:
    """The first ``n`` rows of preset ``name``; the ``lcc*`` presets measure prompts in target tokens, so they need
    the target's ``tokenizer``."""
    if name == "heldout":
        return heldout_prompts(n)
    if name in ("chat", "chat-tasks"):
        return load_prompts(PRESET_DIR / f"{name}.jsonl")[:n]
    if name == "lcc" or name in LCC_FIXED:
        if tokenizer is None:
            raise RetrospecError(f"preset {name} measures prompts in target tokens: it needs the target's tokenizer")
        if name == "lcc":
            return lcc_prompts(tokenizer, n)
        return lcc_prompts(tokenizer, n, lengths=(LCC_FIXED[name],) * n, tolerance=LCC_FIXED[name] // 32)
    raise RetrospecError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")


def preset_max_tokens(name: str) -> int | None:
    """The longest prompt (target tokens) preset ``name`` makes, when it is measured in tokens (``lcc*``)."""
    return LCC_RANGE[1] if name == "lcc" else LCC_FIXED.get(name)


# ---------------------------------------------------------------------------------------------------------------------
# long code completion


@dataclass(frozen=True)
class _SourceFile:
    package: str
    rel: str  # path relative to the standard library, e.g. "email/header.py"
    text: str  # the ``# file:`` line + the file's source, ending with a newline
    body_lines: tuple[int, ...]  # 0-based indices (in ``text``) of non-blank lines strictly inside a function body


def _function_body_lines(source: str, offset: int) -> tuple[int, ...]:
    """Indices (+ ``offset``) of the non-blank lines of ``source`` after a function's first body line: a prompt cut
    before one of them ends mid-function, so the model continues code."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    lines = source.splitlines()
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and node.end_lineno:
            # 1-based lines body[0].lineno + 1 .. end_lineno -> 0-based body[0].lineno .. end_lineno - 1
            inside.update(range(node.body[0].lineno, node.end_lineno))
    return tuple(i + offset for i in sorted(inside) if i < len(lines) and lines[i].strip())


def _heldout_sources(headers: bool) -> list[list[_SourceFile]]:
    """The held-out packages' files, per package (``HELDOUT_PACKAGES`` order), each in path order."""
    by_pkg: dict[str, list[_SourceFile]] = {p: [] for p in HELDOUT_PACKAGES}
    for pkg, files in _package_sources().items():
        for rel, source in files:
            source = source if source.endswith("\n") else source + "\n"
            head = f"# file: {rel}\n" if headers else ""
            by_pkg.setdefault(pkg, []).append(
                _SourceFile(pkg, rel, head + source, _function_body_lines(source, int(bool(headers)))))
    return [files for files in by_pkg.values() if files]


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def lcc_prompts(tokenizer, n: int, lengths: tuple[int, ...] | None = None, tolerance: int | None = None,
                headers: bool = True) -> list[dict]:
    """Long code completion prompts: ``n`` prompts of held-out package source, plain continuation (no template).

    Prompt i reads one held-out package (``HELDOUT_PACKAGES[i % P]``) from one of its files onwards, files in path
    order, each preceded by a ``# file: <path>`` line (``headers``); when the package is too short for the length,
    the next packages follow (cycling). It is cut at the start of a line: a non-blank line inside a function body
    (after its first line), so it ends mid-function and the model continues code, when such a cut lies within 256
    tokens of the goal (``mid_function``); else any non-blank line of a file (never before a ``# file:`` line).
    Lengths are in target tokens, counted exactly as the bench encodes prompts (``add_special_tokens=False``):
    ``lengths`` (default: spread evenly over ``LCC_RANGE``) are goals, and every prompt lies in [lo, hi]
    (``LCC_RANGE`` by default; with ``tolerance``, [goal - tolerance, goal]). Deterministic for a given tokenizer
    and Python; packages, start files and cut points differ between prompts. Rows: ``prompt``, ``source``
    (packages and the file:line where the prompt is cut), ``prompt_tokens``, and the parts of ``source``.
    """
    if n < 1:
        raise RetrospecError(f"need at least one prompt, got {n}")
    if lengths is None:
        lo, hi = LCC_RANGE
        lengths = tuple(round(lo + (hi - lo) * i / (n - 1)) if n > 1 else (lo + hi) // 2 for i in range(n))
    packages = _heldout_sources(headers)
    if not packages:
        raise RetrospecError("no held-out standard-library source found for the lcc prompts")
    counts = [[_count(tokenizer, f.text) for f in files] for files in packages]  # tokens per file (approximate sum)
    total = sum(map(sum, counts))
    rows = []
    for i, goal in enumerate(lengths):
        lo, hi = (goal - tolerance, goal) if tolerance is not None else LCC_RANGE
        if total < hi + 64:
            raise RetrospecError(f"the held-out packages hold about {total} target tokens, too few for a "
                                 f"{goal}-token prompt")
        k, j = i % len(packages), i // len(packages)
        # start files of package k with enough of the package left after them; the j-th use of the package takes
        # a different one (0 = from its first file); none: from the first file, later packages joined
        left = [sum(counts[k][f:]) for f in range(len(counts[k]))]
        starts = [f for f in range(len(left)) if left[f] >= hi + 64] or [0]
        start = starts[(j * 7) % len(starts)]
        files = packages[k][start:]
        seq_tokens = left[start]
        for step in range(1, len(packages)):
            if seq_tokens >= hi + 64:
                break
            files = files + packages[(k + step) % len(packages)]
            seq_tokens += sum(counts[(k + step) % len(packages)])
        rows.append(_cut(tokenizer, files, goal, lo, hi))
    return rows


def _cut(tokenizer, files: list[_SourceFile], goal: int, lo: int, hi: int, near: int = 256) -> dict:
    """The prompt over ``files`` cut at a line start whose exact token count lies in [lo, hi]: the mid-function cut
    closest to ``goal`` when one is within ``near`` tokens of it, else the closest cut before any non-blank line of
    a file (a cut is never before a ``# file:`` line: the prompt always ends inside a file)."""
    texts, cuts = [], []  # cuts: (char offset in the document, file, 0-based line in f.text, mid-function)
    offset = 0
    for f in files:
        lines = f.text.splitlines(keepends=True)
        starts = [0, *itertools.accumulate(map(len, lines[:-1]))]
        body = set(f.body_lines)
        first = int(f.text.startswith("# file: "))
        cuts += [(offset + starts[ln], f, ln, ln in body) for ln in range(first + 1, len(lines)) if lines[ln].strip()]
        texts.append(f.text)
        offset += len(f.text)
        if offset > 16 * hi:  # far more characters than any tokenizer needs for hi tokens
            break
    doc = "".join(texts)
    enc = tokenizer(doc, add_special_tokens=False, verbose=False,
                    **({"return_offsets_mapping": True} if getattr(tokenizer, "is_fast", False) else {}))
    if "offset_mapping" in enc:
        tok_starts = [a for a, _ in enc["offset_mapping"]]
        approx = [bisect.bisect_left(tok_starts, c[0]) for c in cuts]
    else:  # no offsets: proportional estimate, corrected by exact counts below
        ratio = len(enc["input_ids"]) / max(1, len(doc))
        approx = [round(c[0] * ratio) for c in cuts]
    for mid_only, tol in ((True, near), (False, None)):
        order = sorted((abs(a - goal), i) for i, a in enumerate(approx)
                       if lo - 64 <= a <= hi + 64 and (cuts[i][3] or not mid_only))
        for _, i in order[:32]:
            exact = _count(tokenizer, doc[: cuts[i][0]])
            if lo <= exact <= hi and (tol is None or abs(exact - goal) <= tol):
                return _row(doc, files, cuts[i], exact)
    # exact counts drifted from the estimates: the last cut within hi tokens, by binary search over exact counts
    i = bisect.bisect_right(range(len(cuts)), hi, key=lambda j: _count(tokenizer, doc[: cuts[j][0]])) - 1
    exact = _count(tokenizer, doc[: cuts[i][0]]) if i >= 0 else -1
    if not lo <= exact <= hi:
        raise RetrospecError(f"could not cut a held-out source prompt of {lo}-{hi} target tokens")
    return _row(doc, files, cuts[i], exact)


def _row(doc: str, files: list[_SourceFile], cut: tuple, tokens: int) -> dict:
    offset, cut_in, line, mid = cut
    used = files[: next(i for i, f in enumerate(files) if f is cut_in) + 1]
    packages = list(dict.fromkeys(f.package for f in used))
    src_line = line + 1 - int(cut_in.text.startswith("# file: "))  # 1-based line in the source file
    return {"prompt": doc[:offset], "source": f"{'+'.join(packages)} (cut before {cut_in.rel}:{src_line})",
            "packages": packages, "first_file": used[0].rel, "cut_file": cut_in.rel, "cut_line": src_line,
            "mid_function": mid, "prompt_tokens": tokens}

# ---------------------------------------------------------------------------------------------------------------------
# long-context tasks (``retrospec tasks make``)


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


QUESTIONS = {
    "city": ("In which city was {n} born?", "{n} was born in"),
    "job": ("What does {n} work as?", "{n} works as a"),
    "colour": ("What is the favourite colour of {n}?", "The favourite colour of {n} is"),
    "pet": ("What pet does {n} have?", "{n} has a pet"),
}


def _facts(rng, budget: int, count: CountFn) -> dict:
    used: set[str] = set()
    budget -= 40  # room for the question (about 25 tokens), which is drawn after the haystack
    docs, people, total = [], [], 0
    while True:
        name = _person(rng, used)
        a = {"city": str(rng.choice(CITIES)), "job": str(rng.choice(JOBS)), "colour": str(rng.choice(COLOURS)),
             "pet": str(rng.choice(PETS))}
        doc = (f"Document {len(docs) + 1}: {name}\n{name} was born in {a['city']}. {name} works as a {a['job']}. "
               f"The favourite colour of {name} is {a['colour']}. {name} has a pet {a['pet']}.\n\n")
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
def _functions(source: str) -> list[tuple[int, int, str, str]]:
    """(first line index after the docstring, header line index, first body line, name) for documented functions of
    at least three statements."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    return [(node.body[0].end_lineno, node.lineno - 1, lines[node.body[1].lineno - 1].strip(), node.name)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(node.body) >= 3 and ast.get_docstring(node) is not None and node.body[0].end_lineno is not None]


def _function_prefix(text: str, header: int, body_start: int, context_lines: int) -> str:
    """A function's header and docstring with ``context_lines`` lines before it."""
    return "".join(text.splitlines(keepends=True)[max(0, header - context_lines): body_start])


def _repo(rng, budget: int, count: CountFn, prefix_lines: int = 12) -> dict:
    packages = _package_sources()
    names = sorted(p for p in packages if p in HELDOUT_PACKAGES)
    sizes = {p: sum(len(t) for _, t in packages[p]) for p in names}
    big = [p for p in names if sizes[p] / 3.0 > budget] or [max(names, key=sizes.get)]
    pkg = str(rng.choice(big))
    files = packages[pkg]
    candidates = [(path, text, f) for path, text in files for f in _functions(text) if len(f[2]) >= 8]
    if not candidates:
        raise RetrospecError(f"no completable functions in held-out package {pkg}")

    def query(c) -> str:
        path, text, (body_start, header, _, _) = c
        return f"# file: {path}\n" + _function_prefix(text, header, body_start, prefix_lines)

    # a function whose in-file prefix (the query) takes at most a quarter of the budget
    order = [int(j) for j in rng.permutation(len(candidates))][:64]
    sizes = count([query(candidates[j]) for j in order])
    fitting = [j for j, n in zip(order, sizes) if n <= budget // 4]
    pick = fitting[0] if fitting else order[int(np.argmin(sizes))]
    path, text, (body_start, header, answer, _) = candidates[pick]
    prompt = query(candidates[pick])
    budget -= count([prompt])[0]
    others = [(p, t) for p, t in files if p != path]
    chosen, total = [], 0
    for j in rng.permutation(len(others)):
        p, t = others[int(j)]
        block = f"# file: {p}\n{t}\n"
        n = count([block])[0]
        if total + n > budget:
            body = block.splitlines(keepends=True)
            k = bisect.bisect_right(list(itertools.accumulate(count(body))), budget - total)  # lines that fit
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
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # counting tokens of texts longer than the tokenizer's nominal maximum is fine
    try:
        return [_make_row(kind, context_tokens, seed, i, count) for i in range(n)]
    finally:
        hf_logging.set_verbosity(verbosity)


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
    """``rows`` as one JSON object per line, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
