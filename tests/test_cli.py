"""``retrospec generate`` from the user's side: the --json contract, streaming, and one-line errors (exit 2).

Most cases call ``retrospec.cli.main`` in-process (fast); two run the installed console script in a real process to
prove the exit code and the absence of tracebacks outside pytest.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "def dedent(text):\n    "
JSON_STATS = ("method", "new_tokens", "target_calls", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens",
              "acceptance_rate", "prefill_s", "decode_s", "tokens_per_s")


@pytest.fixture(scope="module")
def models(saved_models):
    return saved_models


def gen_args(models, *extra, method="sd", prompt=PROMPT, n=16):
    args = ["generate", "--target", models.target, "--method", method, "--max-new-tokens", n]
    if method == "sd":
        args += ["--draft", models.draft]
    if prompt is not None:
        args += ["--prompt", prompt]
    return args + list(extra)


def run_json(cli, models, *extra, **kw) -> dict:
    res = cli(*gen_args(models, "--json", *extra, **kw))
    assert res.rc == 0, res.err
    assert "Traceback" not in res.err
    lines = [ln for ln in res.out.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON object, got {res.out!r}"
    return json.loads(lines[0])


# --- success: --json ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_json_output_contract(cli, models, method):
    n = 16
    # ungated: the contract includes drafting statistics, and the gate may (by timing) skip drafting on tiny models
    obj = run_json(cli, models, *(("--no-gating",) if method == "sd" else ()), method=method, n=n)
    assert {"text", "token_ids", "stats"} <= obj.keys()
    stats = obj["stats"]
    assert set(JSON_STATS) <= stats.keys()
    assert stats["method"] == method
    ids = obj["token_ids"]
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert 1 <= len(ids) <= n
    assert stats["new_tokens"] == len(ids)
    if len(ids) < n:  # stopped early: only at EOS
        assert ids[-1] == models.eos_id
    # token_ids are the generated ids only (not the prompt), and text is their decoding
    tok = AutoTokenizer.from_pretrained(models.target)
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] != prompt_ids
    assert obj["text"] == tok.decode(ids, skip_special_tokens=True)
    # statistics are consistent with their documented definitions
    assert 1 <= stats["target_calls"] <= stats["new_tokens"]
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert math.isclose(stats["mean_accepted_tokens"], stats["new_tokens"] / stats["target_calls"])
    if stats["drafted_tokens"]:
        assert math.isclose(stats["acceptance_rate"], stats["accepted_tokens"] / stats["drafted_tokens"])
    for key in ("prefill_s", "decode_s", "tokens_per_s"):
        assert isinstance(stats[key], (int, float)) and stats[key] >= 0
    if method == "ar":
        assert stats["drafted_tokens"] == 0 and stats["target_calls"] == stats["new_tokens"]
        assert stats["mean_accepted_tokens"] == 1.0
    elif method == "sd":
        assert stats["drafted_tokens"] > 0  # pld drafts only when an n-gram repeats


def test_greedy_sd_and_pld_equal_ar(cli, models):
    n = 40
    ar = run_json(cli, models, method="ar", n=n)
    for method in ("sd", "pld"):
        for gamma in ("1", "4"):
            obj = run_json(cli, models, "--gamma", gamma, method=method, n=n)
            assert obj["token_ids"] == ar["token_ids"], (method, gamma)
            assert obj["text"] == ar["text"]
    # the tiny early-exit draft is accepted sometimes: speculation actually happened (ungated, so it always drafts)
    sd = run_json(cli, models, "--no-gating", method="sd", n=n)
    assert sd["stats"]["accepted_tokens"] > 0
    assert sd["stats"]["target_calls"] < ar["stats"]["target_calls"]


def test_gamma_bounds_the_draft_length(cli, models):
    obj = run_json(cli, models, "--gamma", "2", method="sd", n=30)
    st = obj["stats"]
    # the first target call is the prompt (no draft); each later call verifies at most gamma drafted tokens
    assert st["drafted_tokens"] <= 2 * (st["target_calls"] - 1)


def test_prompt_file_equals_prompt(cli, models, tmp_path):
    f = tmp_path / "prompt.py"
    f.write_text(PROMPT, encoding="utf-8")
    from_file = run_json(cli, models, "--prompt-file", f, prompt=None, method="ar")
    inline = run_json(cli, models, method="ar")
    assert from_file["token_ids"] == inline["token_ids"]


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_sampling_with_seed_is_reproducible(cli, models, method):
    knobs = ("--temperature", "0.9", "--top-p", "0.95", "--top-k", "50", "--seed", "7")
    a = run_json(cli, models, *knobs, method=method, n=20)
    b = run_json(cli, models, *knobs, method=method, n=20)
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["new_tokens"] == len(a["token_ids"])


def test_top_k_larger_than_vocab_is_accepted(cli, models):
    obj = run_json(cli, models, "--temperature", "1.0", "--top-k", str(10 * models.vocab_size), "--seed", "0",
                   method="sd", n=8)
    assert 1 <= len(obj["token_ids"]) <= 8


def test_streaming_prints_text_and_one_summary_line(cli, models):
    obj = run_json(cli, models, method="sd", n=24)
    res = cli(*gen_args(models, method="sd", n=24))
    assert res.rc == 0
    assert res.out == obj["text"]  # streamed pieces, nothing else on stdout
    summary = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(summary) == 1, res.err
    assert "sd" in summary[0] and "tok" in summary[0]
    assert "Traceback" not in res.err


def test_prompt_at_position_limit_stops_cleanly(cli, models):
    tok = AutoTokenizer.from_pretrained(models.target)
    ids = tok(PROMPT * 200, add_special_tokens=False)["input_ids"][: models.max_positions - 3]
    prompt = tok.decode(ids)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) < models.max_positions
    outs = {m: run_json(cli, models, method=m, prompt=prompt, n=50)["token_ids"] for m in ("ar", "sd", "pld")}
    assert 1 <= len(outs["ar"]) <= 3
    assert outs["sd"] == outs["ar"] and outs["pld"] == outs["ar"]


# --- user errors: one line, exit 2 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_dirs(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_models")
    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"")
    corrupt = root / "corrupt"
    shutil.copytree(models.target, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"this is not a safetensors file" * 10)
    truncated = root / "truncated"
    shutil.copytree(models.target, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {"missing": root / "does_not_exist", "no_config": no_config, "corrupt": corrupt, "truncated": truncated}


@pytest.mark.parametrize("which", ["missing", "no_config", "corrupt", "truncated"])
def test_bad_target_directory(cli, models, bad_dirs, which):
    args = ["generate", "--target", bad_dirs[which], "--draft", models.draft, "--prompt", PROMPT]
    line = cli(*args).assert_user_error()
    assert str(bad_dirs[which]) in line


@pytest.mark.parametrize("which", ["missing", "no_config", "corrupt"])
def test_bad_draft_directory(cli, models, bad_dirs, which):
    res = cli("generate", "--target", models.target, "--draft", bad_dirs[which], "--method", "sd", "--prompt", PROMPT)
    assert str(bad_dirs[which]) in res.assert_user_error("draft")


def test_target_path_is_a_file(cli, models):
    res = cli("generate", "--target", models.target / "config.json", "--method", "ar", "--prompt", PROMPT)
    res.assert_user_error("config.json")


def test_draft_vocab_size_mismatch(cli, models):
    res = cli("generate", "--target", models.target, "--draft", models.draft_other_size, "--prompt", PROMPT)
    res.assert_user_error("vocab")


def test_draft_same_size_different_tokenizer(cli, models):
    res = cli("generate", "--target", models.target, "--draft", models.draft_other_tokens, "--prompt", PROMPT)
    res.assert_user_error("tokenizer")


def test_sd_without_draft_when_target_given(cli, models):
    cli("generate", "--target", models.target, "--method", "sd", "--prompt", PROMPT).assert_user_error("draft")


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t \n"], ids=["empty", "spaces", "whitespace"])
@pytest.mark.parametrize("method", ["ar", "sd"])
def test_empty_or_whitespace_prompt(cli, models, prompt, method):
    cli(*gen_args(models, method=method, prompt=prompt)).assert_user_error("prompt")


def test_missing_prompt_file(cli, models, tmp_path):
    missing = tmp_path / "nope.txt"
    line = cli(*gen_args(models, "--prompt-file", missing, prompt=None)).assert_user_error("prompt file")
    assert str(missing) in line


def test_prompt_file_empty_or_not_text(cli, models, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cli(*gen_args(models, "--prompt-file", empty, prompt=None)).assert_user_error("prompt")
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 20)
    cli(*gen_args(models, "--prompt-file", binary, prompt=None)).assert_user_error("prompt file")
    cli(*gen_args(models, "--prompt-file", tmp_path, prompt=None)).assert_user_error("prompt file")


def test_prompt_longer_than_max_positions(cli, models):
    long_prompt = "result = compute(value, other_value)\n" * 200
    cli(*gen_args(models, prompt=long_prompt)).assert_user_error("positions")


@pytest.mark.parametrize("flag,value,fragment", [
    ("--max-new-tokens", "0", "max_new_tokens"),
    ("--max-new-tokens", "-5", "max_new_tokens"),
    ("--temperature", "-0.5", "temperature"),
    ("--temperature", "nan", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--top-p", "-0.2", "top_p"),
    ("--top-k", "-1", "top_k"),
    ("--gamma", "0", "gamma"),
    ("--gamma", "-3", "gamma"),
])
@pytest.mark.parametrize("method", ["sd", "pld"])
def test_bad_knobs(cli, models, flag, value, fragment, method):
    res = cli(*gen_args(models, method=method), flag, value)
    res.assert_user_error(fragment)


@pytest.mark.parametrize("method", ["beam", "SD", "hf-assisted", ""])
def test_unknown_method(cli, models, method):
    cli(*gen_args(models, method="ar"), "--method", method).assert_user_error("method")


@pytest.mark.parametrize("args", [
    [],
    ["frobnicate"],
    ["generate"],
    ["generate", "--target", "x"],
    ["generate", "--prompt", "a", "--prompt-file", "b"],
    ["generate", "--prompt", "a", "--max-new-tokens", "ten"],
    ["generate", "--prompt", "a", "--temperature", "hot"],
    ["generate", "--prompt", "a", "--no-such-flag"],
    ["generate", "--prompt"],
], ids=["nothing", "unknown-command", "no-prompt", "target-only", "both-prompts", "bad-int", "bad-float",
        "unknown-flag", "flag-without-value"])
def test_bad_command_lines(cli, args):
    cli(*args).assert_user_error()


def test_help_is_not_an_error(cli):
    res = cli("generate", "--help")
    assert res.rc == 0
    for flag in ("--target", "--draft", "--method", "--prompt", "--prompt-file", "--max-new-tokens", "--temperature",
                 "--top-p", "--top-k", "--seed", "--gamma", "--json"):
        assert flag in res.out


# --- a real process -------------------------------------------------------------------------------------------------


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("retrospec")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from retrospec.cli import entry; entry()"]


def _run(args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run(_console_script() + [str(a) for a in args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_subprocess_error_exit_code_and_single_line(models, tmp_path):
    proc = _run(["generate", "--target", tmp_path / "missing", "--draft", models.draft, "--prompt", PROMPT,
                 "--json"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("retrospec: error:"), proc.stderr


def test_subprocess_json_success(models, tmp_path):
    proc = _run(gen_args(models, "--json", method="sd", n=12), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    obj = json.loads(proc.stdout)
    assert set(JSON_STATS) <= obj["stats"].keys()
    assert obj["stats"]["new_tokens"] == len(obj["token_ids"]) <= 12
