"""Speculative RAG end to end on a tiny chat model and a 12-passage index (real bundled MiniLM embedder): every
method and ablation of ``RagPipeline.answer_many``, the documented choice rule recomputed from the drafts' scores,
the verifier's ρ_SC / ρ_SR against a hand-computed forward, config validation, and ``rag.bench`` (metrics, the
output directory, resume, merge)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from retrospec.errors import RetrospecError
from retrospec.models.loading import load_model
from retrospec.speculative_rag import bench
from retrospec.speculative_rag.data import Passage, Question
from retrospec.speculative_rag.index import build_index, load_index
from retrospec.speculative_rag.pipeline import METHODS, Draft, Method, RagAnswer, RagConfig, RagPipeline, resolve_methods
from retrospec.speculative_rag.prompts import verifier_text

pytestmark = pytest.mark.usefixtures("single_thread")

PASSAGES = [
    ("paris", "Paris", "Paris is the capital of France."),
    ("berlin", "Berlin", "Berlin is the capital of Germany."),
    ("everest", "Everest", "Mount Everest is the highest mountain on Earth."),
    ("nile", "Nile", "The Nile is the longest river in Africa."),
    ("bach", "Bach", "Bach composed the Brandenburg Concertos."),
    ("mozart", "Mozart", "Mozart was born in Salzburg in 1756."),
    ("titanic", "Titanic", "The Titanic sank in 1912 after hitting an iceberg."),
    ("moon", "Apollo 11", "Apollo 11 landed on the Moon in 1969."),
    ("gold", "Gold", "Gold has the chemical symbol Au."),
    ("python", "Python", "Python was created by Guido van Rossum."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan."),
    ("insulin", "", "Insulin is made by the pancreas."),
]
QUESTIONS = [
    Question("q-paris", "What is the capital of France?", ("Paris",), "paris"),
    Question("q-titanic", "When did the Titanic sink?", ("1912",), "titanic"),
    Question("q-bach", "Who composed the Brandenburg Concertos?", ("Bach", "Johann Sebastian Bach"), "bach"),
]
CONFIG = dict(docs=4, drafts=3, per_draft=2, max_rationale_tokens=8, max_answer_tokens=4, seed=0)
TIMINGS = {"retrieve_s", "cluster_s", "draft_s", "verify_s", "latency_s"}
SUMMARY_KEYS = {"method", "accuracy", "exact_match", "latency_s", "retrieve_s", "draft_s", "verify_s", "cluster_s",
                "questions"}


def write_passages(path, rows=PASSAGES) -> str:
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in rows))
    return str(path)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("rag_pipeline")
    return load_index(build_index(write_passages(root / "passages.jsonl"), root / "idx", progress=False))


@pytest.fixture(scope="module")
def chat(chat_models):
    return load_model(chat_models.target)


def make_pipe(index, chat, **overrides) -> RagPipeline:
    return RagPipeline(index, chat, chat, RagConfig(**(CONFIG | overrides)))


@pytest.fixture(scope="module")
def pipe(index, chat):
    return make_pipe(index, chat)


@pytest.fixture(scope="module")
def all_methods(pipe):
    return pipe.answer_many(QUESTIONS[0].question, list(METHODS))


def expected_score(d: Draft, m: Method, default_norm: str = "mean") -> float:
    if not d.answer:
        return -math.inf
    if (m.norm or default_norm) == "mean":  # ρ_draft and ρ_SC per token
        assert d.n_draft > 0 and d.n_sc > 0
        parts = {"draft": d.log_draft / d.n_draft, "sc": d.log_sc / d.n_sc, "sr": d.log_sr}
    else:
        parts = {"draft": d.log_draft, "sc": d.log_sc, "sr": d.log_sr}
    return float(sum(parts[t] for t in m.terms))


@torch.no_grad()
def hand_span_logprob(model, tok, text, span) -> float:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
    want = set(range(*span))
    return float(sum(logp[t - 1, ids[t]] for t, (s, e) in enumerate(enc["offset_mapping"])
                     if t > 0 and want & set(range(s, e))))


# ---------------------------------------------------------------------------------------------------------------------
# answer_many


def test_every_method_answers(all_methods, index):
    res = all_methods
    assert list(res) == list(METHODS)
    retrieved = [p.id for p, _ in index.search(QUESTIONS[0].question, CONFIG["docs"])]
    assert retrieved[0] == "paris"
    for name, r in res.items():
        m = METHODS[name]
        assert isinstance(r, RagAnswer) and r.method == name and r.question == QUESTIONS[0].question
        assert isinstance(r.answer, str)
        assert set(r.timings) == TIMINGS and all(v >= 0 for v in r.timings.values())
        parts = sum(r.timings[k] for k in TIMINGS - {"latency_s"})
        assert r.timings["latency_s"] == pytest.approx(parts, abs=1e-3)
        json.dumps(r.to_dict())  # serialisable (-inf scores become null)
        if m.kind != "specrag":
            assert r.drafts == [] and r.chosen is None
            if m.kind == "closed-book":
                assert r.retrieved == [] and r.timings["retrieve_s"] == 0
            else:
                assert [pid for pid, _ in r.retrieved] == retrieved
            assert r.timings["draft_s"] == r.timings["cluster_s"] == 0 and r.timings["verify_s"] > 0
            continue
        assert [pid for pid, _ in r.retrieved] == retrieved
        assert 1 <= len(r.drafts) <= CONFIG["drafts"]
        subsets = [tuple(d.subset) for d in r.drafts]
        assert len({frozenset(s) for s in subsets}) == len(subsets)  # distinct
        for s in subsets:
            assert set(s) <= set(retrieved) and len(set(s)) == len(s)
            assert list(s) == sorted(s, key=retrieved.index)  # retrieval order
            if m.subsets != "same-cluster":
                assert len(s) == CONFIG["per_draft"]
            else:
                assert 1 <= len(s) <= CONFIG["per_draft"]
        for d in r.drafts:
            assert d.tokens >= 1
            if not d.answer:
                assert d.log_draft == -math.inf
        if m.verify:
            assert r.timings["verify_s"] > 0
            assert all((d.log_sc is not None and d.log_sr is not None) == bool(d.answer) for d in r.drafts)
        else:
            assert r.timings["verify_s"] == 0
        if m.terms:
            scores = [expected_score(d, m) for d in r.drafts]
            assert [d.score for d in r.drafts] == pytest.approx(scores)
            assert r.chosen == int(np.argmax(scores))  # the first of the best on ties
        else:  # random selection among drafts with an answer
            assert all(d.score is None for d in r.drafts)
            assert r.drafts[r.chosen].answer or not any(d.answer for d in r.drafts)
        assert r.answer == r.drafts[r.chosen].answer
        assert r.timings["draft_s"] > 0 and r.timings["retrieve_s"] > 0


def test_methods_share_drafts(all_methods):
    clustered = [n for n, m in METHODS.items() if m.kind == "specrag" and m.subsets == "clustered"]
    assert set(clustered) == {"specrag", "drafter", "specrag-random-select", "specrag-no-sc", "specrag-no-sr",
                              "specrag-no-draft", "specrag-sum"}
    ref = all_methods["specrag"]
    key = [(d.subset, d.rationale, d.answer, d.log_draft, d.log_sc, d.log_sr) for d in ref.drafts]
    for name in clustered:
        r = all_methods[name]
        assert r.timings["draft_s"] == ref.timings["draft_s"] and r.timings["cluster_s"] == ref.timings["cluster_s"]
        got = [(d.subset, d.rationale, d.answer, d.log_draft) for d in r.drafts]
        assert got == [k[:4] for k in key]
        if METHODS[name].verify:
            assert [(d.log_sc, d.log_sr) for d in r.drafts] == [k[4:] for k in key]
        if name != "specrag":
            assert all(d is not e for d, e in zip(r.drafts, ref.drafts))  # each method scores its own copies


def test_verifier_scores_equal_hand_computed(all_methods, chat):
    r = all_methods["specrag"]
    live = [d for d in r.drafts if d.answer]
    assert live, "the tiny drafter produced no answer at all"
    for d in live:
        text, sp = verifier_text(chat.tokenizer, QUESTIONS[0].question, d.answer, d.rationale)
        sc = hand_span_logprob(chat.model, chat.tokenizer, text, sp["answer"]) + \
            hand_span_logprob(chat.model, chat.tokenizer, text, sp["rationale"])
        sr = hand_span_logprob(chat.model, chat.tokenizer, text, sp["yes"])
        assert d.log_sc == pytest.approx(sc, abs=1e-4) and d.log_sr == pytest.approx(sr, abs=1e-4)
        assert d.log_sr < 0 and d.log_sc < 0


def test_rerun_is_reproducible(index, chat, all_methods):
    names = ["specrag", "specrag-random-subsets", "specrag-same-cluster", "specrag-random-select", "standard"]
    again = make_pipe(index, chat).answer_many(QUESTIONS[0].question, names)
    for name in names:
        a, b = all_methods[name], again[name]
        assert b.answer == a.answer and b.chosen == a.chosen
        assert [(d.subset, d.rationale, d.answer) for d in b.drafts] == [(d.subset, d.rationale, d.answer)
                                                                         for d in a.drafts]
        assert [d.log_draft for d in b.drafts] == pytest.approx([d.log_draft for d in a.drafts], abs=1e-5)
    one = make_pipe(index, chat).answer(QUESTIONS[0].question, "specrag")
    assert one.answer == all_methods["specrag"].answer  # alone or with every other method: the same answer


def test_choose_rule_and_empty_answers(pipe):
    drafts = [Draft(["a"], "r", "", log_draft=-math.inf),
              Draft(["b"], "r", "x", log_draft=-5.0, log_sc=-1.0, log_sr=-3.0),
              Draft(["c"], "r", "y", log_draft=-2.0, log_sc=-9.0, log_sr=-0.5),
              Draft(["d"], "r", "z", log_draft=-2.0, log_sc=-9.0, log_sr=-0.5)]  # ties with c
    want = {"specrag": 1, "specrag-no-sc": 2, "specrag-no-sr": 1, "specrag-no-draft": 1, "drafter": 2,
            "specrag-sum": 1}
    for name, chosen in want.items():  # one token per span: the per-token and raw scores agree
        picked = [Draft(list(d.subset), d.rationale, d.answer, d.log_draft, d.log_sc, d.log_sr, n_draft=1, n_sc=1)
                  for d in drafts]
        assert pipe._choose("q", picked, METHODS[name]) == chosen, name
        assert picked[0].score == -math.inf
    for _ in range(3):
        assert pipe._choose("q", list(drafts), METHODS["specrag-random-select"]) in (1, 2, 3)
    empty = [Draft(["a"], "r", "", log_draft=-math.inf), Draft(["b"], "", "", log_draft=-math.inf)]
    assert pipe._choose("q", empty, METHODS["specrag"]) == 0  # all empty: the first
    assert pipe._choose("q", empty, METHODS["specrag-random-select"]) in (0, 1)
    assert pipe._choose("q", [], METHODS["specrag"]) is None
    d = RagAnswer("q", "specrag", "", [Draft(["a"], "r", "", log_draft=-math.inf, score=-math.inf)], 0).to_dict()
    assert d["drafts"][0]["log_draft"] is None and d["drafts"][0]["score"] is None


# ---------------------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("overrides, fragment", [
    ({"docs": 0}, "docs must be a positive integer"),
    ({"drafts": 0}, "drafts must be a positive integer"),
    ({"per_draft": 0}, "per-draft must be a positive integer"),
    ({"max_rationale_tokens": -1}, "max-rationale-tokens"),
    ({"max_answer_tokens": 0}, "max-answer-tokens"),
    ({"docs": True}, "docs must be a positive integer"),
    ({"drafts": 2.0}, "drafts must be a positive integer"),
    ({"docs": 2, "per_draft": 3}, "per-draft (3) cannot exceed docs (2)"),
])
def test_config_validation(index, chat, overrides, fragment):
    with pytest.raises(RetrospecError) as err:
        RagConfig(**(CONFIG | overrides)).validate()
    assert fragment in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RetrospecError, match="must|cannot"):
        make_pipe(index, chat, **overrides)


def test_question_and_method_errors(pipe, index, chat):
    for q in ("", "   ", None):
        with pytest.raises(RetrospecError, match="question is empty"):
            pipe.answer_many(q, ["specrag"])
    with pytest.raises(RetrospecError, match="unknown RAG method nope"):
        pipe.answer("q?", "nope")
    with pytest.raises(RetrospecError, match="unknown RAG method"):
        resolve_methods(" , ")
    assert resolve_methods("specrag, drafter,specrag") == ["specrag", "drafter"]
    long = make_pipe(index, chat, max_rationale_tokens=400)  # prompt + 400 + 4 > 512 positions
    with pytest.raises(RetrospecError, match="does not fit"):
        long.answer(QUESTIONS[0].question, "specrag")
    bare = type(chat)(chat.model, None, "no-tokenizer")
    with pytest.raises(RetrospecError, match="drafter has no tokenizer"):
        RagPipeline(index, bare, chat, RagConfig(**CONFIG))


# ---------------------------------------------------------------------------------------------------------------------
# bench


@pytest.mark.parametrize("text, norm", [
    ("The  Eiffel Tower!", "eiffel tower"), ("An apple, a pear.", "apple pear"), ("  J.S. Bach ", "js bach"),
    ("theatre", "theatre"), ("", ""),
])
def test_normalize(text, norm):
    assert bench.normalize(text) == norm


def test_contains_and_exact_match():
    assert bench.contains_answer("It was Johann Sebastian Bach.", ["Bach"])
    assert bench.contains_answer("paris, of course", ["London", "PARIS"])
    assert not bench.contains_answer("Parisian", ["London"]) and not bench.contains_answer("anything", [])
    assert not bench.contains_answer("anything", ["the"])  # an answer that normalises to nothing never matches
    assert bench.exact_match("The Paris.", ["paris"]) and not bench.exact_match("Paris, France", ["Paris"])
    assert not bench.exact_match("", ["x"]) and not bench.exact_match("x", [])


def test_summarize_means():
    rows = [{"method": "a", "correct": True, "exact": False, "timings": {"latency_s": 1.0, "draft_s": 0.5}},
            {"method": "a", "correct": False, "exact": False, "timings": {"latency_s": 3.0, "draft_s": 0.5}},
            {"method": "b", "correct": True, "exact": True, "timings": {"latency_s": 2.0}}]
    got = {s["method"]: s for s in bench.summarize(rows)}
    assert set(got["a"]) == SUMMARY_KEYS
    assert got["a"]["accuracy"] == 50.0 and got["a"]["exact_match"] == 0.0 and got["a"]["latency_s"] == 2.0
    assert got["a"]["questions"] == 2 and got["a"]["draft_s"] == 0.5 and got["a"]["verify_s"] == 0.0
    assert got["b"]["accuracy"] == got["b"]["exact_match"] == 100.0
    drafted = [{"method": "s", "correct": False, "exact": False, "timings": {}, "answers": ["Paris"],
                "drafts": [{"answer": "Lyon"}, {"answer": "in paris."}]},
               {"method": "s", "correct": False, "exact": False, "timings": {}, "answers": ["Rome"],
                "drafts": [{"answer": "Milan"}]}]
    assert bench.summarize(drafted)[0]["draft_oracle"] == 50.0  # some draft holds the answer in 1 of 2 questions


BENCH_METHODS = ["specrag", "standard", "drafter"]


def _run(pipe, questions, out, **kw):
    return bench.run_bench(pipe, questions, BENCH_METHODS, out, config={"split": "all", "index": "idx"},
                           progress=False, **kw)


@pytest.fixture(scope="module")
def full_bench(pipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "full"
    return out, _run(pipe, QUESTIONS, out)


def test_run_bench_writes_everything(full_bench):
    out, result = full_bench
    assert {p.name for p in out.iterdir()} == {"rows.jsonl", "results.json", "report.md", "accuracy_latency.png"}
    rows = bench.read_rows(out / "rows.jsonl")
    assert len(rows) == len(QUESTIONS) * len(BENCH_METHODS)
    assert [(r["id"], r["method"]) for r in rows] == [(q.id, m) for q in QUESTIONS for m in BENCH_METHODS]
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["config"]["questions"] == 3 and saved["config"]["split"] == "all"
    assert saved["config"]["gold_in_retrieved"] == 100.0  # every gold passage is retrieved in the top 4
    assert [s["method"] for s in saved["summary"]] == BENCH_METHODS
    for s in saved["summary"]:
        assert set(s) - {"draft_oracle"} == SUMMARY_KEYS and s["questions"] == 3
        assert ("draft_oracle" in s) == (s["method"] != "standard")
        mine = [r for r in rows if r["method"] == s["method"]]
        assert s["accuracy"] == pytest.approx(100 * sum(r["correct"] for r in mine) / 3, abs=0.01)
        assert s["latency_s"] == pytest.approx(sum(r["timings"]["latency_s"] for r in mine) / 3, abs=1e-3)
    for r in rows:
        assert r["correct"] == bench.contains_answer(r["output"], r["answers"])
        assert r["exact"] == bench.exact_match(r["output"], r["answers"])
        assert r["gold_retrieved"] and set(r["timings"]) == TIMINGS
        assert (r["drafts"] == []) == (r["method"] == "standard")
    report = (out / "report.md").read_text()
    assert report.startswith("# retrospec rag bench") and all(f"| {m} |" in report for m in BENCH_METHODS)
    assert (out / "accuracy_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_bench_refuses_and_resumes(pipe, full_bench, tmp_path, monkeypatch):
    full_out, full = full_bench
    with pytest.raises(RetrospecError, match="--resume"):
        _run(pipe, QUESTIONS, full_out)
    out = tmp_path / "part"
    _run(pipe, QUESTIONS[:2], out)
    lines = (out / "rows.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 6
    # a run killed while writing question 2: one of its rows written, the next one half-written
    (out / "rows.jsonl").write_text("".join(lines[:4]) + lines[4][:40])
    asked = []
    real = pipe.answer_many
    monkeypatch.setattr(pipe, "answer_many", lambda q, methods: asked.append(q) or real(q, methods))
    result = _run(pipe, QUESTIONS, out, resume=True)
    assert asked == [q.question for q in QUESTIONS[1:]]  # only the questions not done yet
    assert len((out / "rows.jsonl").read_text().splitlines()) == 9  # no corrupt or duplicate line
    rows = bench.read_rows(out / "rows.jsonl")
    assert [(r["id"], r["method"]) for r in rows] == [(q.id, m) for q in QUESTIONS for m in BENCH_METHODS]
    assert [r["output"] for r in rows] == [r["output"] for r in full["rows"]]  # deterministic
    assert result["config"]["questions"] == 3
    asked.clear()
    _run(pipe, QUESTIONS, out, resume=True)  # nothing left to do: the reports are rewritten
    assert asked == []


def test_merge_is_the_union(pipe, full_bench, tmp_path):
    _, full = full_bench
    a, b = tmp_path / "a", tmp_path / "b"
    _run(pipe, QUESTIONS[0::2], a)
    _run(pipe, QUESTIONS[1::2], b)
    merged = bench.merge([a, b, a], tmp_path / "merged")  # a part given twice counts once
    key = lambda r: (r["id"], r["method"])  # noqa: E731
    assert sorted(map(key, merged["rows"])) == sorted(map(key, full["rows"]))
    assert {key(r): r["output"] for r in merged["rows"]} == {key(r): r["output"] for r in full["rows"]}
    assert merged["config"]["questions"] == 3 and merged["config"]["merged_from"] == [str(a), str(b), str(a)]
    assert {s["method"]: s["accuracy"] for s in merged["summary"]} == \
        {s["method"]: s["accuracy"] for s in full["summary"]}
    assert (tmp_path / "merged" / "results.json").is_file() and (tmp_path / "merged" / "report.md").is_file()
    with pytest.raises(RetrospecError, match="not a rag bench directory"):
        bench.merge([a, tmp_path / "nope"], tmp_path / "m2")
    with pytest.raises(RetrospecError, match="no bench rows"):
        bench.write_reports([], tmp_path, {})


def test_passage_fixture_sanity(index):
    assert len(index) == 12 and index.passages[11] == Passage("insulin", "", "Insulin is made by the pancreas.")


def test_score_norm_mean_is_per_token_and_sum_is_the_raw_product(pipe):
    # a long, well-scored rationale against a short, worse-per-token one: the raw product prefers the short one
    long = Draft(["a"], "r", "x", log_draft=-4.0, log_sc=-40.0, log_sr=-1.0, n_draft=40, n_sc=40)  # -1.0 / token
    short = Draft(["b"], "r", "y", log_draft=-3.0, log_sc=-20.0, log_sr=-1.0, n_draft=10, n_sc=10)  # -2.0 / token
    assert pipe._choose("q", [long, short], METHODS["specrag-sum"]) == 1
    assert long.score == pytest.approx(-45.0)
    assert pipe._choose("q", [long, short], METHODS["specrag"]) == 0
    assert long.score == pytest.approx(-4.0 / 40 - 40.0 / 40 - 1.0)
