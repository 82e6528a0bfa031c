"""Benchmark prompt sources: jsonl files and built-in presets.

A jsonl file needs a ``prompt`` or a ``question`` field per line (HumanEval / MBPP files and NQ-open question files
work as they are); every returned row has ``prompt`` set (a ``question`` row gets ``prompt = question``, other
fields kept). Presets need no external data:
- ``heldout``: function headers + docstrings generated deterministically from the standard library's held-out
  packages (never seen in zoo training), for raw code completion;
- ``chat``: ``presets/chat.jsonl``, short instructions and questions written for this project (explain, summarise,
  list, rewrite, how-to, general knowledge, a few code requests), meant for ``--chat`` (one user message each);
- ``chat-tasks``: ``presets/chat-tasks.jsonl``, 25 chat prompts of five task kinds (instructions, QA, summarisation,
  translation, maths; 5 each, interleaved by kind), written for the drafts issue and never used in training;
- ``lcc`` (long code completion, as in LongSpec's and MagicDec's evaluations): plain continuation of 4K-7K target
  tokens of held-out package source; ``lcc-8k`` / ``lcc-16k`` / ``lcc-32k``: the same at a fixed length (for the
  ``zoo`` target, whose context is 64K). See ``lcc_prompts``.
"""

from __future__ import annotations

import ast
import bisect
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import RetrospecError
from ..stdlib_corpus import HELDOUT_PACKAGES, stdlib_files, stdlib_root

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
    root = stdlib_root()
    candidates: list[dict] = []
    for path in stdlib_files("heldout"):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if doc is None or len(node.body) < 3 or first.end_lineno is None:
                continue
            start = max(0, node.lineno - 1 - context_lines)
            prompt = "".join(lines[start:first.end_lineno])
            candidates.append({"prompt": prompt, "source": f"{path.relative_to(root)}:{node.lineno}",
                               "entry_point": node.name})
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
    root = stdlib_root()
    by_pkg: dict[str, list[_SourceFile]] = {p: [] for p in HELDOUT_PACKAGES}
    for path in stdlib_files("heldout"):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not source.strip():
            continue
        rel = path.relative_to(root).as_posix()
        source = source if source.endswith("\n") else source + "\n"
        head = f"# file: {rel}\n" if headers else ""
        pkg = rel.split("/")[0].removesuffix(".py")
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
        starts = [0]
        for line in lines[:-1]:
            starts.append(starts[-1] + len(line))
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
    # exact counts drifted from the estimates: binary search over the cut points by exact count
    lo_i, hi_i, best = 0, len(cuts) - 1, None
    while lo_i <= hi_i:
        mid = (lo_i + hi_i) // 2
        exact = _count(tokenizer, doc[: cuts[mid][0]])
        if exact <= hi:
            if exact >= lo:
                best = (mid, exact)
            lo_i = mid + 1
        else:
            hi_i = mid - 1
    if best is None:
        raise RetrospecError(f"could not cut a held-out source prompt of {lo}-{hi} target tokens")
    return _row(doc, files, cuts[best[0]], best[1])


def _row(doc: str, files: list[_SourceFile], cut: tuple, tokens: int) -> dict:
    offset, cut_in, line, mid = cut
    used = files[: next(i for i, f in enumerate(files) if f is cut_in) + 1]
    packages = list(dict.fromkeys(f.package for f in used))
    src_line = line + 1 - int(cut_in.text.startswith("# file: "))  # 1-based line in the source file
    return {"prompt": doc[:offset], "source": f"{'+'.join(packages)} (cut before {cut_in.rel}:{src_line})",
            "packages": packages, "first_file": used[0].rel, "cut_file": cut_in.rel, "cut_line": src_line,
            "mid_function": mid, "prompt_tokens": tokens}
