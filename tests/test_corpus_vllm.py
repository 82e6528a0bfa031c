"""``retrospec corpus generate --engine vllm`` on a fake ``vllm`` package (the real one is a 130 MB wheel with its own
pins: ``make peers-vllm``).

- the real worker script (``bench/vllm_worker.py``, op ``generate_batch``) runs in a subprocess against the fake,
  whose ``LLM.generate`` answers deterministic ids derived from each prompt's ids (and the request's seed when
  sampled): the corpus has the retrospec engine's files, record keys and manifest keys, plus the engine in the
  manifest; every record holds what the fake answered to its own prompt ids, with its own seed (``record_seed``);
  one ``LLM.generate`` call per shard and phase (instructions, replies), every temperature in it;
- ``--tensor-parallel`` reaches ``vllm.LLM``; a killed build resumes without redoing finished shards (to the same
  corpus); a complete corpus does not start vLLM again; another engine is refused in one line;
- no vLLM interpreter, a format vLLM does not load, or a worker failing mid-build: one line, exit 2, no shard half
  written.
"""

from __future__ import annotations

import json
import sys

import pytest

from retrospec.bench import vllm_peer
from retrospec.corpus import read_corpus
from retrospec.corpus.build import record_seed
from retrospec.corpus.prompts import MBPP_HELDOUT, TASK_OPENERS
from retrospec.models import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

# what the fake engine writes: a function of the prompt's ids (and the seed when sampled); some replies stop early
CONTINUATION = '''
def continuation(ids, temperature, seed, max_tokens, stop):
    t = (sum(ids) + ((seed or 0) % 97 if temperature > 0 else 0)) % 200 + 3
    out = []
    while len(out) < max_tokens:
        out.append(t)
        if t in stop:
            break
        t = (t * 7 + len(ids)) % 200 + 3
    if sum(ids) % 2 == 0 and len(out) > 3:  # an early end: the first stop id
        out = out[:3] + [min(stop)]
    return out
'''

FAKE = CONTINUATION + '''
import json, os
__version__ = "0.0-fake"
LOG = os.environ["FAKE_VLLM_LOG"]
CALLS = [0]

def _log(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\\n")

class SamplingParams:
    def __init__(self, *, temperature, top_p, seed, max_tokens, stop_token_ids, detokenize):
        assert not detokenize and (temperature > 0 or (seed is None and top_p == 1.0))
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.max_tokens, self.stop = max_tokens, sorted(stop_token_ids)

class _Seq:
    def __init__(self, ids):
        self.token_ids = ids

class _Out:
    def __init__(self, ids):
        self.outputs = [_Seq(ids)]

class LLM:
    def __init__(self, model, dtype, max_model_len, enable_prefix_caching, gpu_memory_utilization, seed,
                 tensor_parallel_size=1, speculative_config=None):
        assert os.path.isfile(os.path.join(model, "config.json")) and speculative_config is None
        print("vLLM says hello on stdout")  # the worker keeps its answers' channel clean
        _log({"load": os.path.basename(model), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
              "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization})

    def generate(self, prompts, params, use_tqdm):
        assert len(prompts) == len(params) and not use_tqdm
        CALLS[0] += 1
        if CALLS[0] == int(os.environ.get("FAKE_VLLM_FAIL_AT", "0")):
            raise RuntimeError("out of KV cache blocks\\nsecond line")
        _log({"generate": len(prompts), "temperatures": sorted({p.temperature for p in params}),
              "stop": params[0].stop, "seeded": sorted({p.seed is not None for p in params if p.temperature > 0})})
        return [_Out(continuation(p["prompt_token_ids"], s.temperature, s.seed, s.max_tokens, set(s.stop)))
                for p, s in zip(prompts, params)]
'''

PLATFORMS = '''
import os

class _Platform:
    def is_cpu(self):
        return os.environ.get("FAKE_VLLM_CPU") == "1"

current_platform = _Platform()
'''

ns: dict = {}
exec(CONTINUATION, ns)
continuation = ns["continuation"]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    (pkg / "platforms.py").write_text(PLATFORMS)
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, sys.executable)
    return log


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _generate(cli, target, tmp_path, out, *extra):
    mbpp = tmp_path / "mbpp.jsonl"  # 4 rows past the benches' held-out ones
    mbpp.write_text("".join(json.dumps({"prompt": f"def add{i}(a, b):\n"}) + "\n" for i in range(MBPP_HELDOUT + 4)))
    return cli("corpus", "generate", "--target", target, "--sources", f"mbpp={mbpp},tasks=2", "--temperatures",
               "0,0.7", "--max-new-tokens", "5", "--shard-size", "4", "--out", tmp_path / out, *extra)


def _visible(d):
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def test_the_vllm_engine_writes_the_retrospec_engines_corpus_format(cli, chat_models, tmp_path, fake_vllm):
    ours = _generate(cli, chat_models.target, tmp_path, "ours")
    assert ours.rc == 0, ours.err
    theirs = _generate(cli, chat_models.target, tmp_path, "vllm", "--engine", "vllm")
    assert theirs.rc == 0, theirs.err
    assert "12 replies" in theirs.out and "vllm engine" in theirs.out
    a, b = tmp_path / "ours", tmp_path / "vllm"
    assert _visible(a) == _visible(b) == ["manifest.json", "shard-00000.jsonl", "shard-00001.jsonl",
                                          "shard-00002.jsonl"]
    for f in _visible(a)[1:]:
        ra, rb = ([json.loads(line) for line in (d / f).read_text().splitlines()] for d in (a, b))
        assert [list(r) for r in ra] == [list(r) for r in rb]  # the same keys, in the same order
        assert [(r["source"], r["chat"], r["temperature"]) for r in ra] == [
            (r["source"], r["chat"], r["temperature"]) for r in rb]
        assert [r["prompt_ids"] for r in ra if r["source"] == "mbpp"] == [
            r["prompt_ids"] for r in rb if r["source"] == "mbpp"]
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert set(ma) == set(mb) and ma["config"] | {"batch_size": 4} == mb["config"]  # vLLM: a shard per call
    assert ma["engine"]["name"] == "retrospec" and "per shard" in ma["engine"]["seeding"]
    assert mb["engine"] == {"name": "vllm", "version": "0.0-fake", "tensor_parallel": 1,
                            "seeding": mb["engine"]["seeding"]} and "per record" in mb["engine"]["seeding"]
    assert mb["target"] == ma["target"] and mb["items"] == ma["items"] == 12

    # max_model_len: --max-prompt-tokens + the longest reply, capped at the model's 512 positions; every record is
    # what the fake answered to its own prompt ids, with its own seed (item j = record j here)
    log = _log(fake_vllm)
    loads, calls = [e for e in log if "load" in e], [e for e in log if "generate" in e]
    assert loads == [{"load": chat_models.target.name, "dtype": "float32", "max_model_len": 512, "seed": 0,
                      "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9}]
    stop = set(calls[0]["stop"])
    assert chat_models.im_end_id in stop and chat_models.eos_id in stop
    records = read_corpus(b, target=load_model(chat_models.target))  # the target's corpus: identity and vocabulary
    for j, r in enumerate(records):
        seed = record_seed(0, j, 1)
        assert r["output_ids"] == continuation(r["prompt_ids"], r["temperature"], seed, 5, stop), j
        assert r["finished"] == (r["output_ids"][-1] in stop)
    assert {r["finished"] for r in records} == {True, False}
    assert mb["output_tokens"] == sum(len(r["output_ids"]) for r in records)
    tasks = [r for r in records if r["source"] == "tasks"]
    assert len(tasks) == 4 and all(r["prompt"].startswith(TASK_OPENERS[0]) or r["prompt"].startswith(TASK_OPENERS[1])
                                   for r in tasks)
    # per shard: the instructions in one call (shards holding tasks rows), the replies of every temperature in one
    assert [(c["generate"], c["temperatures"]) for c in calls] == [
        (2, [1.0]), (4, [0.0, 0.7]), (4, [0.0, 0.7]), (2, [1.0]), (4, [0.0, 0.7])]

    pack = cli("corpus", "pack", b, "--out", tmp_path / "packed", "--level", "0")  # the packer's exact field order
    assert pack.rc == 0 and "12 records" in pack.out
    # a manifest written before engines were recorded is the default engine's: vLLM may not resume it
    (a / "manifest.json").write_text(json.dumps({k: v for k, v in ma.items() if k != "engine"}))
    mixed = _generate(cli, chat_models.target, tmp_path, "ours", "--engine", "vllm")
    assert mixed.rc == 2 and mixed.err.count("\n") == 1 and "resume it with --engine retrospec" in mixed.err
    assert len(_log(fake_vllm)) == len(log)  # refused before vLLM started


def test_a_killed_vllm_build_resumes_without_redoing_shards(cli, chat_models, tmp_path, fake_vllm, monkeypatch):
    full = _generate(cli, chat_models.target, tmp_path, "full", "--engine", "vllm", "--tensor-parallel", "2")
    assert full.rc == 0, full.err
    assert [e["tensor_parallel_size"] for e in _log(fake_vllm) if "load" in e] == [2]
    fake_vllm.unlink()
    # the worker fails at its third call (shard 1's replies): shard 0 stays whole, shard 1 is never half written
    monkeypatch.setenv("FAKE_VLLM_FAIL_AT", "3")
    part = _generate(cli, chat_models.target, tmp_path, "part", "--engine", "vllm", "--tensor-parallel", "2")
    assert part.rc == 2 and part.err.splitlines()[-1] == "retrospec: error: corpus: RuntimeError: out of KV cache " \
        "blocks" and "Traceback" not in part.err, part.err  # one line, after the progress bar's
    assert _visible(tmp_path / "part") == ["manifest.json", "shard-00000.jsonl"]
    assert list(json.loads((tmp_path / "part" / "manifest.json").read_text())["shards"]) == ["00000"]
    monkeypatch.delenv("FAKE_VLLM_FAIL_AT")
    fake_vllm.unlink()
    again = _generate(cli, chat_models.target, tmp_path, "part", "--engine", "vllm", "--tensor-parallel", "2")
    assert again.rc == 0, again.err
    assert [e["generate"] for e in _log(fake_vllm) if "generate" in e] == [4, 2, 4]  # shards 1 and 2 only
    assert read_corpus(tmp_path / "part") == read_corpus(tmp_path / "full")
    fake_vllm.unlink()
    done = _generate(cli, chat_models.target, tmp_path, "part", "--engine", "vllm", "--tensor-parallel", "2")
    assert done.rc == 0 and "complete" in done.out and not fake_vllm.exists()  # vLLM not even started
    other = _generate(cli, chat_models.target, tmp_path, "part")
    assert other.rc == 2 and other.err.count("\n") == 1 and "resume it with --engine vllm" in other.err


def test_on_vllms_cpu_build_sampled_records_are_seeded_by_the_engine(cli, chat_models, tmp_path, fake_vllm,
                                                                      monkeypatch):
    # vLLM's CPU build fails on a request with its own seed: the worker sends none and the manifest says so
    monkeypatch.setenv("FAKE_VLLM_CPU", "1")
    res = _generate(cli, chat_models.target, tmp_path, "cpu", "--engine", "vllm")
    assert res.rc == 0, res.err
    calls = [e for e in _log(fake_vllm) if "generate" in e]
    assert calls and all(e["seeded"] == [False] for e in calls)
    engine = json.loads((tmp_path / "cpu" / "manifest.json").read_text())["engine"]
    assert engine["seeding"].startswith("engine-wide") and "CPU build" in engine["seeding"]
    assert len(read_corpus(tmp_path / "cpu")) == 12
    monkeypatch.delenv("FAKE_VLLM_CPU")
    fake_vllm.unlink()
    res = _generate(cli, chat_models.target, tmp_path, "gpu", "--engine", "vllm")
    assert res.rc == 0, res.err
    calls = [e for e in _log(fake_vllm) if "generate" in e]
    assert calls and all(e["seeded"] == [True] for e in calls)
    assert "per record" in json.loads((tmp_path / "gpu" / "manifest.json").read_text())["engine"]["seeding"]
    # begun seeding each record, resumed on the CPU build: the manifest says from which shard the seeding changed
    monkeypatch.setenv("FAKE_VLLM_FAIL_AT", "3")
    assert _generate(cli, chat_models.target, tmp_path, "both", "--engine", "vllm").rc == 2
    monkeypatch.delenv("FAKE_VLLM_FAIL_AT")
    monkeypatch.setenv("FAKE_VLLM_CPU", "1")
    assert _generate(cli, chat_models.target, tmp_path, "both", "--engine", "vllm").rc == 0
    seeding = json.loads((tmp_path / "both" / "manifest.json").read_text())["engine"]["seeding"]
    assert seeding.startswith("mixed: shards before 00001: per record") and "from it on: engine-wide" in seeding


def test_no_vllm_is_one_line_and_writes_nothing(cli, chat_models, tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    res = _generate(cli, chat_models.target, tmp_path, "c", "--engine", "vllm")
    assert res.rc == 2 and res.err.count("\n") == 1 and "Traceback" not in res.err
    assert "--engine vllm: vLLM is not installed" in res.err and vllm_peer.PYTHON_ENV in res.err
    assert not (tmp_path / "c").exists()
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, sys.executable)
    for extra, says in ((["--engine", "vllm", "--dtype", "int8"], "runs the target in float32, bfloat16, float16"),
                        (["--tensor-parallel", "2"], "use it with --engine vllm")):
        res = _generate(cli, chat_models.target, tmp_path, "c", *extra)
        assert res.rc == 2 and res.err.count("\n") == 1 and says in res.err, res.err
        assert not (tmp_path / "c").exists()
