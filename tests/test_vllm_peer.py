"""vLLM as a bench peer, on a fake ``vllm`` package (the real one is a 130 MB wheel with its own pins: ``make
peers-vllm``).

- the real worker script (``bench/vllm_worker.py``) runs in a subprocess against the fake package: one engine per
  row kind on the target's checkpoint directory (prefix caching off; the n-gram proposer with our ``pld`` k and
  n-gram size for ``vllm-ngram``), greedy on the same token ids our methods get, a one-token request then the whole
  one (decode time = the difference), stopping at EOS or ``max_new_tokens``; vLLM's prints never reach the answers;
- the bench gains ``vllm-ar`` / ``vllm-ngram`` rows, the peer's version and model in the config;
- without the peer, with sampling, or in a format vLLM's CPU build does not run, the rows are skipped with a note.
"""

from __future__ import annotations

import stat
import sys

import numpy as np
import pytest

from retrospec.bench import vllm_peer
from retrospec.drafters.prompt_lookup import lookup
from retrospec.integrations.vllm_proposer import MAX_NGRAM_ENV, PromptLookupProposer

from conftest import bench_two_prompts

FAKE = '''
import os
__version__ = "0.0-fake"
LOG = os.environ["FAKE_VLLM_LOG"]

class SamplingParams:
    def __init__(self, temperature, max_tokens, stop_token_ids, detokenize):
        assert temperature == 0.0 and not detokenize
        self.max_tokens, self.stop = max_tokens, set(stop_token_ids)

class _Seq:
    def __init__(self, ids):
        self.token_ids = ids

class _Out:
    def __init__(self, ids):
        self.outputs = [_Seq(ids)]

class LLM:
    def __init__(self, model, dtype, max_model_len, enable_prefix_caching, gpu_memory_utilization, seed,
                 speculative_config=None):
        assert os.path.isfile(os.path.join(model, "config.json")) and dtype == "float32"
        assert not enable_prefix_caching and max_model_len > 0
        print("vLLM says hello on stdout")  # the worker keeps its answers' channel clean,
        os.write(1, b"an engine process writes to fd 1\\n")  # also from the processes vLLM starts
        with open(LOG, "a") as f:
            f.write(f"load {os.path.basename(model)} spec={speculative_config} "
                    f"ngram_env={os.environ.get('RETROSPEC_PLD_MAX_NGRAM')}\\n")

    def generate(self, prompts, params, use_tqdm):
        assert len(prompts) == 1 and not use_tqdm
        t, out = prompts[0]["prompt_token_ids"][-1], []
        while len(out) < params.max_tokens:  # a deterministic stand-in: the next id, then the next
            t = (t + 1) % 90
            out.append(t)
            if t in params.stop:
                break
        return [_Out(out)]
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    log = tmp_path / "peer.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, sys.executable)
    return log


_bench = bench_two_prompts


def test_vllm_rows_run_the_worker_on_the_same_ids(cli, saved_models, tmp_path, fake_vllm):
    res, got = _bench(cli, saved_models, tmp_path, "ar,vllm-ar,vllm-ngram,vllm-retrospec,vllm-suffix", "--pld-k", "4")
    assert res.rc == 0, res.err
    rows = {s["method"]: s for s in got["summary"]}
    assert set(rows) == {"ar", "vllm-ar", "vllm-ngram", "vllm-retrospec", "vllm-suffix"}
    for m in ("vllm-ar", "vllm-ngram", "vllm-retrospec", "vllm-suffix"):
        runs = [r for r in got["runs"] if r["method"] == m]
        assert all(1 <= len(r["token_ids"]) <= 6 for r in runs)
        assert rows[m]["tokens_per_s"] == pytest.approx(rows[m]["new_tokens"] / rows[m]["decode_s"])
        assert got["config"]["peers"][m] == {"peer": "vLLM", "version": "0.0-fake",
                                             "file": saved_models.target.name}
    log = fake_vllm.read_text().splitlines()
    assert f"load {saved_models.target.name} spec=None ngram_env=None" in log
    assert any(line.startswith(f"load {saved_models.target.name} spec={{'method': 'ngram'") and
               "'num_speculative_tokens': 4" in line and "'prompt_lookup_max': 3" in line for line in log)
    assert f"load {saved_models.target.name} spec={{'method': 'custom_class', 'model': '{vllm_peer.PROPOSER}', " \
           "'num_speculative_tokens': 4} ngram_env=3" in log
    assert f"load {saved_models.target.name} spec={{'method': 'suffix', 'num_speculative_tokens': 4}} ngram_env=None" \
        in log
    assert got["config"]["notes"] == []


def test_vllm_rows_are_skipped_with_a_note(cli, saved_models, tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "missing-python"))
    res, got = _bench(cli, saved_models, tmp_path, "ar,vllm-ar")
    assert res.rc == 0 and [s["method"] for s in got["summary"]] == ["ar"]
    assert got["config"]["notes"] == ["vllm-ar skipped: vLLM is not installed (make peers-vllm, or "
                                      f"${vllm_peer.PYTHON_ENV})"]
    assert "note: vllm-ar skipped" in res.err and "Traceback" not in res.err


def test_sampling_and_other_formats_skip_the_rows(saved_models, fake_vllm):
    peers, notes = vllm_peer.open_peers(["vllm-ar"], saved_models.target, "float32", False, 1, 64, 5, 3)
    assert peers == {} and notes == ["vllm-ar skipped: vLLM rows run greedy only"]
    peers, notes = vllm_peer.open_peers(["vllm-ngram"], saved_models.target, "int4", True, 1, 64, 5, 3)
    assert peers == {} and notes == ["vllm-ngram skipped: vLLM's CPU build has no format matching int4"]


def test_a_worker_that_answers_garbage_is_a_note(saved_models, tmp_path, monkeypatch):
    chatty = tmp_path / "python"
    chatty.write_text("#!/bin/sh\nread line\necho 'INFO engine starting'\n")
    chatty.chmod(chatty.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(chatty))
    peers, notes = vllm_peer.open_peers(["vllm-ar"], saved_models.target, "float32", True, 1, 64, 5, 3)
    assert peers == {} and notes == ["vllm-ar skipped: vllm-ar: the vLLM worker answered something else than "
                                     "JSON: 'INFO engine starting'"]


def _config(k: int, max_model_len: int = 64):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def test_our_proposer_drafts_what_pld_drafts_per_request(monkeypatch):
    monkeypatch.setenv(MAX_NGRAM_ENV, "2")
    proposer = PromptLookupProposer(_config(k=4, max_model_len=24))
    proposer.load_model(object())
    rows = np.zeros((4, 24), dtype=np.int32)  # vLLM's [max_num_reqs, max_model_len] token rows
    a = [5, 6, 7, 8, 9, 5, 6]
    b = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # 22 of 24 positions used
    rows[0, :7], rows[1, :7], rows[2, :22] = a, a, b
    counts = np.array([7, 7, 22, 0])
    drafts = proposer.propose([[6], [], [1], []], counts, rows)
    assert drafts[0] == lookup(np.array(a), 4, 2, 1) == [7, 8, 9, 5]
    assert drafts[1] == [] and drafts[3] == []  # requests not decoding this step (prefill, empty slot)
    assert drafts[2] == [2]  # one position left before max_model_len: one draft token
    with pytest.raises(ValueError):
        PromptLookupProposer(_config(k=0))


def test_a_peers_error_names_the_root_cause_its_log_gave(tmp_path):
    # an engine that dies answers "see the stack trace above"; the cause is in the worker's stderr, which is kept off
    # the terminal: the one error line carries the last line of it that names an error
    from retrospec.bench.peers import PeerWorker
    from retrospec.errors import RetrospecError

    worker = tmp_path / "worker.py"
    worker.write_text("import json, sys\n"
                      "for line in sys.stdin:\n"
                      "    if json.loads(line)['op'] == 'load':\n"
                      "        print(json.dumps({'ok': True, 'version': '0'}), flush=True)\n"
                      "        continue\n"
                      "    print('ERROR [core.py:1] RuntimeError: Worker failed: no offset', file=sys.stderr)\n"
                      "    print('shutting down', file=sys.stderr, flush=True)\n"
                      "    print(json.dumps({'error': 'EngineDeadError: see the stack trace above'}), flush=True)\n")
    peer = PeerWorker(sys.executable, worker, "corpus", {"model": "m"}, "vLLM")
    try:
        with pytest.raises(RetrospecError) as err:
            peer.ask({"op": "generate_batch"})
        assert str(err.value) == ("corpus: EngineDeadError: see the stack trace above (the vLLM log: ERROR [core.py:1] "
                                  "RuntimeError: Worker failed: no offset)")
    finally:
        peer.close()


def test_the_repeated_workloads_tau_from_vllms_counters():
    # vLLM's own methods report accepted draft tokens, not steps: 48 tokens with 43 accepted took the prefill and 4
    # more forwards (4 steps of 1 + 43 tokens in all after the first), so tau after the first token is 47 / 4
    from tools.peers.vllm_repeated import _tau, counter_stats

    outs = [[7] * 48, [7] * 48, [7] * 10]
    stats = counter_stats(outs, [0, 43, 9])
    assert [s["steps"] for s in stats] == [48, 5, 1]
    assert _tau(outs, stats, [1, 2, 3]) == {"tau_1": 1.0, "tau_2": 11.75, "tau_3": 0.0}
