"""``python -m retrospec.demo`` end to end on tiny chat models (seconds), and its user errors (the CLI contract)."""

from __future__ import annotations

import json

from retrospec import demo

from conftest import CliRun


def _run(capsys, *args) -> CliRun:
    capsys.readouterr()
    rc = demo.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return CliRun(rc, out, err)


def test_demo_streams_a_chat_reply_and_writes_the_bench(capsys, tmp_path, chat_models, single_thread, monkeypatch):
    from retrospec.bench import llamacpp

    monkeypatch.setenv(llamacpp.PYTHON_ENV, str(tmp_path / "no-peer" / "python"))  # llama.cpp not installed
    out = tmp_path / "demo"
    r = _run(capsys, "--target", chat_models.target, "--draft", chat_models.draft, "--prompts", 1,
             "--max-new-tokens", 4, "--out", out)
    assert r.rc == 0, r.err
    assert "user:" in r.out and "assistant:" in r.out and "[sd]" in r.out
    assert "profile: one target forward on this machine (float32, context 300)" in r.out
    assert "floor: float32 weights" in r.out and "a one-token step here is" in r.out
    assert "llama.cpp rows: its peer environment is not installed here (make peers" in r.out
    for name in ("results.json", "report.md", "speedup.png"):
        assert (out / name).is_file()
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["chat"] is True
    assert [s["method"] for s in result["summary"]] == demo.METHODS  # no bundled block fits these targets
    assert all(s["lossless"] for s in result["summary"])
    code = json.loads((out / "code" / "results.json").read_text())  # the second set: held-out code, raw completion
    assert code["config"]["chat"] is False and len(code["runs"]) == len(demo.METHODS)
    assert all(s["lossless"] for s in code["summary"])


def test_demo_user_errors_are_one_line(capsys, tmp_path, chat_models):
    _run(capsys, "--target", chat_models.target, "--draft", tmp_path / "missing").assert_user_error("draft",
                                                                                                    "not found")
    _run(capsys, "--target", chat_models.target).assert_user_error("no paired draft")
    _run(capsys, "--prompts", 0).assert_user_error("--prompts")
    _run(capsys, "--bogus").assert_user_error("unrecognized")


def test_demo_zoo_mode(capsys, tmp_path, single_thread):
    out = tmp_path / "zoo"
    r = _run(capsys, "--zoo", "--prompts", 1, "--max-new-tokens", 4, "--out", out)
    assert r.rc == 0, r.err
    assert "bundled zoo" in r.out and "[longspec]" in r.out  # the zoo target's bundled block streams the reply
    assert not (out / "code").exists()  # the zoo's one set is already code
    result = json.loads((out / "results.json").read_text())
    assert (out / "report.md").is_file() and not result["config"]["chat"]
    assert [s["method"] for s in result["summary"]] == demo.methods_for(True)  # zoo-longspec fits the zoo target
    assert demo.methods_for(True).index("longspec") == demo.METHODS.index("pld") + 1
    assert all(s["lossless"] for s in result["summary"])
