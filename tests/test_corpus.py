"""A corpus of the target's own outputs (``corpus``): batched sampling, shards, resume after a kill, the
manifest, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from retrospec.batched import generate_batch
from retrospec.config import SamplingConfig
from retrospec.corpus import CorpusBuilder, CorpusConfig, PromptRow, parse_sources, read_corpus
from retrospec.corpus.prompts import MBPP_HELDOUT, interleave, load_rows
from retrospec.decode import autoregressive_generate
from retrospec.errors import RetrospecError
from retrospec.models import load_model

pytestmark = pytest.mark.usefixtures("single_thread")


def test_greedy_batch_rows_equal_one_at_a_time():
    model = tiny_llama(seed=5)
    prompts = [[5, 17, 3], [8, 61, 2, 5, 17, 3, 42], [9]]
    out = generate_batch(model, prompts, max_new_tokens=12, pad_id=0)
    for p, toks in zip(prompts, out.tokens):
        assert toks == autoregressive_generate(model, p, sampling=SamplingConfig(), max_new_tokens=12)


def test_sampled_batches_are_seeded_and_stay_in_the_nucleus():
    model = tiny_llama(seed=5)
    prompts = [[5, 17, 3], [8, 61, 2, 5]] * 3
    cfg = SamplingConfig(temperature=0.9, top_k=5)
    a = generate_batch(model, prompts, max_new_tokens=8, sampling=cfg, generator=torch.Generator().manual_seed(1))
    b = generate_batch(model, prompts, max_new_tokens=8, sampling=cfg, generator=torch.Generator().manual_seed(1))
    assert a.tokens == b.tokens and len({tuple(t) for t in a.tokens}) > 2  # seeded, and actually sampled
    with torch.inference_mode():  # every first token is among the prompt's top-5 next tokens
        for p, toks in zip(prompts, a.tokens):
            top5 = model(input_ids=torch.tensor([p])).logits[0, -1].topk(5).indices.tolist()
            assert toks[0] in top5


def _rows(n):
    return [PromptRow("stdlib", f"def f{i}(x):\n    return x + {i}\n\ndef g{i}(", False) for i in range(n)]


def _build(saved, out, rows, **kw):
    cfg = CorpusConfig(sources="test", temperatures=(0.0, 0.8), max_new_tokens=6, batch_size=3, shard_size=4, **kw)
    return CorpusBuilder(load_model(saved.target), rows, out, cfg)


def test_corpus_shards_manifest_and_resume_after_a_kill(saved_models, tmp_path):
    rows = _rows(5)
    full = _build(saved_models, tmp_path / "full", rows).build(progress=False)
    assert full["complete"] and full["items"] == 10 and len(full["shards"]) == 3
    assert full["by_temperature"]["0.0"]["records"] == 5 and full["by_source"]["stdlib"]["records"] == 10
    records = read_corpus(tmp_path / "full")
    assert len(records) == 10 and all(r["prompt_ids"] and r["output_ids"] for r in records)
    assert full["output_tokens"] == sum(len(r["output_ids"]) for r in records)
    # a build killed after shard 0: shard 1 written but not yet in the manifest, shard 2 never started
    part = tmp_path / "part"
    builder = _build(saved_models, part, rows)
    builder.build(progress=False)
    manifest = json.loads((part / "manifest.json").read_text())
    for k in ("00001", "00002"):
        del manifest["shards"][k]
    (part / "manifest.json").write_text(json.dumps(manifest))
    (part / "shard-00002.jsonl").unlink()
    (part / ".shard-00002.jsonl.tmp-999").write_text("half a line")  # a killed write leaves only a hidden temp
    resumed = _build(saved_models, part, rows).build(progress=False)
    assert read_corpus(part) == records and resumed["complete"] and len(resumed["shards"]) == 3


def test_a_corpus_resumes_only_in_the_precision_it_was_built_in(saved_models, tmp_path):
    rows = _rows(2)
    _build(saved_models, tmp_path / "c", rows).build(progress=False)
    cfg = CorpusConfig(sources="test", temperatures=(0.0, 0.8), max_new_tokens=6, batch_size=3, shard_size=4)
    half = CorpusBuilder(load_model(saved_models.target, dtype=torch.bfloat16), rows, tmp_path / "c", cfg)
    with pytest.raises(RetrospecError, match="in float32; resume it with --dtype float32"):
        half.build(progress=False)


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after the raise runs (BaseException, so no ``except Exception`` catches it)."""


@pytest.mark.parametrize("at", ["shard 0 written, manifest not yet", "shard 1 half written", "manifest half written"])
def test_a_build_interrupted_anywhere_resumes_to_the_same_corpus(saved_models, tmp_path, monkeypatch, at):
    import retrospec.corpus.build as build_mod

    rows = _rows(5)
    full = _build(saved_models, tmp_path / "full", rows).build(progress=False)
    writes, real = [], build_mod.write_text_atomic

    def dying(path, text):  # the atomic writes, killed at the chosen one
        writes.append(path.name)
        shards = [w for w in writes if w.startswith("shard-")]
        if at == "shard 1 half written" and path.name == "shard-00001.jsonl":
            path.with_name(f".{path.name}.tmp-999").write_text(text[: len(text) // 2])
            raise _Killed
        if at == "manifest half written" and path.name == "manifest.json" and len(shards) == 2:
            path.with_name(f".{path.name}.tmp-999").write_text(text[:10])
            raise _Killed
        real(path, text)
        if at == "shard 0 written, manifest not yet" and shards == ["shard-00000.jsonl"]:
            raise _Killed

    monkeypatch.setattr(build_mod, "write_text_atomic", dying)
    with pytest.raises(_Killed):
        _build(saved_models, tmp_path / "part", rows).build(progress=False)
    monkeypatch.setattr(build_mod, "write_text_atomic", real)
    resumed = _build(saved_models, tmp_path / "part", rows).build(progress=False)
    assert read_corpus(tmp_path / "part") == read_corpus(tmp_path / "full")
    visible = sorted(p.name for p in (tmp_path / "part").iterdir() if not p.name.startswith("."))
    assert visible == ["manifest.json", "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    drop = ("seconds", "shards")
    same = [json.loads(json.dumps({k: v for k, v in m.items() if k not in drop})) for m in (resumed, full)]
    assert same[0] == same[1]  # the totals count every record once
    assert [s["records"] for s in resumed["shards"].values()] == [s["records"] for s in full["shards"].values()]


def test_another_config_is_refused_not_mixed(saved_models, tmp_path):
    _build(saved_models, tmp_path / "c", _rows(2)).build(progress=False)
    with pytest.raises(RetrospecError, match="another config"):
        _build(saved_models, tmp_path / "c", _rows(2), seed=7).build(progress=False)
    (tmp_path / "c" / "manifest.json").write_text("{oops")
    with pytest.raises(RetrospecError, match="corrupt"):
        _build(saved_models, tmp_path / "c", _rows(2)).build(progress=False)


@pytest.mark.parametrize("spec,fragment", [("wiki=x", "unknown prompt source"), ("mbpp", "needs a file"),
                                           ("self-instruct", "needs a count"), ("stdlib=0", "count"), ("", "no prompt"),
                                           ("tasks", "tasks needs a count"), ("tasks=x", "count >= 1")])
def test_bad_sources(spec, fragment):
    with pytest.raises(RetrospecError, match=fragment):
        parse_sources(spec)


def test_cli_generate_and_info(cli, saved_models, tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    n = MBPP_HELDOUT + 3  # the first MBPP_HELDOUT rows are the benches' and never generated from
    mbpp.write_text("".join(json.dumps({"prompt": f"def add{i}(a, b):\n"}) + "\n" for i in range(n)))
    run = cli("corpus", "generate", "--target", saved_models.target, "--sources", f"mbpp={mbpp}",
              "--temperatures", "0", "--max-new-tokens", "4", "--out", tmp_path / "corpus")
    assert run.rc == 0, run.err
    assert "3 replies" in run.out
    info = cli("corpus", "info", tmp_path / "corpus")
    assert info.rc == 0 and json.loads(info.out)["by_source"]["mbpp"]["records"] == 3
    export = cli("corpus", "export", tmp_path / "corpus", "--target", saved_models.target, "--out", tmp_path / "c.jsonl")
    assert export.rc == 0, export.err
    exported = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(exported) == 3 and all(r["prompt"] == f"def add{MBPP_HELDOUT + i}(a, b):\n" and r["completion"]
                                      for i, r in enumerate(exported))
    again = cli("corpus", "export", tmp_path / "corpus", "--target", saved_models.target, "--out", tmp_path / "c.jsonl")
    assert again.rc == 2 and "already exists" in again.err
    from retrospec.train.longspec_distill import is_heldout

    # the held-out prompts, once each, for 'bench --prompts' (no model loads for them): at 0.5, two of the three
    prompts = [f"def add{MBPP_HELDOUT + i}(a, b):\n" for i in range(3)]
    want = [p for p in prompts if is_heldout({"prompt": p}, 0.5)]
    held = cli("corpus", "export", tmp_path / "corpus", "--heldout-prompts", 0.5, "--source", "mbpp",
               "--out", tmp_path / "h.jsonl")
    assert held.rc == 0 and len(want) == 2, held.err
    rows = [json.loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": p, "source": "mbpp", "chat": False} for p in want]
    # the held-out records, prompt and completion, for 'datastore eval'
    recs = cli("corpus", "export", tmp_path / "corpus", "--target", saved_models.target, "--heldout-records", 0.5,
               "--out", tmp_path / "r.jsonl")
    assert recs.rc == 0, recs.err
    assert [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()] == [
        r for r in exported if r["prompt"] in want]
    greedy = cli("corpus", "export", tmp_path / "corpus", "--target", saved_models.target, "--temperature", 0,
                 "--out", tmp_path / "g.jsonl")  # every record here is greedy
    assert greedy.rc == 0 and (tmp_path / "g.jsonl").read_text() == (tmp_path / "c.jsonl").read_text(), greedy.err
    for bad, fragment in ((["--source", "wiki"], "sources are mbpp"), (["--heldout-prompts", "1"], "share in"),
                          (["--temperature", "0.7"], "sampled at 0"),
                          (["--heldout-prompts", "0.5", "--skip-heldout", "0.1"], "no --skip-heldout"),
                          (["--heldout-records", "0.5", "--skip-heldout", "0.1"], "no --skip-heldout"),
                          (["--heldout-records", "0"], "share in"),
                          (["--heldout-prompts", "0.5", "--heldout-records", "0.5"], "or --heldout-records")):
        run = cli("corpus", "export", tmp_path / "corpus", *bad, "--out", tmp_path / "x.jsonl")
        assert run.rc == 2 and fragment in run.err and run.err.count("\n") == 1
    bad = cli("corpus", "generate", "--target", saved_models.target, "--sources", "mbpp=/nonexistent.jsonl",
              "--out", tmp_path / "x")
    assert bad.rc == 2 and "does not exist" in bad.err and bad.err.count("\n") == 1


def test_self_instruct_starts_from_the_user_turn_of_the_template():
    from conftest import chatml_tokenizer
    from retrospec.corpus.build import self_instruct_prefix

    tok = chatml_tokenizer()
    prefix = tok.decode(self_instruct_prefix(tok))
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith(prefix) and rendered[len(prefix):].startswith("hello")


def test_sources_interleave_and_mbpp_bench_rows_stay_out(tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text("".join(json.dumps({"prompt": f"def f{i}():\n"}) + "\n" for i in range(MBPP_HELDOUT + 4)))
    rows = load_rows(parse_sources(f"mbpp={mbpp},self-instruct=8"))
    assert [r.text for r in rows if r.source == "mbpp"] == [f"def f{i}():\n" for i in range(MBPP_HELDOUT,
                                                                                              MBPP_HELDOUT + 4)]
    order = [r.source for r in rows]
    assert order[:3] == ["self-instruct", "mbpp", "self-instruct"] and len(order) == 12
    assert interleave([[1, 2], [3]]) == [1, 3, 2]


def test_tasks_rows_take_the_openers_in_turn():
    from retrospec.corpus.prompts import TASK_OPENERS

    rows = load_rows(parse_sources(f"tasks={len(TASK_OPENERS) + 2}"))
    assert [r.text for r in rows] == list(TASK_OPENERS) + list(TASK_OPENERS[:2])
    assert all(r.source == "tasks" and r.chat for r in rows)


def test_tasks_instructions_start_with_their_opener_and_are_answered_in_the_chat_template(chat_models, tmp_path):
    from retrospec.corpus.prompts import TASK_OPENERS
    from retrospec.train.longspec_distill import kind_of

    rows = load_rows(parse_sources("tasks=3,self-instruct=1"))
    cfg = CorpusConfig(sources="tasks=3,self-instruct=1", temperatures=(0.0,), max_new_tokens=4, batch_size=2,
                       shard_size=4)
    target = load_model(chat_models.target)
    CorpusBuilder(target, rows, tmp_path / "c", cfg).build(progress=False)
    recs = read_corpus(tmp_path / "c")
    tasks = [r for r in recs if r["source"] == "tasks"]
    assert [r["prompt"][:len(o)] for r, o in zip(tasks, TASK_OPENERS)] == list(TASK_OPENERS[:3])
    assert all(len(r["prompt"]) > len(o) for r, o in zip(tasks, TASK_OPENERS))  # the target wrote the rest
    tok = target.tokenizer
    for r in recs:  # each instruction is then asked as one user message
        rendered = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
        assert r["prompt_ids"] == list(rendered["input_ids"]) and kind_of(r) == "chat"


# --- the batch's sampler and the packed corpus ---


def test_draw_rows_follows_each_rows_distribution_and_never_draws_a_zero():
    from scipy import stats as sps

    from retrospec.sampling import draw_rows

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.0, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(7)
    draws = torch.stack([draw_rows(probs.repeat(400, 1), gen).view(400, 3) for _ in range(10)]).view(-1, 3)  # [4000, 3]
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        expected = probs[row].double() * len(draws)
        assert (counts[expected == 0] == 0).all()
        live = expected > 0
        if live.sum() > 1:
            stat = (((counts - expected)[live]) ** 2 / expected[live]).sum().item()
            assert sps.chi2.sf(stat, int(live.sum()) - 1) > 1e-3
    again = draw_rows(probs.repeat(400, 1), torch.Generator().manual_seed(7))
    assert torch.equal(again, draw_rows(probs.repeat(400, 1), torch.Generator().manual_seed(7)))
    # unnormalised rows (a nucleus cut) are drawn from as if normalised
    assert set(draw_rows(torch.tensor([[0.0, 2.0, 0.0, 2.0]] * 64), gen).tolist()) == {1, 3}


def test_a_packed_corpus_unpacks_byte_for_byte_and_refuses_damage(saved_models, tmp_path):
    from retrospec.corpus.pack import pack, unpack

    _build(saved_models, tmp_path / "c", _rows(5)).build(progress=False)
    info = pack(tmp_path / "c", tmp_path / "p")
    assert info["records"] == 10 and sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "ids.u16.xz", "manifest.json", "records.jsonl.xz"]
    unpack(tmp_path / "p", tmp_path / "u")
    for f in sorted((tmp_path / "c").iterdir()):
        assert (tmp_path / "u" / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(RetrospecError, match="not empty"):
        unpack(tmp_path / "p", tmp_path / "u")
    with pytest.raises(RetrospecError, match="already holds"):
        pack(tmp_path / "c", tmp_path / "p")
    import lzma

    import numpy as np

    ids = np.frombuffer(lzma.decompress((tmp_path / "p" / "ids.u16.xz").read_bytes()), dtype="<u2").copy()
    ids[3] += 1  # one id changed: the shard it lands in no longer matches its SHA-256
    (tmp_path / "p" / "ids.u16.xz").write_bytes(lzma.compress(ids.tobytes()))
    with pytest.raises(RetrospecError, match="SHA-256"):
        unpack(tmp_path / "p", tmp_path / "v")
    assert not (tmp_path / "v").exists() or not any((tmp_path / "v").iterdir())  # nothing half-written


def test_cli_pack_and_unpack(cli, saved_models, tmp_path):
    _build(saved_models, tmp_path / "c", _rows(3)).build(progress=False)
    res = cli("corpus", "pack", tmp_path / "c", "--out", tmp_path / "p", "--level", "1")
    assert res.rc == 0 and "6 records" in res.out
    res = cli("corpus", "unpack", tmp_path / "p", "--out", tmp_path / "u")
    assert res.rc == 0 and read_corpus(tmp_path / "u") == read_corpus(tmp_path / "c")
    res = cli("corpus", "unpack", tmp_path / "c", "--out", tmp_path / "v")  # a corpus, not a pack
    assert res.rc == 2 and "not a packed corpus" in res.err and "Traceback" not in res.err
    res = cli("corpus", "export", tmp_path / "p", "--out", tmp_path / "x.jsonl")  # a pack, not a corpus
    assert res.rc == 2 and "unpack it first" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "x.jsonl").exists()


def test_the_corpus_kept_in_the_repository_unpacks_for_the_bundled_target(tmp_path):
    """``corpus/smollm2-135m`` (outside the package, not in the wheel): within the 24 MiB the repository allows,
    written by the bundled target (the fingerprint its bundled block records), free of machine paths, and unpacked
    byte for byte (every shard's SHA-256) into records the trainers read."""
    import re
    from pathlib import Path

    from retrospec.corpus.pack import unpack
    from retrospec.models import ZOO_DIR

    root = Path(__file__).resolve().parent.parent / "corpus"
    packed = root / "smollm2-135m"
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) <= 24 << 20
    text = (packed / "manifest.json").read_text()
    assert not re.search(r"(/root/|/home/|/work/|/tmp/|\.\./)", text)
    block = json.loads((ZOO_DIR / "smollm2-135m-longspec" / "longspec.json").read_text())
    manifest = unpack(packed, tmp_path / "c")
    assert manifest["target"]["fingerprint"] == block["target"]["fingerprint"]
    records = list(read_corpus(tmp_path / "c"))
    assert len(records) == json.loads(text)["packed"]["records"] > 0
    assert {r["source"] for r in records} <= {"stdlib", "self-instruct", "tasks"}  # no external data committed
    assert sum(len(r["output_ids"]) for r in records) == manifest["output_tokens"]

    # its held-out prompts, one kind a file for 'bench --prompts' (chat ones under --chat): mixed kinds are refused
    from retrospec.cli import main

    assert main(["corpus", "export", str(tmp_path / "c"), "--heldout-prompts", "0.04", "--out",
                 str(tmp_path / "mixed.jsonl")]) == 2 and not (tmp_path / "mixed.jsonl").exists()
    for sources in ("stdlib", "self-instruct,tasks"):
        out = tmp_path / f"{sources}.jsonl"
        assert main(["corpus", "export", str(tmp_path / "c"), "--heldout-prompts", "0.04", "--source", sources,
                     "--out", str(out)]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert rows and len({r["prompt"] for r in rows}) == len(rows)
        assert {r["source"] for r in rows} <= set(sources.split(",")) and len({r["chat"] for r in rows}) == 1
