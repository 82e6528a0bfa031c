"""Every command the user guide shows runs: each ``retrospec ...`` line of a ```bash or ```console block in
``docs/guide/*.md`` and ``README.md`` exits 0, and each ```python block runs, on the bundled zoo models.

How a page is run (one test per page, ``test_guide_page[generate.md]``):

- Its blocks run in document order in one fresh working directory, so a later command reads what an earlier one
  wrote (a datastore built, then used). ``write_files`` puts there first: the small inputs the pages name
  (``mbpp.jsonl``, ``questions.jsonl``, ``passages.jsonl``, ``doc.txt``, ...).
- Commands run in-process through ``retrospec.cli.main`` (a subprocess costs ~6 s of imports each).
- A command whose line ends with ``# needs: WHAT`` (a GPU, vLLM, your own checkpoint, ...) is not run; each one is
  reported by ``test_guide_needs[...]`` as skipped with that reason. A ```python block whose first line is
  ``# needs: WHAT`` likewise.
- Lines that do not start with ``retrospec `` (``make``, ``curl``, ``torchrun``, ``python -m ...``) are not run,
  except that the ``curl`` bodies of a page are sent to the server a ``retrospec serve --target smollm2-135m``
  command of the same page starts (below).

Substitutions, so that the whole file runs in under a minute on two CPU cores:

- Stand-ins (``guide_env``): the model names of the real model resolve to the zoo. ``smollm2-135m`` is a copy of the bundled zoo
  target (same weights, hence the same identity) with a chat template whose turns end with its EOS token, so
  ``--chat`` and ``messages=`` work; its paired draft, LongSpec block and RAG drafter are ``zoo-draft``,
  ``zoo-longspec`` and that copy. Nothing is converted from the GGUF file.
- ``CAPS`` / ``ADD``: fewer prompts, tokens, seconds and steps (``--max-new-tokens 64`` runs as 8, ``--seconds 3600``
  as 1, ...), small training batches, one repetition in ``profile``, no warm-up in ``bench``, one row per corpus
  source and greedy rows only.
- ``PRESETS``: the long-code presets (``lcc``, ``lcc-8k`` ...) run as ``heldout`` (a 4K-32K-token prefill per method
  costs seconds each on a CPU; ``tests/test_bench_longspec.py`` checks the long presets' prompts).
- The standard library as a corpus (``--corpus stdlib``, ``--sources stdlib``, the default corpus of ``train
  longspec``, ``zoo build``, ``zoo real-draft``) is cut to its first ``STDLIB_FILES`` training files.
- ``speculative_rag.open_pipeline`` without a config drafts 2 subsets of at most 8 rationale tokens (``ShortRagConfig``).
- Charts (``speedup.png``, ``profile.png``) are written empty: drawing them costs about half a second each.
- ``--port`` becomes 0, and ``retrospec serve`` does not block: its uvicorn server is replaced by a check through
  Starlette's test client (``/health``, ``/v1/models``, one completion, and the page's ``curl`` bodies).

``SLOW`` commands (``zoo build``: a tokenizer and two models trained from scratch, over ten seconds even at test size)
run alone in ``test_guide_slow`` when ``RETROSPEC_DOCS_SLOW=1`` and are skipped otherwise.
``RETROSPEC_DOCS_TIMINGS=1`` prints each page's slowest blocks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
# the guide's pages, and the README's commands too
FILES_BY_PAGE = {p.name: p for p in sorted(GUIDE.glob("*.md"))} | {"README.md": ROOT / "README.md"}
PAGES = list(FILES_BY_PAGE)
STDLIB_FILES = 8

pytestmark = pytest.mark.usefixtures("single_thread")


# --- what the pages contain ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the command (or of the python block's first line)
    kind: str  # "cmd", "python", "curl"
    text: str  # the command without its trailing comment, or the python source
    needs: str = ""  # the reason it is not run ("" = run it)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
NEEDS = re.compile(r"#\s*needs:\s*(.+?)\s*$")


def _commands(page: str, start: int, lines: list[str]) -> list[Block]:
    out, i = [], 0
    while i < len(lines):
        first = i
        joined = lines[i].rstrip()
        while joined.endswith("\\") and i + 1 < len(lines):  # continuation lines
            i += 1
            joined = joined[:-1] + " " + lines[i].strip()
        i += 1
        cmd = joined.strip()
        if cmd.startswith("$ "):
            cmd = cmd[2:]
        needs = NEEDS.search(cmd)
        if cmd.startswith("retrospec "):
            out.append(Block(page, start + first, "cmd", cmd, needs.group(1) if needs else ""))
        elif cmd.startswith("curl ") and " -d " in cmd:
            out.append(Block(page, start + first, "curl", cmd))
    return out


def blocks(page: str) -> list[Block]:
    """The runnable blocks of one guide page, in document order."""
    lines = FILES_BY_PAGE[page].read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(2):
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2)
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j]]
        if lang in ("bash", "console"):
            out += _commands(page, i + 2, body)
        elif lang == "python":
            src = textwrap.dedent("\n".join(body))
            needs = NEEDS.search(src.splitlines()[0]) if src.strip() else None
            out.append(Block(page, i + 2, "python", src, needs.group(1) if needs else ""))
        i = j + 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def test_the_guide_has_runnable_commands():
    assert {"index.md", "generate.md", "choosing-a-method.md", "long-contexts.md", "datastores.md",
            "speculative-rag.md", "training.md", "serving.md", "gpus.md", "benchmarking.md"} <= set(PAGES)
    assert sum(b.kind == "cmd" and not b.needs for b in ALL) >= 40
    for b in ALL:  # a needs: mark says what is missing
        assert b.needs == "" or len(b.needs) > 3, b.id


# --- substitutions ---------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# flag -> the most the test runs (the page's value when smaller)
CAPS = {"--max-new-tokens": 8, "--limit": 1, "--n": 1, "--context-tokens": 512, "--seconds": 1, "--steps": 1,
        "--teacher-seconds": 1, "--draft-seconds": 1, "--max-tokens": 2000, "--seq-len": 256, "--bucket": 128,
        "--docs": 1, "--gen-max-new-tokens": 8, "--batch-tokens": 512, "--max-len": 64,
        "--target-tokens": 3000, "--draft-tokens": 2000, "--reps": 1, "--max-rationale-tokens": 8,
        "--max-answer-tokens": 4}
CAPPED_ONLY_FOR = {"--docs": ("longspec-eval",), "--max-tokens": ("datastore", "longspec-distill", "draft-distill"),
                   "--batch-tokens": ("longspec-distill", "draft-distill"), "--seq-len": ("longspec",),
                   "--max-len": ("longspec-distill", "draft-distill")}
# (subcommand words, flags added when absent: a flag alone, or a flag and its value)
ADD = [(("generate",), [("--max-new-tokens", "8")]),
       (("bench",), [("--no-warmup",), ("--max-new-tokens", "8")]),
       (("profile",), [("--reps", "1"), ("--contexts", "300"), ("--tokens", "1,2,5"), ("--no-trees",)]),
       (("corpus", "generate"), [("--limit-per-source", "1"), ("--max-new-tokens", "8")]),
       (("train", "longspec-distill"), [("--batch-tokens", "512"), ("--max-len", "64"), ("--precision", "float32")]),
       (("train", "draft-distill"), [("--batch-tokens", "512"), ("--max-len", "64"), ("--precision", "float32")]),
       (("train", "longspec"), [("--seq-len", "128")]),
       (("rag", "answer"), [("--max-rationale-tokens", "8"), ("--max-answer-tokens", "4"), ("--drafts", "2")]),
       (("rag", "bench"), [("--max-rationale-tokens", "8"), ("--max-answer-tokens", "4"), ("--drafts", "2")]),
       (("datastore", "eval"), [("--max-queries", "20")]),
       (("datastore", "build"), [("--gen-max-new-tokens", "8")]),
       (("zoo", "build"), [("--target-tokens", "3000"), ("--draft-tokens", "2000")]),
       (("zoo", "real-draft"), [("--teacher-seconds", "1"), ("--seconds", "1"), ("--vocab", "1024")])]
PRESETS = {"lcc": "heldout", "lcc-8k": "heldout", "lcc-16k": "heldout", "lcc-32k": "heldout"}
SOURCE_CAP = re.compile(r"(self-instruct|tasks|stdlib)=\d+")
PY_CAP = re.compile(r"\b(max_new_tokens|max_rationale_tokens|max_answer_tokens|drafts)=(\d+)")  # python blocks
# commands that cost over ten seconds even at test size (tokenizer and model training from scratch): run only with
# RETROSPEC_DOCS_SLOW=1, skipped otherwise
SLOW = {("zoo", "build")}


def is_slow(b: Block) -> bool:
    return b.kind == "cmd" and tuple(shlex.split(b.text)[1:3]) in SLOW


def substitute(args: list[str]) -> list[str]:
    """The page's command as the test runs it (see the module docstring)."""
    words = [a for a in args if not a.startswith("-")][:2]
    out = list(args)
    for i, a in enumerate(out[:-1]):
        nxt = out[i + 1]
        if a in CAPS and re.fullmatch(r"\d+(\.\d+)?", nxt):
            scope = CAPPED_ONLY_FOR.get(a)
            if scope is None or any(s in w for w in words for s in scope):
                out[i + 1] = str(min(float(nxt), CAPS[a])).removesuffix(".0")
        elif a == "--preset" and nxt in PRESETS:
            out[i + 1] = PRESETS[nxt]
        elif a == "--port":
            out[i + 1] = "0"
        elif a == "--sources":
            out[i + 1] = SOURCE_CAP.sub(lambda m: f"{m.group(1)}=1", nxt)
        elif a == "--temperatures":  # corpus generate: greedy rows only
            out[i + 1] = "0"
    for want, extra in ADD:
        if tuple(words[:len(want)]) == want:
            out += [a for flag in extra if flag[0] not in out for a in flag]
    return out


def test_substitutions_keep_the_command_and_cap_its_cost():
    args = shlex.split("bench --target smollm2-135m --preset lcc --limit 20 --max-new-tokens 128 --out runs/x")
    assert substitute(args) == shlex.split("bench --target smollm2-135m --preset heldout --limit 1 "
                                           "--max-new-tokens 8 --out runs/x --no-warmup")
    args = shlex.split("corpus generate --sources mbpp=m.jsonl,self-instruct=2000,stdlib --out c")
    assert "mbpp=m.jsonl,self-instruct=1,stdlib" in substitute(args)
    assert substitute(shlex.split("serve --port 8000")) == ["serve", "--port", "0"]


# --- the environment: stand-ins, fixture files, a non-blocking server ------------------------------------------------


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A copy of the zoo target with a chat template (its weights linked, so its identity is the zoo's)."""
    from retrospec.models.named import ZOO_DIR

    src, dst = ZOO_DIR / "target-long", tmp_path_factory.mktemp("stand_in") / "smollm2-135m-stand-in"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def guide_env(stand_in, monkeypatch):
    import retrospec.models as models_pkg
    from retrospec import stdlib_corpus
    from retrospec.models import named

    NM = named.NamedModel
    stand_ins = {
        "smollm2-135m": NM("smollm2-135m", "stand-in: the zoo target with a chat template", "bundled", str(stand_in),
                           draft="smollm2-135m-draft", longspec="smollm2-135m-longspec"),
        "smollm2-135m-draft": NM("smollm2-135m-draft", "stand-in: zoo-draft", "bundled", "draft-long"),
        "smollm2-135m-longspec": NM("smollm2-135m-longspec", "stand-in: zoo-longspec", "bundled", "zoo-longspec"),
        "smollm2-135m-rag-drafter": NM("smollm2-135m-rag-drafter", "stand-in: the zoo target", "bundled",
                                       str(stand_in)),
    }
    table = tuple(stand_ins.get(m.name, m) for m in named.NAMED)
    monkeypatch.setattr(named, "NAMED", table)
    monkeypatch.setattr(models_pkg, "NAMED", table)
    monkeypatch.setattr(named, "_BY_NAME", {n: m for m in table for n in (m.name, *m.aliases)})

    full = stdlib_corpus.stdlib_files

    def few_stdlib_files(split: str = "train", root=None):
        files = full(split, root)
        return files[:STDLIB_FILES] if split == "train" else files

    import importlib

    # every module imported before any is patched: a module first imported after ``stdlib_corpus`` was patched would
    # bind the stand-in at import, and monkeypatch would "restore" it to the stand-in for the rest of the process
    modules = [importlib.import_module(mod) for mod in (
        "retrospec.stdlib_corpus", "retrospec.corpus.prompts", "retrospec.retrieval.corpus",
        "retrospec.train.longspec", "retrospec.train.zoo", "retrospec.tasks")]
    for module in modules:
        if hasattr(module, "stdlib_files"):
            monkeypatch.setattr(module, "stdlib_files", few_stdlib_files)
    monkeypatch.setenv("RETROSPEC_FASTPATH", os.environ.get("RETROSPEC_FASTPATH", "packed"))

    from retrospec.bench import profile, report

    def no_plot(_data, path, *_a, **_k):  # charts cost ~0.5 s each; the files are still written (empty)
        Path(path).write_bytes(b"")

    for module, name in ((report, "render_plot"), (report, "_context_plot"), (profile, "render_plot")):
        monkeypatch.setattr(module, name, no_plot)

    from dataclasses import dataclass as _dataclass

    from retrospec.speculative_rag import pipeline

    @_dataclass
    class ShortRagConfig(pipeline.RagConfig):  # what a pipeline opened without a config uses
        drafts: int = 2
        max_rationale_tokens: int = 8
        max_answer_tokens: int = 4

    monkeypatch.setattr(pipeline, "RagConfig", ShortRagConfig)


MBPP = [{"task_id": f"Mbpp/{i}", "prompt": p} for i, p in enumerate([
    'def similar_elements(a, b):\n    """Return the elements two lists share."""\n',
    'def is_not_prime(n):\n    """Return True when n is not a prime number."""\n',
    'def heap_queue_largest(nums, n):\n    """Return the n largest numbers, largest first."""\n'])]
PASSAGES = [("Nobel Prize in Physics", "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad "
             "Röntgen, of Germany."),
            ("Python (programming language)", "Python was created by Guido van Rossum and first released in 1991."),
            ("Hash table", "A hash table maps keys to values, using a hash function to compute an index into an "
             "array of buckets."),
            ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
            ("Paris", "Paris is the capital and most populous city of France."),
            ("Moon", "The Moon is Earth's only natural satellite.")]
QUESTIONS = [("who got the first nobel prize in physics", "Wilhelm Conrad Röntgen", 0),
             ("who created python", "Guido van Rossum", 1), ("what is the capital of france", "Paris", 4),
             ("what is the highest mountain on earth", "Mount Everest", 3),
             ("what does a hash table map", "keys to values", 2), ("what is earth's natural satellite", "the Moon", 5),
             ("when was python first released", "1991", 1), ("where is mount everest", "the Himalayas", 3),
             ("which city is the capital of france", "Paris", 4), ("who won the first physics nobel", "Röntgen", 0)]


def write_files(where: Path) -> None:
    """The inputs the pages name, small (questions q4 and q8 fall in the eval split, the rest in train)."""
    def jsonl(name, rows):
        (where / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    jsonl("mbpp.jsonl", MBPP)
    jsonl("prompts.jsonl", MBPP)
    jsonl("passages.jsonl", [{"id": f"p{i}", "title": t, "text": x} for i, (t, x) in enumerate(PASSAGES)])
    jsonl("questions.jsonl", [{"id": f"q{i}", "question": q, "answers": [a], "gold_passage": f"p{g}"}
                              for i, (q, a, g) in enumerate(QUESTIONS)])
    code = (Path(textwrap.__file__).read_text(encoding="utf-8"))
    (where / "big_module.py").write_text(code[:6000], encoding="utf-8")
    (where / "prompt.txt").write_text("def parse_header(line):\n", encoding="utf-8")
    (where / "my_code").mkdir()
    (where / "my_code" / "wrap.py").write_text(code, encoding="utf-8")
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 8
    (where / "doc.txt").write_text(filler + "The pass key is 71432. Remember it. 71432 is the pass key. " + filler,
                                   encoding="utf-8")


class _CheckedServer:
    """Stands in for uvicorn in ``retrospec serve``: checks the app through the test client, then returns."""

    curls: list[Block] = []
    api_key: str | None = None  # the command's --api-key
    sent: set[str] = set()  # the curl blocks whose bodies were sent

    def __init__(self, app, **_):
        self.app = app

    def run(self, sockets=None):
        from fastapi.testclient import TestClient

        backend = self.app.state.backend
        with TestClient(self.app) as client:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            assert client.get("/health").status_code == 200
            models = client.get("/v1/models", headers=headers)
            assert models.status_code == 200, models.text
            model = backend.caps.model
            res = client.post("/v1/completions", headers=headers,
                              json={"model": model, "prompt": "def fib(n):", "max_tokens": 4})
            assert res.status_code == 200, res.text
            for curl in self.curls:
                route = re.search(r"localhost:\d+(/\S+)", curl.text).group(1)
                body = json.loads(shlex.split(curl.text)[shlex.split(curl.text).index("-d") + 1])
                if body.get("model") != model:
                    continue
                body["max_tokens"] = min(body.get("max_tokens", 8), 8)
                res = client.post(route, headers=headers, json=body)
                assert res.status_code == 200, (curl.id, res.text)
                _CheckedServer.sent.add(curl.id)


@pytest.fixture
def checked_server(monkeypatch):
    from retrospec.serve import server

    monkeypatch.setattr(server, "uvicorn_server", _CheckedServer)
    before = signal.getsignal(signal.SIGTERM)
    yield _CheckedServer
    signal.signal(signal.SIGTERM, before)
    _CheckedServer.curls, _CheckedServer.sent = [], set()


# --- the tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_guide_page(page, guide_env, checked_server, tmp_path, monkeypatch, capsys):
    from retrospec.cli import main

    todo = [b for b in blocks(page) if not b.needs]
    if not any(b.kind in ("cmd", "python") for b in todo):
        pytest.skip(f"{page}: nothing runnable without its needs")
    checked_server.curls = [b for b in todo if b.kind == "curl"]
    write_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    timings = []
    for b in todo:
        if is_slow(b):  # test_guide_slow runs it
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        if b.kind == "cmd":
            args = substitute(shlex.split(b.text, comments=True)[1:])
            checked_server.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
            capsys.readouterr()
            rc = main(args)
            out, err = capsys.readouterr()
            assert rc == 0, f"{b.id}: retrospec {shlex.join(args)}\n{err[-3000:]}"
            assert "Traceback" not in err, f"{b.id}: {err[-3000:]}"
        elif b.kind == "python":
            src = PY_CAP.sub(lambda m: f"{m.group(1)}={min(int(m.group(2)), 8 if 'tokens' in m.group(1) else 2)}",
                             b.text)
            try:
                exec(compile(src, f"{FILES_BY_PAGE[page]}:{b.line}", "exec"), {"__name__": "__guide__"})
            except Exception as exc:  # noqa: BLE001 - report which block failed
                raise AssertionError(f"{b.id}: the python block failed: {exc!r}") from exc
        timings.append((time.perf_counter() - t0, time.process_time() - c0, b.id, b.text[:60]))
    assert checked_server.sent == {c.id for c in checked_server.curls}, "a curl body was not sent to a server"
    if os.environ.get("RETROSPEC_DOCS_TIMINGS"):
        with capsys.disabled():
            for t, c, where, what in sorted(timings, reverse=True)[:40]:
                print(f"\n{t:6.2f}s wall {c:6.2f}s cpu {where} {what}")
            print(f"\n{page}: {sum(t[0] for t in timings):.1f}s wall, {sum(t[1] for t in timings):.1f}s cpu")


NEEDING = [b for b in ALL if b.needs]


@pytest.mark.parametrize("block", NEEDING, ids=[b.id for b in NEEDING])
def test_guide_needs(block):
    """Each command the pages mark ``# needs: ...`` is still a valid command line (it parses), and is skipped."""
    from retrospec.cli import build_parser

    if block.kind == "cmd":
        try:
            build_parser().parse_args(shlex.split(block.text, comments=True)[1:])
        except SystemExit as exc:  # argparse: a flag the command does not have
            raise AssertionError(f"{block.id}: not a valid command line: {block.text}") from exc
    pytest.skip(f"needs {block.needs}")


SLOW_BLOCKS = [b for b in ALL if is_slow(b) and not b.needs]


@pytest.mark.parametrize("block", SLOW_BLOCKS, ids=[b.id for b in SLOW_BLOCKS])
def test_guide_slow(block, guide_env, tmp_path, monkeypatch, capsys):
    """The guide's commands that cost over ten seconds at test size, each alone in a fresh directory."""
    if not os.environ.get("RETROSPEC_DOCS_SLOW"):
        pytest.skip("slow (tens of seconds even at test size): RETROSPEC_DOCS_SLOW=1 runs it")
    from retrospec.cli import main

    write_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = substitute(shlex.split(block.text, comments=True)[1:])
    capsys.readouterr()
    rc = main(args)
    assert rc == 0, f"{block.id}: retrospec {shlex.join(args)}\n{capsys.readouterr().err[-3000:]}"
