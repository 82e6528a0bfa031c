"""Distilling a small draft LM on a corpus of the target's own outputs (``train.draft_distill``): the re-chosen
vocabulary keeps trained rows, a whole run on a tiny corpus saves a draft that loads with its ``draft_vocab.json``
and keeps ``sd`` lossless (greedy oracle), and the CLI's user errors are one line."""

from __future__ import annotations

import json

import pytest
import torch

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.errors import RetrospecError
from retrospec.models import load_model
from retrospec.train.draft_distill import DraftDistillConfig, check_config, distill_draft, revocab
from retrospec.train.resume import RESUME_FILE

from conftest import tiny_llama
from test_longspec_distill import tiny_corpus

pytestmark = pytest.mark.usefixtures("single_thread")


def test_revocab_keeps_trained_rows_and_takes_the_targets_for_new_ids():
    """Fewer shared ids than the width: a new id's row is the target's as it is."""
    target = tiny_llama(seed=3)
    draft = tiny_llama(seed=4, layers=1, vocab=10)  # rows = target ids 0..9
    new = revocab(draft, list(range(10)), [0, 5, 50, 60], target)
    assert new.config.vocab_size == 4 and draft.config.vocab_size == 10  # the input draft is untouched
    emb, old, theirs = (new.get_input_embeddings().weight, draft.get_input_embeddings().weight,
                        target.get_input_embeddings().weight)
    assert torch.equal(emb[0], old[0]) and torch.equal(emb[1], old[5])
    assert torch.equal(emb[2], theirs[50]) and torch.equal(emb[3], theirs[60])
    for (name, a), (_, b) in zip(new.model.layers.state_dict().items(), draft.model.layers.state_dict().items()):
        assert torch.equal(a, b), name


def test_revocab_carries_new_target_rows_into_the_drafts_space():
    """With at least H shared ids, a new id's row is the target's row through the least-squares map from the target's
    rows to the draft's (here exact: the draft's rows are the target's through a fixed matrix), not the raw row."""
    target = tiny_llama(seed=3)  # hidden 32
    draft = tiny_llama(seed=4, layers=1, vocab=64)  # rows = target ids 0..63
    m = torch.randn(32, 32) / 32 ** 0.5
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight[:64] @ m)
    new = revocab(draft, list(range(64)), list(range(40)) + [80, 81], target)
    emb, theirs = new.get_input_embeddings().weight, target.get_input_embeddings().weight
    assert torch.equal(emb[7], draft.get_input_embeddings().weight[7])  # kept rows stay exactly
    assert torch.allclose(emb[40:], theirs[[80, 81]] @ m, atol=1e-4)
    assert not torch.allclose(emb[40:], theirs[[80, 81]], atol=1e-2)


def test_distil_on_a_tiny_corpus_saves_a_lossless_draft(saved_models, tmp_path):
    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    out = tmp_path / "draft"
    cfg = DraftDistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"), out=str(out),
                             init=str(saved_models.draft), vocab=40, max_len=48, batch_tokens=96, heldout=0.3,
                             eval_records=4, curve=(40,), max_tokens=400, precision="bfloat16")
    manifest = distill_draft(cfg, log=lambda *_: None, target=target)
    assert manifest["precision"] == "bfloat16"  # forwards under autocast; the saved draft loads as ever
    assert manifest["steps"] >= 1 and manifest["curve"][0]["tokens"] == 0 and len(manifest["curve"]) >= 2
    assert all(0 <= c["all"] <= 1 and 0 <= c["vocab_coverage"] <= 1 for c in manifest["curve"])
    assert json.loads((out / "real_draft.json").read_text())["steps"] == manifest["steps"]
    draft = load_model(out, role="draft")
    ids = draft.vocab_map.tolist()
    assert draft.vocab_size == 40 and ids == sorted(ids) and saved_models.eos_id in ids
    prompt = target.tokenizer.encode("def h(x):\n    return")
    greedy = SamplingConfig()
    want = autoregressive_generate(target.model, prompt, sampling=greedy, max_new_tokens=16)
    drafter = REGISTRY["sd"](draft_model=draft.model, gamma=3, draft=draft, target=target)
    got = [t for c in speculative_generate(target.model, drafter, prompt, sampling=greedy, max_new_tokens=16)
           for t in c]
    assert got == want
    with pytest.raises(RetrospecError, match="already exists"):
        check_config(cfg)
    # --keep-vocab: a further pass from the distilled draft keeps its ids whatever --vocab says
    kept = DraftDistillConfig(**{**cfg.__dict__, "out": str(tmp_path / "kept"), "init": str(out), "vocab": 8,
                                 "keep_vocab": True, "max_tokens": 100, "curve": ()})
    distill_draft(kept, log=lambda *_: None, target=target)
    assert load_model(tmp_path / "kept", role="draft").vocab_map.tolist() == ids
    with pytest.raises(RetrospecError, match="no draft_vocab.json"):
        distill_draft(DraftDistillConfig(**{**kept.__dict__, "out": str(tmp_path / "k2"),
                                            "init": str(saved_models.draft)}), log=lambda *_: None, target=target)


def test_wsd_draft_resumes_from_its_stable_state(saved_models, tmp_path):
    """--schedule wsd writes resume.pt beside the draft; --resume loads exactly it (its vocabulary kept, no warm-up)
    and the resumed draft keeps sd lossless."""
    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    cfg = DraftDistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"),
                             out=str(tmp_path / "a"), init=str(saved_models.draft), vocab=40, max_len=48,
                             batch_tokens=96, heldout=0.3, eval_records=4, curve=(), max_tokens=200,
                             precision="float32", schedule="wsd", decay=0.5)
    m1 = distill_draft(cfg, log=lambda *_: None, target=target)
    state = torch.load(tmp_path / "a" / RESUME_FILE, weights_only=True)
    assert 0.5 * 200 <= state["tokens_total"] < m1["tokens_seen"] == m1["tokens_total"]
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    ids = load_model(tmp_path / "a", role="draft").vocab_map.tolist()
    resumed = DraftDistillConfig(**{**cfg.__dict__, "out": str(tmp_path / "b"), "init": None,
                                    "resume": str(tmp_path / "a"), "vocab": 8, "max_tokens": 100})
    m2 = distill_draft(resumed, log=lambda *_: None, target=target)
    assert m2["config"]["warmup"] == 0.0 and m2["tokens_total"] == state["tokens_total"] + m2["tokens_seen"]
    assert m2["resumed_recipe"]["steps"] == m1["steps"]
    draft = load_model(tmp_path / "b", role="draft")
    assert draft.vocab_map.tolist() == ids
    prompt = target.tokenizer.encode("def h(x):\n    return")
    want = autoregressive_generate(target.model, prompt, sampling=SamplingConfig(), max_new_tokens=12)
    drafter = REGISTRY["sd"](draft_model=draft.model, gamma=3, draft=draft, target=target)
    got = [t for c in speculative_generate(target.model, drafter, prompt, sampling=SamplingConfig(),
                                           max_new_tokens=12) for t in c]
    assert got == want
    with pytest.raises(RetrospecError, match="--init DRAFT, or --resume"):
        check_config(DraftDistillConfig(**{**resumed.__dict__, "out": str(tmp_path / "x"), "resume": None}))
    with pytest.raises(RetrospecError, match="no --init"):
        check_config(DraftDistillConfig(**{**resumed.__dict__, "out": str(tmp_path / "x"), "init": "x"}))


def test_cli_refuses_bad_input(cli, saved_models, tmp_path):
    run = cli("train", "draft-distill", "--target", saved_models.target, "--corpus", tmp_path / "none",
              "--init", saved_models.draft, "--out", tmp_path / "d")
    assert run.rc == 2 and "corpus directory not found" in run.err and "\n" not in run.err.strip()
    (tmp_path / "c").mkdir()
    run = cli("train", "draft-distill", "--target", saved_models.target, "--corpus", tmp_path / "c",
              "--init", saved_models.draft, "--out", tmp_path / "d", "--vocab", "1")
    assert run.rc == 2 and "--vocab" in run.err
    assert not (tmp_path / "d").exists()
