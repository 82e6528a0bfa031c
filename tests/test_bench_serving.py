"""The serving bench (``python -m retrospec.bench.serving``) against fake OpenAI servers: stdlib HTTP servers in
subprocesses that answer ``/v1/models`` and ``/v1/completions`` and log every request they get.

- each row's server is started on a free port, waited for, warmed up, loaded at each concurrency with
  max(min_requests, per_client × c) greedy completions of distinct prompts, and stopped (no process left);
- the report: one table line per row and level, the JSON fields, the verdict sentence computed from the numbers;
- a server that exits at start, or never answers, gives its row a note (exit code, last log line), not a traceback,
  and the other rows still run;
- vLLM rows without vLLM are skipped with a note, from the command line too; the commands the real rows would run.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from retrospec.bench import serving, vllm_peer
from retrospec.bench.serving import RETROSPEC, VLLM, RowResult, ServerRow

FAKE = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, model, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
        elif self.path == "/version":
            self._send(200, {"version": "0.0-fake"})
        else:
            self._send(404, {"error": {"message": "no route"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock, open(log, "a") as f:
            f.write(json.dumps(body) + "\n")
        if body.get("model") != model:
            return self._send(404, {"error": {"message": "model not found"}})
        if "FAIL" in body["prompt"]:
            return self._send(500, {"error": {"message": "fake failure"}})
        time.sleep(0.01)
        n = body["max_tokens"]
        self._send(200, {"object": "text_completion", "choices": [{"index": 0, "text": "x" * n}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})

print("fake server listening", flush=True)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]


@pytest.fixture
def fake(tmp_path) -> Path:
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE)
    return path


def _fake_row(fake: Path, name: str, server: str, log: Path) -> ServerRow:
    return ServerRow(name, server, [sys.executable, str(fake), serving.PORT, f"model-{name}", str(log)])


def _requests(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def test_rows_levels_table_and_json(fake, tmp_path):
    logs = {n: tmp_path / f"{n}.jsonl" for n in ("ours", "peer")}
    rows = [_fake_row(fake, "ours", RETROSPEC, logs["ours"]), _fake_row(fake, "peer", VLLM, logs["peer"])]
    out = tmp_path / "out"
    doc = serving.run(rows, PROMPTS, out, concurrency=[1, 4], max_tokens=7, per_client=2, min_requests=4, warmup=2,
                      ready_timeout=30, command="python -m retrospec.bench.serving --out out", config={"target": "t"})

    saved = json.loads((out / "results.json").read_text())
    assert saved == doc
    assert doc["config"] | {"target": "t", "concurrency": [1, 4], "max_tokens": 7, "per_client": 2,
                            "min_requests": 4, "warmup": 2, "prompts": len(PROMPTS)} == doc["config"]
    assert doc["machine"]["cores"] >= 1 and doc["date"] and doc["verdict"]
    assert [r["row"] for r in doc["rows"]] == ["ours", "peer"]
    for row in doc["rows"]:
        assert row["note"] == "" and row["version"] == "0.0-fake" and row["startup_s"] > 0
        assert str(fake) in row["command"] and serving.PORT not in row["command"]
        assert [lv["concurrency"] for lv in row["levels"]] == [1, 4]
        for lv in row["levels"]:
            want = max(4, 2 * lv["concurrency"])  # 4 at 1 client, 8 at 4
            assert (lv["requests"], lv["ok"], lv["errors"], lv["completion_tokens"]) == (want, want, 0, 7 * want)
            assert lv["tokens_per_s"] > 0 and lv["requests_per_s"] > 0 and 0 < lv["p50_s"] <= lv["p95_s"]
            assert lv["statuses"] == {"200": want}

    # what the servers got: the served model id, greedy, max_tokens, raw text prompts; 2 warm-up requests, then
    # each level's requests on distinct prompts
    for name, log in logs.items():
        got = _requests(log)
        assert len(got) == 2 + 4 + 8
        assert all(b["model"] == f"model-{name}" and b["temperature"] == 0 and b["max_tokens"] == 7
                   and not b["stream"] for b in got)
        level = sorted(b["prompt"] for b in got[6:])
        assert level == sorted(PROMPTS)  # 8 requests at 4 clients: each of the 8 prompts once
        assert (tmp_path / "out" / "logs" / f"{name}.log").read_text().startswith("fake server listening")

    md = (out / "report.md").read_text()
    table = [ln for ln in md.splitlines() if ln.startswith("| `")]
    assert len(table) == 4
    assert table[0].startswith("| `ours` | retrospec serve | 1 | 4 |") and table[0].endswith("| 0 |")
    assert table[3].startswith("| `peer` | vLLM | 4 | 8 |")
    assert doc["verdict"] in md and "python -m retrospec.bench.serving --out out" in md


def test_a_server_that_fails_or_hangs_gives_a_note_and_the_others_still_run(fake, tmp_path):
    rows = [ServerRow("dies", RETROSPEC, [sys.executable, "-c", "import sys; print('boom: no such model', "
                                                               "file=sys.stderr); sys.exit(3)"]),
            ServerRow("hangs", VLLM, [sys.executable, "-c", "import time; print('compiling...', flush=True); "
                                                            "time.sleep(120)"]),
            ServerRow("missing", VLLM, [str(tmp_path / "no-such-python"), "-m", "vllm"]),
            _fake_row(fake, "fine", RETROSPEC, tmp_path / "fine.jsonl")]
    doc = serving.run(rows, PROMPTS, tmp_path / "out", concurrency=[2], warmup=1, ready_timeout=2)
    by = {r["row"]: r for r in doc["rows"]}
    assert by["dies"]["note"].startswith("failed: the server exited with code 3 before answering /v1/models")
    assert "boom: no such model" in by["dies"]["note"] and by["dies"]["levels"] == []
    assert "did not answer /v1/models within 2 s" in by["hangs"]["note"] and "compiling..." in by["hangs"]["note"]
    assert by["missing"]["note"].startswith("failed: the server could not be started")
    assert by["fine"]["note"] == "" and by["fine"]["levels"][0]["ok"] == 4
    assert doc["verdict"] == "No comparison: no vLLM row was measured."
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- `dies`: failed: the server exited with code 3" in md and "- `hangs`: failed:" in md


def test_failed_requests_are_counted_and_a_dead_warmup_ends_the_row(fake, tmp_path):
    row = _fake_row(fake, "half", RETROSPEC, tmp_path / "half.jsonl")
    doc = serving.run([row], ["ok prompt", "FAIL prompt"], tmp_path / "a", concurrency=[1], warmup=0)
    lv = doc["rows"][0]["levels"][0]
    assert (lv["requests"], lv["ok"], lv["errors"], lv["statuses"]) == (4, 2, 2, {"200": 2, "500": 2})
    assert lv["first_error"] == "fake failure"
    doc = serving.run([row], ["FAIL prompt"], tmp_path / "b", concurrency=[1], warmup=2)
    assert doc["rows"][0]["note"] == "failed: every warm-up request failed (fake failure)"
    assert doc["rows"][0]["levels"] == []


def _level(c: int, tps: float) -> dict:
    return {"concurrency": c, "tokens_per_s": tps, "ok": 4}


def test_the_verdict_is_computed_from_the_numbers():
    ours = RowResult("retrospec", RETROSPEC, levels=[_level(1, 40.0), _level(4, 41.0), _level(16, 40.5)])
    ar = RowResult("retrospec-ar", RETROSPEC, levels=[_level(1, 20.0), _level(4, 20.0), _level(16, 20.0)])
    vllm = RowResult("vllm", VLLM, levels=[_level(1, 20.0), _level(4, 35.0), _level(16, 90.0)])
    ngram = RowResult("vllm-ngram", VLLM, levels=[_level(1, 30.0), _level(4, 45.5), _level(16, 80.0)])
    assert serving.verdict([ours, ar, vllm, ngram]) == (
        "vLLM overtakes retrospec serve in completion tokens/s at 4 concurrent clients: vllm-ngram 45.5 tok/s "
        "against retrospec 41.0 tok/s (at 1: vllm-ngram 30.0 against retrospec 40.0).")
    assert serving.verdict([ours, vllm]).startswith("vLLM overtakes retrospec serve in completion tokens/s at 16 "
                                                    "concurrent clients: vllm 90.0 tok/s against retrospec 40.5")
    assert serving.verdict([ar, ngram]).startswith("vLLM overtakes retrospec serve in completion tokens/s already "
                                                   "at 1 client: vllm-ngram 30.0 tok/s against retrospec-ar 20.0")
    slow = RowResult("vllm", VLLM, levels=[_level(1, 10.0), _level(4, 20.0), _level(16, 30.0)])
    assert serving.verdict([ours, slow]) == ("vLLM does not overtake retrospec serve within 16 concurrent clients: "
                                             "at 16, vllm 30.0 tok/s against retrospec 40.5 tok/s.")
    assert serving.verdict([ours, RowResult("vllm", VLLM, note="skipped: vLLM is not installed")]) == (
        "No comparison: no vLLM row was measured.")


def test_without_vllm_its_rows_are_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    out = tmp_path / "out"
    rc = serving.main(["--out", str(out), "--rows", "vllm,vllm-ngram,vllm-retrospec", "--concurrency", "1,4"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in doc["rows"]] == ["vllm", "vllm-ngram", "vllm-retrospec"]
    for r in doc["rows"]:
        assert r["note"] == "skipped: vLLM is not installed (make peers-vllm, or $RETROSPEC_VLLM_PYTHON)"
        assert r["levels"] == [] and r["command"] == ""
    assert doc["config"]["concurrency"] == [1, 4] and doc["config"]["target"] == "smollm2-135m"
    assert doc["verdict"] == "No comparison: no retrospec serve row was measured."
    err = capsys.readouterr().err
    assert "vllm-ngram: skipped: vLLM is not installed" in err and "Traceback" not in err
    assert "- `vllm-retrospec`: skipped: vLLM is not installed" in (out / "report.md").read_text()
    assert serving.main(["--out", str(out), "--rows", "vllm,nope"]) == 2
    assert "unknown row(s) nope" in capsys.readouterr().err


def test_the_commands_of_the_real_rows(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(python))
    rows = {r.name: r for r in serving.build_rows(list(serving.ROWS), target=str(ckpt), threads=2, k=5,
                                                  max_ngram=3)}
    assert list(rows) == list(serving.ROWS) and not any(r.note for r in rows.values())
    ours, ar = rows["retrospec"].argv, rows["retrospec-ar"].argv
    assert ours[ours.index("serve") + 1:ours.index("serve") + 5] == ["--target", str(ckpt), "--dtype", "float32"]
    assert "--method" not in ours and ar[-2:] == ["--method", "ar"] and serving.PORT in ours
    for name in ("vllm", "vllm-ngram", "vllm-retrospec"):
        argv, env = rows[name].argv, rows[name].env
        assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
        assert argv[argv.index("--model") + 1] == str(ckpt.resolve()) and "--no-enable-prefix-caching" in argv
        assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--port") + 1] == serving.PORT
        assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "--speculative-config" not in rows["vllm"].argv
    spec = {n: json.loads(rows[n].argv[rows[n].argv.index("--speculative-config") + 1])
            for n in ("vllm-ngram", "vllm-retrospec")}
    assert spec["vllm-ngram"] == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1}
    assert spec["vllm-retrospec"] == {"method": "custom_class", "model": vllm_peer.PROPOSER,
                                      "num_speculative_tokens": 5}
    assert rows["vllm-retrospec"].env["RETROSPEC_PLD_MAX_NGRAM"] == "3"
    notes = {r.name: r.note for r in serving.build_rows(["vllm", "retrospec"], target=str(ckpt), dtype="int4")}
    assert notes == {"retrospec": "", "vllm": "skipped: vLLM's CPU build has no format matching int4"}
    notes = [r.note for r in serving.build_rows(["vllm"], target=str(tmp_path))]  # a directory without config.json
    assert notes == [f"skipped: vLLM needs the target's checkpoint directory (no config.json in {tmp_path.name})"]
