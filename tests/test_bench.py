"""``retrospec bench`` from the user's side: results.json / report.md / speedup.png, lossless sd and pld at greedy,
MBPP and preset prompt sources, and validation failures (exit 2, one line, no results.json written).
"""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from retrospec.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

ALL_METHODS = ["ar", "sd", "pld", "hf-assisted", "hf-assisted-default", "hf-pld"]
SUMMARY_KEYS = {"method", "tokens_per_s", "speedup", "overhead_free_speedup", "mean_accepted_tokens", "acceptance_rate",
                "lossless"}
RUN_STATS = {"method", "new_tokens", "target_calls", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens",
             "acceptance_rate", "prefill_s", "decode_s", "tokens_per_s"}
MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp_sanitized.jsonl"
PROMPTS = [
    "def wrap(text, width=70):\n    \"\"\"Wrap a single paragraph of text.\"\"\"\n",
    "import os\nclass Wrapper:\n    def __init__(self, width=70):\n        self.width = width\n",
    "for line in lines:\n    if line.strip():\n        yield line\n",
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def bench_args(models, out, *extra, methods="ar,sd,pld", prompts=None, draft=True):
    args = ["bench", "--target", models.target, "--methods", methods, "--out", out]
    if draft:
        args += ["--draft", models.draft]
    if prompts is not None:
        args += ["--prompts", prompts]
    return args + list(extra)


def check_lossless(results: dict, methods=("sd", "pld")) -> None:
    ar = {r["prompt_index"]: r["token_ids"] for r in results["runs"] if r["method"] == "ar"}
    summary = {s["method"]: s for s in results["summary"]}
    for m in methods:
        assert summary[m]["lossless"] is True, summary[m]
        runs = [r for r in results["runs"] if r["method"] == m]
        assert runs and {r["prompt_index"] for r in runs} == set(ar)
        for r in runs:
            assert r["token_ids"] == ar[r["prompt_index"]], (m, r["prompt_index"])


# --- the full bench, every method, once -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_bench(saved_models, tmp_path_factory, single_thread):
    tmp = tmp_path_factory.mktemp("bench_full")
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"prompt": p, "task_id": i} for i, p in enumerate(PROMPTS)])
    out = tmp / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = main([str(a) for a in bench_args(saved_models, out, "--limit", "2", "--max-new-tokens", "12",
                                              methods=",".join(ALL_METHODS), prompts=prompts)])
    assert rc == 0, stderr.getvalue()
    results = json.loads((out / "results.json").read_text())
    return {"out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), "results": results}


def test_outputs_written(full_bench):
    out = full_bench["out"]
    assert (out / "results.json").is_file() and (out / "report.md").is_file()
    png = (out / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert not list(out.glob("*.tmp"))
    assert "Traceback" not in full_bench["stderr"]


def test_results_runs(full_bench):
    runs = full_bench["results"]["runs"]
    assert len(runs) == len(ALL_METHODS) * 2  # --limit 2
    assert {(r["method"], r["prompt_index"]) for r in runs} == {(m, i) for m in ALL_METHODS for i in (0, 1)}
    for r in runs:
        assert {"method", "prompt_index", "token_ids", "stats"} <= r.keys()
        assert all(isinstance(t, int) for t in r["token_ids"])
        assert 1 <= len(r["token_ids"]) <= 12  # --max-new-tokens 12
        assert RUN_STATS <= r["stats"].keys()
        assert r["stats"]["new_tokens"] == len(r["token_ids"])


def test_results_summary(full_bench):
    summary = full_bench["results"]["summary"]
    assert [s["method"] for s in summary] == ALL_METHODS
    for s in summary:
        assert SUMMARY_KEYS <= s.keys()
        for key in SUMMARY_KEYS - {"method", "lossless"}:
            assert isinstance(s[key], (int, float)) and math.isfinite(s[key]) and s[key] >= 0, (s["method"], key)
        assert isinstance(s["lossless"], bool)  # greedy run: a verdict for every method
    by = {s["method"]: s for s in summary}
    assert by["ar"]["speedup"] == pytest.approx(1.0)
    assert by["ar"]["lossless"] is True
    assert by["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert by["sd"]["mean_accepted_tokens"] >= 1.0
    # memory figures: our rows measure them (ar holds no draft state), transformers' generate() rows do not
    assert by["ar"]["draft_state_bytes"] == 0
    sd_runs = [r["stats"] for r in full_bench["results"]["runs"] if r["method"] == "sd"]
    assert all(st["draft_state_bytes"] > 0 for st in sd_runs if st["drafted_tokens"] > 0)  # the gate may not draft
    assert by["ar"]["target_kv_bytes"] > 0 and by["pld"]["target_kv_bytes"] > 0
    assert all(by[m]["draft_state_bytes"] is None and by[m]["target_kv_bytes"] is None
               for m in ALL_METHODS if m.startswith("hf-"))


def test_greedy_sd_and_pld_are_lossless(full_bench):
    check_lossless(full_bench["results"])


def test_report_md_and_console_table(full_bench):
    report = (full_bench["out"] / "report.md").read_text()
    assert ("| method | tokens/s | speedup | no-overhead | tau | acceptance | no-draft | draft state | target KV | lossless |"
            in report)
    rows = {line.split("|")[1].strip(): line for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    assert list(rows) == ALL_METHODS
    assert rows["sd"].rstrip(" |").endswith("yes") and rows["pld"].rstrip(" |").endswith("yes")
    for m in ALL_METHODS:  # the console table (rich may shorten long names to fit 80 columns)
        assert m[:8] in full_bench["stdout"]
    assert "results.json" in full_bench["stdout"]


# --- other prompt sources and modes ---------------------------------------------------------------------------------


@pytest.mark.skipif(not MBPP.is_file(), reason=f"{MBPP} not present")
def test_mbpp_file_as_is(cli, saved_models, tmp_path):
    out = tmp_path / "out"
    res = cli(*bench_args(saved_models, out, "--limit", "2", "--max-new-tokens", "12", "--no-warmup",
                          prompts=MBPP))
    assert res.rc == 0, res.err
    results = json.loads((out / "results.json").read_text())
    assert {r["prompt_index"] for r in results["runs"]} == {0, 1}
    check_lossless(results)


def test_preset_heldout(cli, saved_models, tmp_path):
    out = tmp_path / "out"
    res = cli("bench", "--target", saved_models.target, "--methods", "pld", "--preset", "heldout", "--limit", "1",
              "--max-new-tokens", "8", "--no-warmup", "--out", out)
    assert res.rc == 0, res.err
    results = json.loads((out / "results.json").read_text())
    assert [s["method"] for s in results["summary"]] == ["ar", "pld"]  # ar is always the baseline
    check_lossless(results, methods=("pld",))


def test_knob_flags_reach_the_labels_that_take_them_and_no_others(cli, saved_models, tmp_path):
    """As in ``generate``: a knob flag no benched method takes is an error (not silently dropped), and ``--gamma``
    sets pld's draft length when ``--pld-k`` is not given."""
    base = ("bench", "--target", saved_models.target, "--preset", "heldout", "--limit", "1", "--max-new-tokens", "8",
            "--no-warmup", "--out")
    cli(*base, tmp_path / "a", "--methods", "ar,pld", "--num-drafts", "3").assert_user_error(
        "--num-drafts applies to none of the methods benched")
    res = cli(*base, tmp_path / "b", "--methods", "pld", "--gamma", "3")
    assert res.rc == 0, res.err
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["config"]["pld_k"] == 3
    pld = next(r for r in results["runs"] if r["method"] == "pld")
    assert len(pld["stats"]["per_position_drafted"]) <= 3  # never drafted deeper than 3


def test_sampling_bench_has_no_lossless_verdict(cli, saved_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}])
    out = tmp_path / "out"
    res = cli(*bench_args(saved_models, out, "--temperature", "0.8", "--top-p", "0.9", "--seed", "1",
                          "--max-new-tokens", "8", "--no-warmup", prompts=prompts))
    assert res.rc == 0, res.err
    results = json.loads((out / "results.json").read_text())
    assert [s["lossless"] for s in results["summary"]] == [None, None, None]
    assert "n/a" in (out / "report.md").read_text()


def test_existing_output_directory_is_reused(cli, saved_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[2]}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    res = cli(*bench_args(saved_models, out, "--max-new-tokens", "4", "--no-warmup", methods="pld",
                          prompts=prompts))
    assert res.rc == 0, res.err
    assert json.loads((out / "results.json").read_text())["summary"]


# --- validation failures: one line, exit 2, nothing written ---------------------------------------------------------


def _prompts_file(tmp_path: Path, kind: str) -> Path:
    f = tmp_path / "prompts.jsonl"
    if kind == "missing":
        return tmp_path / "nope.jsonl"
    content = {
        "text": b"def f(x):\n    return x\n",
        "no_prompt": b'{"text": "def f(x):"}\n',
        "prompt_not_str": b'{"prompt": 42}\n',
        "empty_prompt": b'{"prompt": "ok"}\n{"prompt": "   "}\n',
        "empty_file": b"\n\n",
        "scalar": b"5\n",
        "list": b'[{"prompt": "x"}]\n',
        "not_utf8": b'{"prompt": "\xff\xfe\x81"}\n',
        "too_long": json.dumps({"prompt": "value = compute(value, other)\n" * 200}).encode() + b"\n",
        "json_array_file": b'[\n  {"prompt": "x"}\n]\n',
    }[kind]
    f.write_bytes(content)
    return f


@pytest.mark.parametrize("kind,fragment", [
    ("missing", "not found"),
    ("text", "json"),
    ("no_prompt", "prompt"),
    ("prompt_not_str", "prompt"),
    ("empty_prompt", "prompt"),
    ("empty_file", "no prompts"),
    ("scalar", "prompt"),
    ("list", "prompt"),
    ("not_utf8", ""),
    ("too_long", "tokens"),
    ("json_array_file", "json"),
])
def test_bad_prompts_file(cli, saved_models, tmp_path, kind, fragment):
    out = tmp_path / "out"
    f = _prompts_file(tmp_path, kind)
    line = cli(*bench_args(saved_models, out, "--no-warmup", "--max-new-tokens", "4", prompts=f)).assert_user_error(
        fragment)
    assert str(f.name) in line or kind in ("too_long",)
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("case", [
    "unknown_method", "unknown_method_only", "unknown_preset", "limit_0", "max_new_0",
    "temperature", "top_p_0", "top_p_big", "top_k", "gamma_0", "missing_target", "target_no_config",
    "missing_draft", "vocab_size", "vocab_tokens", "sd_without_draft", "hf_assisted_without_draft",
    "context_method_on_prompts",
    "out_is_a_file",
])
def test_bad_bench_options(cli, saved_models, tmp_path, case):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}])
    out = tmp_path / "out"
    (tmp_path / "empty_dir").mkdir()
    m = saved_models
    base = ["--max-new-tokens", "4", "--no-warmup"]
    fragment = ""
    if case == "unknown_method":
        args, fragment = bench_args(m, out, *base, methods="ar,sd,medusa", prompts=prompts), "medusa"
    elif case == "unknown_method_only":
        args, fragment = bench_args(m, out, *base, methods="hf-medusa", prompts=prompts), "hf-medusa"
    elif case == "context_method_on_prompts":  # rapid / rag / lc need rows with a context
        args, fragment = bench_args(m, out, *base, methods="ar,rapid", prompts=prompts), "long-context rows"
    elif case == "unknown_preset":
        args = ["bench", "--target", m.target, "--preset", "nope", "--methods", "pld", "--out", out, *base]
        fragment = "preset"
    elif case == "limit_0":
        args, fragment = bench_args(m, out, *base, "--limit", "0", prompts=prompts), "limit"
    elif case == "max_new_0":
        args, fragment = bench_args(m, out, "--max-new-tokens", "0", prompts=prompts), "max_new_tokens"
    elif case == "temperature":
        args, fragment = bench_args(m, out, *base, "--temperature", "-1", prompts=prompts), "temperature"
    elif case == "top_p_0":
        args, fragment = bench_args(m, out, *base, "--top-p", "0", prompts=prompts), "top_p"
    elif case == "top_p_big":
        args, fragment = bench_args(m, out, *base, "--top-p", "1.5", prompts=prompts), "top_p"
    elif case == "top_k":
        args, fragment = bench_args(m, out, *base, "--top-k", "-2", prompts=prompts), "top_k"
    elif case == "gamma_0":
        args, fragment = bench_args(m, out, *base, "--gamma", "0", prompts=prompts), "gamma"
    elif case == "missing_target":
        args = ["bench", "--target", tmp_path / "nope", "--methods", "pld", "--prompts", prompts, "--out", out, *base]
        fragment = "not found"
    elif case == "target_no_config":
        args = ["bench", "--target", tmp_path / "empty_dir", "--methods", "pld", "--prompts", prompts, "--out", out,
                *base]
        fragment = "config.json"
    elif case == "missing_draft":
        args = ["bench", "--target", m.target, "--draft", tmp_path / "nope", "--methods", "sd", "--prompts", prompts,
                "--out", out, *base]
        fragment = "draft"
    elif case == "vocab_size":
        args = ["bench", "--target", m.target, "--draft", m.draft_other_size, "--prompts", prompts, "--out", out,
                *base]
        fragment = "vocab"
    elif case == "vocab_tokens":
        args = ["bench", "--target", m.target, "--draft", m.draft_other_tokens, "--prompts", prompts, "--out", out,
                *base]
        fragment = "tokenizer"
    elif case == "sd_without_draft":
        args, fragment = bench_args(m, out, *base, methods="ar,sd", prompts=prompts, draft=False), "draft"
    elif case == "hf_assisted_without_draft":
        args, fragment = bench_args(m, out, *base, methods="hf-assisted", prompts=prompts, draft=False), "draft"
    elif case == "out_is_a_file":
        out.write_text("I am a file\n")
        args, fragment = bench_args(m, out, *base, methods="pld", prompts=prompts), "out"
    else:
        raise AssertionError(case)
    cli(*args).assert_user_error(fragment)
    if out.is_dir():
        assert not (out / "results.json").exists()
        assert not (out / "report.md").exists() and not (out / "speedup.png").exists()


@pytest.mark.parametrize("args", [
    ["bench"],
    ["bench", "--prompts", "p.jsonl"],  # no --out
    ["bench", "--out", "o"],  # no --prompts / --preset
    ["bench", "--prompts", "p.jsonl", "--preset", "heldout", "--out", "o"],
    ["bench", "--prompts", "p.jsonl", "--out", "o", "--limit", "two"],
], ids=["nothing", "no-out", "no-prompts", "both-sources", "bad-int"])
def test_bad_bench_command_lines(cli, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    cli(*args).assert_user_error()
    assert not (tmp_path / "o").exists()


# --- gating labels and merged parts ---------------------------------------------------------------------------------


def test_gating_labels_run_side_by_side(cli, saved_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[0]}])
    r = cli(*bench_args(saved_models, tmp_path / "out", "--max-new-tokens", "10", methods="ar,sd,sd@gating=0",
                        prompts=prompts))
    assert r.rc == 0, r.err
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    summary = {s["method"]: s for s in res["summary"]}
    assert summary["sd"]["gating"] is True and summary["sd@gating=0"]["gating"] is False
    assert summary["ar"]["gating"] is False
    check_lossless(res, methods=("sd", "sd@gating=0"))
    assert "no-draft" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("label", ["sd@gating=2", "sd@tree=3x3", "hf-pld@gating=0", "ar@gating=1"])
def test_bad_gating_labels(cli, saved_models, tmp_path, label):
    r = cli(*bench_args(saved_models, tmp_path / "out", methods=f"ar,{label}", prompts=None) + ["--preset", "heldout"])
    r.assert_user_error(label)
    assert not (tmp_path / "out" / "results.json").exists()


def test_merge_parts_is_token_weighted(full_bench, tmp_path):
    from retrospec.bench.merge import main as merge_main

    part = full_bench["out"]
    assert merge_main([str(part), str(part), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    one = {s["method"]: s for s in full_bench["results"]["summary"]}
    assert merged["config"]["prompts"] == 2 * full_bench["results"]["config"]["prompts"]
    assert len(merged["runs"]) == 2 * len(full_bench["results"]["runs"])
    for s in merged["summary"]:
        assert s["new_tokens"] == 2 * one[s["method"]]["new_tokens"]
        assert s["tokens_per_s"] == pytest.approx(one[s["method"]]["tokens_per_s"])
    other = json.loads((part / "results.json").read_text())
    other["config"]["max_new_tokens"] += 1
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "results.json").write_text(json.dumps(other))
    assert merge_main([str(part), str(tmp_path / "o"), "--out", str(tmp_path / "m2")]) == 2


def test_labels_set_any_registry_knob():
    from retrospec.bench.labels import parse_label
    from retrospec.errors import RetrospecError

    lab = parse_label("longspec@lookup=10@gating=0")
    assert lab.knobs == {"lookup": 10} and lab.gating is False
    assert parse_label("pld@max_ngram=4").knobs == {"max_ngram": 4}
    for bad in ("longspec@lookup=-1", "longspec@lookup=x", "longspec@lookup=1@lookup=2", "pld@lookup=3"):
        with pytest.raises(RetrospecError):
            parse_label(bad)
