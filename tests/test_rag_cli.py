"""``retrospec rag answer|bench|merge`` and ``retrospec train rag-drafter`` from the user's side: tiny saved chat
models given by directory, a small index, short drafts; user errors are one line with exit code 2."""

from __future__ import annotations

import json

import pytest

from retrospec.speculative_rag.index import build_index

pytestmark = pytest.mark.usefixtures("single_thread")

PASSAGES = [
    ("paris", "Paris", "Paris is the capital of France."),
    ("berlin", "Berlin", "Berlin is the capital of Germany."),
    ("titanic", "Titanic", "The Titanic sank in 1912 after hitting an iceberg."),
    ("bach", "Bach", "Bach composed the Brandenburg Concertos."),
    ("gold", "Gold", "Gold has the chemical symbol Au."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan."),
]
QUESTIONS = [
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"], "gold_passage": "paris"},
    {"id": "q2", "question": "When did the Titanic sink?", "answers": ["1912"], "gold_passage": "titanic"},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rag_cli")
    passages = write_jsonl(root / "passages.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in PASSAGES])
    index = build_index(passages, root / "idx", progress=False)
    return {"passages": passages, "index": str(index), "questions": write_jsonl(root / "q.jsonl", QUESTIONS)}


@pytest.fixture
def models(chat_models, files):
    """The common arguments: index, tiny drafter and verifier, small knobs."""
    return ["--index", files["index"], "--drafter", chat_models.target, "--verifier", chat_models.target,
            "--docs", 4, "--drafts", 2, "--per-draft", 2, "--max-rationale-tokens", 8, "--max-answer-tokens", 4]


def test_answer(cli, models, chat_models):
    run = cli("rag", "answer", *models, "--question", "What is the capital of France?")
    assert run.rc == 0, run.err
    lines = run.out.splitlines()
    assert lines[1].startswith("[specrag] latency ") and "retrieve" in lines[1] and "verify" in lines[1]
    assert f"drafter {chat_models.target}" in lines[1]
    assert sum(line.lstrip("* ").startswith("draft ") for line in lines) in (1, 2)
    assert sum(line.startswith("* draft ") for line in lines) == 1  # the chosen draft is marked
    base = cli("rag", "answer", *models, "--question", "What is the capital of France?", "--method", "closed-book")
    assert base.rc == 0, base.err
    assert base.out.splitlines()[1].startswith("[closed-book] latency ") and "draft 1" not in base.out


def test_answer_json(cli, models, chat_models):
    run = cli("rag", "answer", *models, "--question", "When did the Titanic sink?", "--json")
    assert run.rc == 0, run.err
    data = json.loads(run.out)
    assert {"answer", "drafts", "timings", "chosen", "retrieved", "drafter", "verifier"} <= set(data)
    assert data["method"] == "specrag" and data["verifier"] == str(chat_models.target)
    assert 1 <= len(data["drafts"]) <= 2 and data["answer"] == data["drafts"][data["chosen"]]["answer"]
    assert len(data["retrieved"]) == 4 and data["retrieved"][0][0] == "titanic"
    assert set(data["timings"]) == {"retrieve_s", "cluster_s", "draft_s", "verify_s", "latency_s"}
    for d in data["drafts"]:
        assert len(d["subset"]) == 2 and {"rationale", "answer", "log_draft", "log_sc", "log_sr", "score"} <= set(d)


@pytest.mark.parametrize("extra, fragments", [
    (["--question", ""], ("--question is empty",)),
    (["--question", "   "], ("--question is empty",)),
    (["--question", "q?", "--docs", 0], ("docs must be a positive integer",)),
    (["--question", "q?", "--drafts", 0], ("drafts must be a positive integer",)),
    (["--question", "q?", "--per-draft", 0], ("per-draft must be a positive integer",)),
    (["--question", "q?", "--per-draft", 5], ("per-draft (5) cannot exceed docs (4)",)),
    (["--question", "q?", "--max-answer-tokens", 0], ("max-answer-tokens",)),
    (["--question", "q?", "--method", "bogus"], ("unknown RAG method bogus", "specrag")),
    (["--question", "q?", "--method", "specrag,standard"], ("one method",)),
])
def test_answer_user_errors(cli, models, extra, fragments):
    cli("rag", "answer", *models, *extra).assert_user_error(*fragments)


def test_answer_missing_index_and_models(cli, models, tmp_path):
    args = list(models)
    args[1] = tmp_path / "no-index"
    cli("rag", "answer", *args, "--question", "q?").assert_user_error("not found", "no-index")
    args = list(models)
    args[args.index("--drafter") + 1] = tmp_path / "no-drafter"
    cli("rag", "answer", *args, "--question", "q?").assert_user_error("drafter", "no-drafter")
    cli("rag", "answer", *models).assert_user_error("--question")


def test_bench_user_errors(cli, models, files, tmp_path):
    out = tmp_path / "out"
    cli("rag", "bench", *models, "--questions", tmp_path / "missing.jsonl", "--out", out).assert_user_error(
        "questions file not found")
    q = files["questions"]
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--shard", "3/2", "--out", out).assert_user_error(
        "--shard must be I/N")
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--shard", "x", "--out", out).assert_user_error(
        "--shard")
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--limit", 0, "--out", out).assert_user_error(
        "--limit")
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--methods", "specrag,nope",
        "--out", out).assert_user_error("unknown RAG method nope")
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--docs", 0, "--out", out).assert_user_error(
        "docs")
    assert not out.exists()
    out.mkdir()
    (out / "rows.jsonl").write_text(json.dumps({"id": "q1", "method": "specrag"}) + "\n")
    cli("rag", "bench", *models, "--questions", q, "--split", "all", "--out", out).assert_user_error(
        "already holds a bench", "--resume")
    cli("rag", "merge", tmp_path / "nope", "--out", tmp_path / "m").assert_user_error("not a rag bench directory")


def test_bench_and_merge(cli, models, files, chat_models, tmp_path):
    out = tmp_path / "bench"
    run = cli("rag", "bench", *models, "--questions", files["questions"], "--split", "all",
              "--methods", "specrag,standard", "--out", out)
    assert run.rc == 0, run.err
    assert f"2 questions -> {out}/results.json" in run.out and "specrag" in run.out and "standard" in run.out
    result = json.loads((out / "results.json").read_text())
    assert [s["method"] for s in result["summary"]] == ["specrag", "standard"]
    assert all(s["questions"] == 2 for s in result["summary"]) and len(result["rows"]) == 4
    cfg = result["config"]
    assert cfg["docs"] == 4 and cfg["drafts"] == 2 and cfg["split"] == "all" and cfg["methods"] == ["specrag",
                                                                                                  "standard"]
    assert cfg["drafter"] == str(chat_models.target) and cfg["questions"] == 2
    assert (out / "report.md").is_file() and (out / "accuracy_latency.png").is_file()
    again = cli("rag", "bench", *models, "--questions", files["questions"], "--split", "all",
                "--methods", "specrag,standard", "--out", out, "--resume")
    assert again.rc == 0, again.err
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]  # nothing redone
    merged = cli("rag", "merge", out, "--out", tmp_path / "merged")
    assert merged.rc == 0, merged.err
    assert "2 questions" in merged.out
    assert json.loads((tmp_path / "merged" / "results.json").read_text())["summary"] == result["summary"]


def test_train_rag_drafter_user_errors(cli, chat_models, files, tmp_path):
    out = tmp_path / "adapter"
    common = ["--base", chat_models.target, "--passages", files["passages"], "--out", out]
    cli("train", "rag-drafter", *common, "--questions", tmp_path / "missing.jsonl", "--steps", 2).assert_user_error(
        "--questions file not found")
    cli("train", "rag-drafter", *common, "--questions", files["questions"], "--steps", 0).assert_user_error(
        "--steps", "positive")
    cli("train", "rag-drafter", *common, "--questions", files["questions"], "--seconds", -1).assert_user_error(
        "positive")
    cli("train", "rag-drafter", *common, "--questions", files["questions"], "--steps", 2,
        "--accum", 0).assert_user_error("--accum")
    cli("train", "rag-drafter", *common, "--questions", files["questions"]).assert_user_error("--steps", "--seconds")
    assert not out.exists()
