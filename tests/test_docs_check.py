"""The user-facing text stays about the library, not about how it was developed, and its links resolve.

(a) No development-diary wording (a numbered session, pass or issue; "this session", "the eighth training pass", ...) in
    README.md, docs/**/*.md, the docstrings and comments of src/**/*.py (the whole source file is read) and the
    bundled JSON under src/retrospec/zoo/.
(b) No absolute machine path (under root, home or work at the top of the file system, build temp folders /tmp/tmp..., /tmp/pytest-...) in any file
    shipped or documented: everything under src/retrospec (text files), README.md and every text file under docs/;
    nor in what the server answers.
(c) Every relative link in README.md and docs/**/*.md points at an existing file, and at an existing heading when
    it names one (GitHub's heading anchors).

Each failure lists every hit as ``file:line: what matched | the line``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "retrospec"
ZOO = SRC / "zoo"

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|\\d+(?:st|nd|rd|th)")
DIARY = {
    "numbered session": re.compile(r"\bsessions?(?:-|\s+)\d+", re.I),
    "a development session": re.compile(
        r"\b(?:this|that|the|last|previous|next|earlier|later|same|second|each|every|one|several|other|different|"
        r"over|across|since|in|during|before|after)\s+(?:\w+\s+)?sessions?\b(?!\s+of\s+its\s+own)|\bsession's",
        re.I),
    "numbered pass": re.compile(r"\bpass(?:es)?[ \t]+\d+\b", re.I),
    "ordinal pass": re.compile(rf"\b(?:{ORDINALS})(?:-|\s+)pass(?:es)?\b", re.I),
    "numbered issue": re.compile(r"\bissues?\s+#?\d+", re.I),
}
KEYWORD = {"numbered session": "session", "a development session": "session", "numbered pass": "pass",
           "ordinal pass": "pass", "numbered issue": "issue"}
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|home|work)/|/tmp/tmp|/tmp/pytest-")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
TEXT_SUFFIXES = {".md", ".json", ".jsonl", ".txt", ".log", ".jinja", ".py", ".toml", ".cfg", ".yaml", ".yml", ".csv"}


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def zoo_json() -> list[Path]:
    return sorted(ZOO.rglob("*.json"))


def text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def scan(paths, patterns: dict[str, re.Pattern]) -> list[str]:
    """``file:line: [rule] match | line`` for every match of every pattern, in file and line order."""
    hits = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        low = text.lower()
        for name, pattern in patterns.items():
            key = KEYWORD.get(name)
            if key is not None and key not in low:  # a file without the word cannot match
                continue
            lines = None
            for m in pattern.finditer(text):  # the whole text: a phrase may wrap onto the next line
                lines = lines or text.split("\n")
                n = text.count("\n", 0, m.start()) + 1
                line = lines[n - 1]
                hits.append(f"{rel(path)}:{n}: [{name}] {' '.join(m.group(0).split())!r} | {line.strip()[:160]}")
    return hits


def report(hits: list[str], what: str) -> str:
    by_file: dict[str, int] = {}
    for h in hits:
        by_file[h.split(":", 1)[0]] = by_file.get(h.split(":", 1)[0], 0) + 1
    summary = ", ".join(f"{f} ({n})" for f, n in sorted(by_file.items()))
    return f"{len(hits)} {what} in {len(by_file)} files: {summary}\n" + "\n".join(hits)


def test_the_patterns_catch_diary_wording_and_spare_ordinary_words():
    s, i = "session", "issue"  # built here so that the repository's own wording checks do not match this test
    diary = [f"in {s} 37", f"{s}s 40-41", f"the {s}-29 draft", f"this {s}", f"last {s}'s sample",
             f"over several {s}s", "the eighth " + "pass", "a twelfth-pass block", "pass 3", f"{i} 19",
             f"{i}s #18", f"the {s}'s own checkout", f"in earlier {s}s"]
    ordinary = ["an HTTP requests.Session", "start_new_session=True", "a process session of its own",
                "onnxruntime.InferenceSession", "one forward pass over the prompt", "passkey@4096", "compass 3",
                "the forward passes", "tiss" + "ue 4", "issued 3 requests"]
    for text in diary:
        assert any(p.search(text) for p in DIARY.values()), text
    for text in ordinary:
        assert not any(p.search(text) for p in DIARY.values()), text
    root, work = "/" + "root/", "/" + "work/"  # built here, as above
    assert MACHINE_PATH.search(f"cache in {root}.cache") and MACHINE_PATH.search("/tmp/pytest-of-x/y")
    assert MACHINE_PATH.search("/tmp/tmpab12cd/model") and MACHINE_PATH.search(f"built in {work}main/src")
    assert not MACHINE_PATH.search("runs/wo" + "rk/x") and not MACHINE_PATH.search("~/.cache/retrospec")


def test_no_development_diary_wording():
    hits = scan([*markdown_files(), *source_files(), *zoo_json()], DIARY)
    assert not hits, report(hits, "diary phrases")


def test_no_machine_paths_in_shipped_or_documented_files():
    files = [ROOT / "README.md", *text_files(ROOT / "docs"), *text_files(SRC)]
    hits = scan(files, {"machine path": MACHINE_PATH})
    assert not hits, report(hits, "machine paths")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    """(line number, target) of every markdown link outside fenced blocks and inline code."""
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


def test_relative_links_resolve():
    hits, cache = [], {}
    for path in markdown_files():
        for n, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                hits.append(f"{rel(path)}:{n}: [missing file] {target}")
            elif fragment and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if fragment.lower() not in cache[dest]:
                    hits.append(f"{rel(path)}:{n}: [missing anchor] {target}")
    assert not hits, report(hits, "broken links")


@pytest.fixture(scope="module")
def served(saved_models):
    """A server over the test's tiny saved models (they live in a pytest temp folder, the path a leak would show)."""
    from fastapi.testclient import TestClient

    from retrospec.serve import create_app

    with TestClient(create_app(str(saved_models.target), str(saved_models.draft))) as client:
        yield client


def test_server_responses_hold_no_machine_paths(served, saved_models):
    long_prompt = "word " * (2 * saved_models.max_positions)
    answers = [served.get(route) for route in ("/health", "/v1/models", "/openapi.json", "/metrics", "/nowhere")]
    for body in ({"prompt": "def f(x):", "max_tokens": 4, "method": "pld"},
                 {"prompt": "def f(x):", "max_tokens": 2, "method": "sd"},
                 {"prompt": "def f(x):", "method": "longspec"},
                 {"prompt": "def f(x):", "method": "rest"},
                 {"prompt": "def f(x):", "method": "pld", "datastore": "somewhere"},
                 {"prompt": long_prompt, "max_tokens": 4},
                 {"prompt": [10 ** 9]}):
        answers.append(served.post("/v1/completions", json=body))
    answers.append(served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
    assert {a.status_code for a in answers} >= {200, 400, 404}
    leaks = [f"{a.request.method} {a.request.url.path} -> {a.status_code}: {m.group(0)!r} in {a.text[:300]}"
             for a in answers for m in [MACHINE_PATH.search(a.text)] if m]
    folder = str(Path(saved_models.target).parent)
    leaks += [f"{a.request.method} {a.request.url.path} -> {a.status_code}: names {folder}" for a in answers
              if folder in a.text]
    assert not leaks, "\n".join(leaks)
