"""``retrospec bench`` for long-context drafters: ``longspec`` (chain and tree labels) and ``magicdec`` in the prompt
bench, the ``m@key=value`` label syntax, the memory figures, and the long-code-completion presets (``lcc*``).

The bench runs use the tiny saved checkpoint of ``conftest.saved_models`` and a random LongSpec block bound to it
(``test_longspec.randomized``); the ``lcc`` prompts are cut with the bundled zoo tokenizer (no model runs).
"""

from __future__ import annotations

import json

import pytest
from test_bench import PROMPTS, check_lossless, write_jsonl
from test_longspec import randomized

from retrospec.bench.labels import MethodLabel, parse_label
from retrospec.errors import RetrospecError
from retrospec.models.longspec import save_longspec
from retrospec.stdlib_corpus import stdlib_root
from retrospec.tasks import LCC_RANGE, preset

pytestmark = pytest.mark.usefixtures("single_thread")

LONG_METHODS = ["longspec", "longspec@gamma=3@lookup=0", "longspec@tree=2x2@lookup=0", "magicdec@window=8"]


@pytest.fixture(scope="module")
def block_dir(saved_models, tmp_path_factory):
    from retrospec.models import load_model

    tgt = load_model(str(saved_models.target))
    return save_longspec(randomized(tgt.model, window=16, std=0.1), tgt, tmp_path_factory.mktemp("blk") / "blk")


@pytest.fixture(scope="module")
def long_bench(saved_models, block_dir, tmp_path_factory):
    from retrospec.cli import main

    tmp = tmp_path_factory.mktemp("bench_long")
    prompts = write_jsonl(tmp / "p.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    out = tmp / "out"
    rc = main(["bench", "--target", str(saved_models.target), "--draft", str(saved_models.draft), "--methods",
               ",".join(["sd", "pld", *LONG_METHODS]), "--longspec-draft", str(block_dir), "--prompts", str(prompts),
               "--max-new-tokens", "12", "--no-warmup", "--no-gating", "--out", str(out)])
    assert rc == 0
    return {"out": out, "results": json.loads((out / "results.json").read_text()), "prompts": PROMPTS[:2]}


def test_longspec_and_magicdec_are_lossless(long_bench):
    res = long_bench["results"]
    assert [s["method"] for s in res["summary"]] == ["ar", "sd", "pld", *LONG_METHODS]
    check_lossless(res, methods=("sd", "pld", *LONG_METHODS))
    by = {s["method"]: s for s in res["summary"]}
    assert all(by[m]["mean_accepted_tokens"] >= 1.0 for m in LONG_METHODS)
    runs = {(r["method"], r["prompt_index"]): r["stats"] for r in res["runs"]}
    for m in LONG_METHODS:  # --no-gating: every step drafted
        assert runs[(m, 0)]["drafted_tokens"] > 0, m
    assert len(runs[("longspec@gamma=3@lookup=0", 0)]["per_position_drafted"]) == 3  # a chain of 3
    assert len(runs[("longspec@tree=2x2@lookup=0", 0)]["per_position_drafted"]) == 2  # a tree of depth 2
    assert len(runs[("longspec", 0)]["per_position_drafted"]) >= 2  # the default tree (4 + 7 nodes within 12 tokens)
    assert res["config"]["longspec_draft"].endswith("blk")
    assert res["config"]["method_options"]["longspec"]["draft"] == "LongSpecDraft"


def test_memory_figures(long_bench, saved_models):
    res = long_bench["results"]
    by = {s["method"]: s for s in res["summary"]}
    assert by["ar"]["draft_state_bytes"] == 0
    for m in ("sd", "pld", *LONG_METHODS):
        assert by[m]["draft_state_bytes"] > 0, m
    # longspec's state is its fixed ring buffer: the same whatever the labels' chain or tree
    assert by["longspec"]["draft_state_bytes"] == by["longspec@gamma=3@lookup=0"]["draft_state_bytes"]
    # the target's cache at the end: every committed token but the last, 2 layers x (k, v) x 2 kv heads x 8 x fp32
    from retrospec.models import load_model

    tok = load_model(str(saved_models.target)).tokenizer
    ends = []
    for r in res["runs"]:
        if r["method"] == "ar":
            n = len(tok(long_bench["prompts"][r["prompt_index"]], add_special_tokens=False)["input_ids"])
            ends.append(n + len(r["token_ids"]) - 1)
            assert r["stats"]["target_kv_bytes"] == 2 * 2 * 2 * 8 * 4 * ends[-1]
    for m in ("ar", "sd", *LONG_METHODS):
        assert by[m]["target_kv_bytes"] == 2 * 2 * 2 * 8 * 4 * max(ends), m
    report = (long_bench["out"] / "report.md").read_text()
    assert "| draft state | target KV | lossless |" in report
    assert "KiB" in report and "longspec block" in report


@pytest.mark.parametrize("label,want", [
    ("sd", MethodLabel("sd")),
    ("rest@gating=0", MethodLabel("rest", gating=False)),
    ("longspec@gamma=4", MethodLabel("longspec", gamma=4)),
    ("longspec@tree=4x8x8", MethodLabel("longspec", tree=(4, 8, 8))),
    ("longspec@tree=4@gating=1", MethodLabel("longspec", gating=True, tree=(4,))),
    ("magicdec@gating=0", MethodLabel("magicdec", gating=False)),
    ("pld@gamma=7", MethodLabel("pld", gamma=7)),
])
def test_parse_good_labels(label, want):
    assert parse_label(label) == want


@pytest.mark.parametrize("label,fragment", [
    ("sd@gamma=0", "gamma takes"),
    ("sd@gamma=x", "gamma takes"),
    ("sd@tree=4x4", "longspec only"),
    ("longspec@tree=4x0", "tree takes"),
    ("longspec@tree=", "tree takes"),
    ("longspec@gamma=2@tree=2x2", "not both"),
    ("sd@gating=0@gating=1", "twice"),
    ("sd@window=3", "options are"),
    ("sd@gamma", "options are"),
    ("ar@gamma=3", "not to ar"),
    ("hf-pld@gating=0", "not to hf-pld"),
    ("rest@gamma=3", "draft-len"),
])
def test_parse_bad_labels(label, fragment):
    with pytest.raises(RetrospecError) as err:
        parse_label(label)
    assert label in str(err.value) and fragment in str(err.value) and "\n" not in str(err.value)


def test_longspec_draft_errors(cli, saved_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}])
    base = ["bench", "--target", saved_models.target, "--prompts", prompts, "--max-new-tokens", "4", "--no-warmup",
            "--out", tmp_path / "out"]
    cli(*base, "--methods", "longspec", "--longspec-draft", tmp_path / "nope").assert_user_error("not found")
    cli(*base, "--methods", "pld,longspec@gamma=2").assert_user_error("--longspec-draft")
    cli(*base, "--methods", "ar,sd@tree=2x2").assert_user_error("sd@tree=2x2")
    assert not (tmp_path / "out" / "results.json").exists()


# --- long code completion prompts ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoo_tokenizer():
    from retrospec.models import load_model

    return load_model("zoo").tokenizer


def _check_lcc_rows(rows, tok, lo, hi):
    root = stdlib_root()
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        assert r["prompt_tokens"] == len(ids) and lo <= len(ids) <= hi, (r["source"], len(ids))
        assert r["prompt"].startswith("# file: ") and r["prompt"].endswith("\n")  # ends at the start of a line
        lines = (root / r["cut_file"]).read_text(encoding="utf-8").splitlines()
        nxt = lines[r["cut_line"] - 1]  # the line the model continues with: code, inside a function body mostly
        assert nxt.strip() and (nxt[0] in " \t" or not r["mid_function"]), (r["source"], nxt)
        assert r["prompt"].endswith(lines[r["cut_line"] - 2] + "\n")
        assert r["cut_file"] in r["source"] and r["packages"][0] in r["source"]
    assert len({(r["first_file"], r["cut_file"], r["cut_line"]) for r in rows}) == len(rows)
    assert sum(r["mid_function"] for r in rows) >= len(rows) - 1


def test_lcc_preset(zoo_tokenizer):
    rows = preset("lcc", 5, tokenizer=zoo_tokenizer)
    assert len(rows) == 5
    _check_lcc_rows(rows, zoo_tokenizer, *LCC_RANGE)
    counts = [r["prompt_tokens"] for r in rows]
    goals = [4096, 4864, 5632, 6400, 7168]  # spread evenly over 4K-7K
    assert all(abs(c - g) <= 256 for c, g in zip(counts, goals)), counts
    assert len({r["packages"][0] for r in rows}) == 4  # every held-out package
    assert preset("lcc", 5, tokenizer=zoo_tokenizer) == rows  # deterministic


def test_lcc_fixed_length_preset(zoo_tokenizer):
    rows = preset("lcc-8k", 2, tokenizer=zoo_tokenizer)
    _check_lcc_rows(rows, zoo_tokenizer, 8192 - 256, 8192)
    with pytest.raises(RetrospecError, match="tokenizer"):
        preset("lcc-16k", 1)


def test_lcc_bench_errors(cli, saved_models, tmp_path):
    base = ["bench", "--target", saved_models.target, "--methods", "pld", "--max-new-tokens", "8", "--out",
            tmp_path / "out"]
    cli(*base, "--preset", "lcc").assert_user_error("lcc", "positions", str(saved_models.max_positions))
    cli(*base, "--preset", "lcc-8k", "--chat").assert_user_error("--chat")
