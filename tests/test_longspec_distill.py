"""Distilling the LongSpec block on a corpus of the target's own outputs (``train.longspec_distill``): the pieces
(draft vocabulary, held-out split, batches), a whole run on a tiny corpus whose block loads and stays lossless."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from retrospec.config import SamplingConfig
from retrospec.corpus import CorpusBuilder, CorpusConfig, PromptRow
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.errors import RetrospecError
from retrospec.identity import model_identity
from retrospec.models import load_model
from retrospec.models.longspec import load_longspec
from retrospec.train.common import adamw, pick_precision, warmup_stable_decay
from retrospec.train.longspec_distill import (FINE_TUNE_LR, FRESH_LR, DistillConfig, check_config, corpus_records,
                                              coverage, distill_longspec, follow_corpora, frequency_vocab,
                                              heldout_sample, is_heldout, make_batches, peak_lr, sequence_of)
from retrospec.train.resume import RESUME_FILE, load_stable_state

pytestmark = pytest.mark.usefixtures("single_thread")


def _record(prompt, out, source="stdlib"):
    return {"source": source, "prompt": f"p{prompt}", "prompt_ids": list(prompt), "output_ids": list(out)}


def test_vocabulary_split_and_batches():
    recs = [_record([1, 2], [5, 5, 5, 7]), _record([3], [7, 8, 9, 5])]
    assert frequency_vocab(recs, 3, {0}, 100) == [0, 5, 7]  # EOS-like ids first, then by frequency
    assert frequency_vocab(recs, 8, {0}, 100) == [0, 5, 7, 8, 9, 1, 2, 3]  # then prompt tokens, then by id
    assert coverage([5, 7], recs) == pytest.approx(6 / 8)
    assert sequence_of(_record([1, 2, 3], [4, 5]), 4) == ([2, 3, 4, 5], 2)
    assert sequence_of(_record([1, 2, 3], [4, 5, 6, 7, 8]), 4) == ([5, 6, 7, 8], 0)
    many = [_record([i], list(range(i % 7 + 1))) for i in range(40)]
    batches = make_batches(many, 16, 24, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(40))
    assert all(len(b) * max(len(many[i]["prompt_ids"]) + len(many[i]["output_ids"]) for i in b) <= 24
               for b in batches)
    rec = _record([1], [2])
    assert is_heldout(rec, 0.5) == is_heldout(dict(rec, temperature=0.7), 0.5)  # by prompt, not by item
    sample = heldout_sample(many, 0.5, 5)  # the evaluated records: the same after the corpus grows (appended)
    assert len(sample) == 5 and all(is_heldout(r, 0.5) for r in sample)
    grown = many + [_record([100 + i], [1, 2]) for i in range(40)]
    assert heldout_sample(grown, 0.5, 5) == sample


def tiny_corpus(target, out) -> None:
    """24 records (12 code prompts x 2 temperatures, 12 new tokens) of ``target``'s own outputs at ``out``."""
    rows = [PromptRow("stdlib", f"def f{i}(x):\n    return x * {i}\n\ndef g{i}(y", False) for i in range(12)]
    cfg = CorpusConfig(sources="test", temperatures=(0.0, 0.8), max_new_tokens=12, batch_size=6, shard_size=12)
    CorpusBuilder(target, rows, out, cfg).build(progress=False)


def test_following_takes_new_records_from_every_corpus():
    """--follow with --corpus A,B: new shards of A (not only of the last corpus) are taken, each record once, and a
    corpus that appears later is read from its start."""
    rec = lambda tag, i: {"prompt": f"{tag}{i}", "output_ids": [i]}  # noqa: E731
    a, b = [rec("a", i) for i in range(5)], [rec("b", i) for i in range(3)]
    seen = {"A": 3, "B": 2}
    new, seen = follow_corpora(seen, [("A", a), ("B", b)])
    assert [r["prompt"] for r in new] == ["a3", "a4", "b2"] and seen == {"A": 5, "B": 3}
    new, seen = follow_corpora(seen, [("A", a), ("B", b)])
    assert new == [] and seen == {"A": 5, "B": 3}
    new, seen = follow_corpora(seen, [("A", a), ("B", b), ("C", [rec("c", 0)])])
    assert [r["prompt"] for r in new] == ["c0"] and seen["C"] == 1


def test_distill_on_a_tiny_corpus_saves_a_lossless_block(saved_models, tmp_path):
    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    out = tmp_path / "block"
    dc = DistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"), out=str(out),
                       draft_vocab=24, max_len=48, batch_tokens=96, heldout=0.3, eval_records=4, curve=(40,),
                       max_positions=256, storage=None)
    manifest = distill_longspec(dc, log=lambda *_: None, target=target)
    assert manifest["precision"] in ("float32", "bfloat16")  # auto: measured here
    assert manifest["steps"] >= 1 and manifest["curve"][0]["tokens"] == 0 and len(manifest["curve"]) >= 2
    assert all(0 <= c["all"] <= 1 for c in manifest["curve"])
    assert json.loads((out / "manifest.json").read_text())["draft_vocab"] == 24
    block = load_longspec(out, target)
    assert block.draft_vocab_size == 24
    prompt = target.tokenizer.encode("def h(x):\n    return")
    greedy = SamplingConfig()
    want = autoregressive_generate(target.model, prompt, sampling=greedy, max_new_tokens=16)
    got = [t for c in speculative_generate(target.model, REGISTRY["longspec"](block=block, gamma=3), prompt,
                                           sampling=greedy, max_new_tokens=16) for t in c]
    assert got == want
    with pytest.raises(RetrospecError, match="already exists"):
        check_config(dc)
    # following a corpus that stops growing: one pass, then waits for new shards until the seconds run out
    # (its forwards under bfloat16 autocast: the block's parameters and the saved weights stay float32)
    follow = DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "followed"), "follow": True, "seconds": 4.0,
                              "curve": (), "precision": "bfloat16"})
    m2 = distill_longspec(follow, log=lambda *_: None, target=target)
    assert m2["steps"] >= 1 and m2["corpus"]["records"] == 24 and m2["precision"] == "bfloat16"
    followed = load_longspec(tmp_path / "followed", target)
    assert all(p.dtype == torch.float32 for p in followed.parameters())
    with pytest.raises(RetrospecError, match="--seconds"):
        check_config(DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "x"), "follow": True}))
    # --keep-vocab: a further pass from the distilled block keeps its draft vocabulary whatever --draft-vocab says
    kept = DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "kept"), "init": str(out), "draft_vocab": 8,
                            "keep_vocab": True, "max_tokens": 60, "curve": ()})
    m3 = distill_longspec(kept, log=lambda *_: None, target=target)
    assert m3["draft_vocab"] == 24
    assert load_longspec(tmp_path / "kept", target).vocab.tolist() == block.vocab.tolist()
    with pytest.raises(RetrospecError, match="--keep-vocab.*--init"):
        check_config(DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "x"), "keep_vocab": True}))
    with pytest.raises(RetrospecError, match="--precision"):
        check_config(DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "x"), "precision": "fp8"}))
    # several corpora, comma-separated: read in the order given; each must exist
    shutil.copytree(tmp_path / "corpus", tmp_path / "corpus2")
    one = corpus_records(str(tmp_path / "corpus"))
    both = corpus_records(f"{tmp_path / 'corpus'},{tmp_path / 'corpus2'}")
    assert both == one + one and heldout_sample(both, 0.3, 2) == heldout_sample(one, 0.3, 2)
    # --follow on a corpus `corpus generate` has only just started (no manifest until its first shard): no records
    # from it yet, where a plain read refuses it
    (tmp_path / "starting").mkdir()
    starting = f"{tmp_path / 'corpus'},{tmp_path / 'starting'}"
    assert corpus_records(starting, growing=True) == one
    with pytest.raises(RetrospecError, match="not a corpus directory"):
        corpus_records(starting)
    with pytest.raises(RetrospecError, match="corpus directory not found.*nowhere"):
        check_config(DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "x"),
                                      "corpus": f"{tmp_path / 'corpus'},{tmp_path / 'nowhere'}"}))


def test_pick_precision_measures_only_when_asked():
    calls = []
    for asked in ("float32", "bfloat16"):
        assert pick_precision(asked, torch.device("cpu"), lambda: calls.append(1), log=calls.append) == asked
    assert calls == []  # an explicit precision is not measured
    seen = []
    chosen = pick_precision("auto", torch.device("cpu"),
                            lambda: seen.append(torch.is_autocast_enabled("cpu")), log=calls.append)
    assert chosen in ("float32", "bfloat16") and seen == [False, True, False, True]  # twice each, alternating
    assert len(calls) == 1 and chosen in calls[0]  # one log line saying what was chosen
    with pytest.raises(RetrospecError, match="--precision"):
        pick_precision("half", torch.device("cpu"), lambda: None)


def test_cli_refuses_bad_input(cli, saved_models, tmp_path):
    run = cli("train", "longspec-distill", "--target", saved_models.target, "--corpus", tmp_path / "none",
              "--out", tmp_path / "b")
    assert run.rc == 2 and "corpus directory not found" in run.err and "\n" not in run.err.strip()
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    run = cli("train", "longspec-distill", "--target", saved_models.target, "--corpus", tmp_path / "c",
              "--out", tmp_path / "b", "--schedule", "wsd", "--resume", tmp_path / "c")
    assert run.rc == 2 and "no resume.pt" in run.err and "\n" not in run.err.strip()
    assert not (tmp_path / "b").exists()


def test_the_default_peak_rate_is_lower_from_a_trained_block(tmp_path):
    """Without --lr: 1e-3 for a fresh block or new feature layers; 1e-4 from a trained --init block (a hot rate first
    undoes what it learnt); a resumed run 1e-3 where its predecessor's rate is unknown (``resume_run`` keeps a known
    one: the wsd test); a given --lr always wins."""
    base = DistillConfig(target="t", corpus="c", out="o")
    assert peak_lr(base) == FRESH_LR == 1e-3
    assert peak_lr(DistillConfig(**{**base.__dict__, "init": "b"})) == FINE_TUNE_LR == 1e-4
    assert peak_lr(DistillConfig(**{**base.__dict__, "init": "b", "features": "auto"})) == FRESH_LR
    assert peak_lr(DistillConfig(**{**base.__dict__, "resume": str(tmp_path / "none")})) == FRESH_LR
    assert peak_lr(DistillConfig(**{**base.__dict__, "init": "b", "lr": 5e-4})) == 5e-4


def test_warmup_stable_decay_schedule():
    lr = lambda x: warmup_stable_decay(x, 1.0, 0.1, 0.2)
    assert lr(0.0) == 0.0 and lr(0.05) == pytest.approx(0.5)  # warm-up
    assert lr(0.1) == lr(0.5) == lr(0.79) == 1.0  # stable
    assert lr(0.85) == pytest.approx(1 - 0.25 ** 0.5) and lr(1.0) == lr(2.0) == pytest.approx(0, abs=1e-12)  # 1-sqrt
    assert warmup_stable_decay(0.5, 2e-4, 0.0, 0.2) == 2e-4  # a resumed run: no warm-up


def test_wsd_run_writes_a_state_that_a_later_run_resumes(saved_models, tmp_path):
    """--schedule wsd saves the block and AdamW's state as the decay starts; --resume goes on from exactly that
    state (no warm-up, the same draft vocabulary) and its block stays lossless; bad resumes are one line each."""
    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    first = DistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"), out=str(tmp_path / "a"),
                          draft_vocab=24, max_len=48, batch_tokens=96, heldout=0.3, eval_records=4, curve=(),
                          max_positions=256, storage=None, schedule="wsd", decay=0.5, max_tokens=120, lr=5e-4)
    m1 = distill_longspec(first, log=lambda *_: None, target=target)
    state = torch.load(tmp_path / "a" / RESUME_FILE, weights_only=True)
    assert 0.5 * 120 <= state["tokens_total"] < m1["tokens_seen"]  # taken as the decay started, not at the end
    assert m1["tokens_total"] == m1["tokens_seen"]
    fingerprint = model_identity(target.model)["fingerprint"]  # the state and the manifest record the target
    assert state["target"]["fingerprint"] == m1["target_identity"]["fingerprint"] == fingerprint
    # loading the state into a fresh block and optimiser gives back exactly the saved weights and moments
    block, opt = load_longspec(tmp_path / "a", target), None
    for p in block.parameters():
        p.requires_grad_(True)
    opt = adamw(block.parameters(), 1e-3, 0.1)
    load_stable_state(str(tmp_path / "a"), block, opt, first, "manifest.json")
    assert all(torch.equal(v.float(), state["model"][k]) for k, v in block.state_dict().items())
    assert len(opt.state) == len(state["optimizer"]["state"]) > 0
    decayed = load_longspec(tmp_path / "a", target)  # the block saved is the decayed one, not the stable state
    assert any(not torch.equal(v, state["model"][k]) for k, v in decayed.state_dict().items())
    # a second run resumes from it
    second = DistillConfig(**{**first.__dict__, "out": str(tmp_path / "b"), "resume": str(tmp_path / "a"),
                              "draft_vocab": 8, "max_tokens": 60, "lr": None})
    m2 = distill_longspec(second, log=lambda *_: None, target=target)
    assert m2["config"]["warmup"] == 0.0 and m2["draft_vocab"] == 24
    assert m1["config"]["lr"] == m2["config"]["lr"] == 5e-4  # without --lr the resumed run keeps the rate it had
    assert m2["tokens_total"] == state["tokens_total"] + m2["tokens_seen"]
    assert m2["resumed_recipe"]["tokens_seen"] == m1["tokens_seen"]
    assert (tmp_path / "b" / RESUME_FILE).is_file()
    resumed = load_longspec(tmp_path / "b", target)
    assert resumed.vocab.tolist() == decayed.vocab.tolist()
    prompt = target.tokenizer.encode("def h(x):\n    return")
    want = autoregressive_generate(target.model, prompt, sampling=SamplingConfig(), max_new_tokens=12)
    got = [t for c in speculative_generate(target.model, REGISTRY["longspec"](block=resumed, gamma=3), prompt,
                                           sampling=SamplingConfig(), max_new_tokens=12) for t in c]
    assert got == want
    # refusals, before anything loads
    bad = lambda **kw: DistillConfig(**{**second.__dict__, "out": str(tmp_path / "x"), **kw})
    with pytest.raises(RetrospecError, match="--schedule wsd"):
        check_config(bad(schedule="cosine"))
    with pytest.raises(RetrospecError, match="no --init"):
        check_config(bad(init=str(tmp_path / "a")))
    with pytest.raises(RetrospecError, match="no resume.pt"):
        check_config(bad(resume=str(tmp_path / "corpus")))
    with pytest.raises(RetrospecError, match="--decay"):
        check_config(bad(decay=0.0))
    with pytest.raises(RetrospecError, match="--schedule"):
        check_config(bad(schedule="linear", resume=None))
    (tmp_path / "b" / RESUME_FILE).write_bytes(b"not a torch file")
    with pytest.raises(RetrospecError, match="corrupt resume state"):
        distill_longspec(bad(resume=str(tmp_path / "b")), log=lambda *_: None, target=target)
    assert not (tmp_path / "x").exists()


def test_a_run_resumed_on_an_unpacked_corpus_trains_bit_for_bit(saved_models, tmp_path, monkeypatch):
    """A corpus kept packed in a repository (``corpus pack``) and unpacked in a fresh checkout resumes training
    exactly as the original folder would: the same records in the same order, the same block to the last bit. A
    resumed ``auto`` run keeps the precision its predecessor measured instead of timing again (on a busy machine
    the timing can choose the other)."""
    import retrospec.train.longspec_distill as distill
    from retrospec.corpus.pack import pack, unpack

    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    pack(tmp_path / "corpus", tmp_path / "packed")
    unpack(tmp_path / "packed", tmp_path / "unpacked")
    first = DistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"), out=str(tmp_path / "a"),
                          draft_vocab=24, max_len=48, batch_tokens=96, heldout=0.3, eval_records=4, curve=(),
                          max_positions=256, storage=None, schedule="wsd", decay=0.5, max_tokens=120)
    chosen = distill_longspec(first, log=lambda *_: None, target=target)["precision"]
    measure = distill.pick_precision

    def no_timing(precision, *args):
        assert precision != "auto", "a resumed run timed the precision again"
        return measure(precision, *args)

    monkeypatch.setattr(distill, "pick_precision", no_timing)
    blocks = []
    for name in ("corpus", "unpacked"):
        cfg = DistillConfig(**{**first.__dict__, "corpus": str(tmp_path / name), "out": str(tmp_path / f"r-{name}"),
                               "resume": str(tmp_path / "a"), "max_tokens": 96})
        manifest = distill_longspec(cfg, log=lambda *_: None, target=target)
        assert manifest["tokens_seen"] > 0 and manifest["precision"] == chosen
        blocks.append(load_longspec(tmp_path / f"r-{name}", target).state_dict())
    assert blocks[0].keys() == blocks[1].keys()
    assert all(torch.equal(blocks[0][k], blocks[1][k]) for k in blocks[0])
    stable = torch.load(tmp_path / "a" / RESUME_FILE, weights_only=True)["model"]
    assert any(not torch.equal(blocks[0][k].float(), v) for k, v in stable.items() if k in blocks[0])  # it trained


@pytest.mark.parametrize("how", ["seconds", "max_tokens"])
def test_the_schedule_ends_where_the_run_stops(how):
    """A wsd run whose token budget runs out before its seconds (one pass, the default) still ends its decay there,
    and ``--max-tokens`` beyond one pass trains further passes (measured: a pass over the pool stopped a 4,200 s
    run at 3,372 s with a fifth of its decay done)."""
    from types import SimpleNamespace

    from retrospec.train.longspec_distill import train_curve

    records = [{"prompt_ids": [1, 2], "output_ids": [3] * 6} for _ in range(8)]  # 8 records, 48 output tokens
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = SimpleNamespace(schedule="wsd", decay=0.5, warmup=0.0, lr=1.0, max_len=16, batch_tokens=8,
                          seconds=3600.0 if how == "seconds" else None)
    budget = 48 if how == "seconds" else 3 * 48
    lrs = []

    def step(batch):
        lrs.append(opt.param_groups[0]["lr"])
        return 0.0, sum(len(r["output_ids"]) for r in batch)

    passes = []

    def next_pass():  # what distill_longspec's does without --follow: more passes only under --max-tokens
        passes.append(1)
        return records if how == "max_tokens" else None

    result = train_curve(model, opt, records, cfg, budget, [], random.Random(0), lambda *_: None, step=step,
                         evaluate=lambda: {"all": 0.0}, desc="t", next_pass=next_pass)
    assert result["tokens_seen"] == budget
    assert lrs[0] == 1.0 and lrs[-1] < 0.5 and lrs == sorted(lrs, reverse=True)  # the decay ran to the stop
    assert len(passes) == (1 if how == "seconds" else 3)  # next_pass runs after every pass, the last one included
