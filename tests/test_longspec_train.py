"""LongSpec: training the draft block and evaluating it by position bucket.

Tiny Llama targets (fp32, CPU, one thread), windows of 24-40 tokens, max_positions 256:
- anchor-offset positions: the first s <= 4 kept, the rest contiguous and shifted, all < max_positions; off = 0..L-1;
- the flash-noisy shift lies in [1, noisy_max]; with shift delta the loss at query i does not depend on the target's
  K/V at indices > i - delta (and does on the others);
- the target's last-layer K/V and logits at anchor-offset positions are those of a plain forward at those positions
  (the anchors stay visible: no packed-sequence split); chunked block logits equal unchunked ones;
- a 5-step run of ``retrospec train longspec`` writes a block ``load_longspec`` reads and a manifest with a loss
  history; the loss falls over 30 steps on a repetitive stream;
- position buckets and the target's offset check return one number per bucket; ``longspec-eval`` prints and writes
  them; user errors are one line, exit 2.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from retrospec.errors import RetrospecError
from retrospec.models.longspec import LongSpecDraft, load_longspec
from retrospec.train.common import adamw, resolve_device, warmup_cosine
from retrospec.train.longspec import (LongSpecTrainConfig, anchor_offset_positions, draft_logits, draft_token_losses,
                                      evaluate_position_buckets, sample_positions, sample_shift, target_logits,
                                      target_last_kv, target_loss_under_offset, train_longspec)

torch.set_num_threads(1)

MAX_POS = 256


def randomized(target, window: int, seed: int = 0, std: float = 0.3) -> LongSpecDraft:
    """A block whose every branch matters (identity init would zero the cross-attention's output)."""
    block = LongSpecDraft.for_target(target, window=window)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g)) if "norm" in name
                    else std * torch.randn(p.shape, generator=g))
    return block


def split_anchor(pos: torch.Tensor) -> tuple[int, int]:
    """(s, o) of anchor-offset positions: s = the anchors (positions == index), o = the shift of the rest."""
    n = pos.numel()
    idx = torch.arange(n)
    s = int((pos == idx).long().cumprod(0).sum())
    return s, (int(pos[s]) - s if s < n else 0)


# --------------------------------------------------------------------------------------------- positions, shift


@pytest.mark.parametrize("make_rng", [lambda: np.random.default_rng(0), lambda: random.Random(0)])
def test_anchor_offset_positions(make_rng):
    rng, n = make_rng(), 32
    anchors, offsets = set(), []
    for _ in range(300):
        pos = anchor_offset_positions(n, MAX_POS, rng)
        assert pos.dtype == torch.long and pos.shape == (n,)
        s, o = split_anchor(pos)
        if o > 0:  # (o = 0 gives 0..L-1, where s cannot be told apart)
            assert s <= 4
            anchors.add(s)
        assert torch.equal(pos[:s], torch.arange(s))  # anchors kept
        assert torch.equal(pos[s:], torch.arange(s, n) + o)  # the rest contiguous, shifted by o
        assert 0 <= o <= MAX_POS - n and int(pos.max()) < MAX_POS
        offsets.append(o)
    assert anchors == {0, 1, 2, 3, 4} and max(offsets) > (MAX_POS - n) // 2
    assert torch.equal(anchor_offset_positions(n, n, rng), torch.arange(n))  # no room: no offset
    assert int(anchor_offset_positions(3, MAX_POS, rng, max_anchor=4).numel()) == 3
    with pytest.raises(ValueError):
        anchor_offset_positions(n, n - 1, rng)


def test_sample_positions_off_and_on():
    rng = np.random.default_rng(1)
    off = sample_positions(3, 16, MAX_POS, rng, anchor_offset=False)
    assert torch.equal(off, torch.arange(16)[None].repeat(3, 1))
    on = sample_positions(3, 16, MAX_POS, rng, anchor_offset=True)
    assert on.shape == (3, 16) and int(on.max()) < MAX_POS and not torch.equal(on, off)


def test_sample_shift_range():
    rng = np.random.default_rng(0)
    assert {sample_shift(rng, 4) for _ in range(400)} == {1, 2, 3, 4}
    assert {sample_shift(rng, 1) for _ in range(50)} == {1}
    with pytest.raises(ValueError):
        sample_shift(rng, 0)


def test_lr_schedule_warmup_then_cosine():
    """The trainers' one schedule (``train.common.warmup_cosine``) in LongSpec's continuous form (ramp 0)."""
    def lr_at(progress, peak):
        return warmup_cosine(progress, 1.0, peak, 0.1, ramp=0)

    assert lr_at(0.0, 1.0) == 0.0 and lr_at(0.05, 1.0) == pytest.approx(0.5)
    assert lr_at(0.1, 1.0) == pytest.approx(1.0) and lr_at(1.0, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(0.55, 1.0) == pytest.approx(0.5)
    # step form (ramp 1): step 0 already trains; the cosine ends at min_ratio x peak; a time budget's progress
    assert warmup_cosine(0, 100, 2.0, 10) == pytest.approx(0.2) and warmup_cosine(9, 100, 2.0, 10) == 2.0
    assert warmup_cosine(10, 100, 2.0, 10, 0.1) == 2.0 and warmup_cosine(100, 100, 2.0, 10, 0.1) == pytest.approx(0.2)
    assert warmup_cosine(50, 0, 2.0, 10, progress=0.5) == pytest.approx(1.0)


def test_train_common_device_and_optimizer():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(RetrospecError, match="--device must be"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(RetrospecError, match="no CUDA device"):
            resolve_device("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model[1].weight.requires_grad_(False)  # frozen: not optimised
    opt = adamw(model.parameters(), 1e-3, weight_decay=0.1)
    decayed, plain = opt.param_groups
    assert [p.shape for p in decayed["params"]] == [(4, 3)] and decayed["weight_decay"] == 0.1
    assert [p.shape for p in plain["params"]] == [(4,), (4,)] and plain["weight_decay"] == 0.0


# -------------------------------------------------------------------------------------------- target and block


def test_target_kv_and_logits_at_anchor_offset_positions():
    target = tiny_llama(seed=0, max_pos=MAX_POS)
    ids = torch.randint(0, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(3), torch.arange(3, 24) + 150])[None]  # 3 anchors, the rest shifted by 150
    logits, (k, v) = target_logits(target, ids, pos)
    with torch.no_grad():
        ref = target(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=True)
    ref_k, ref_v = ref.past_key_values.layers[-1].keys, ref.past_key_values.layers[-1].values
    assert torch.allclose(logits, ref.logits, atol=1e-5)
    assert torch.allclose(k, ref_k, atol=1e-5) and torch.allclose(v, ref_v, atol=1e-5)
    k2, v2 = target_last_kv(target, ids, pos)
    assert torch.allclose(k2, k, atol=1e-5) and torch.allclose(v2, v, atol=1e-5)
    other = ids.clone()
    other[0, 0] = (int(ids[0, 0]) + 1) % 90
    assert not torch.allclose(target_logits(target, other, pos)[0][0, -1], logits[0, -1])  # the anchor is seen


@pytest.mark.parametrize("delta", [1, 3])
def test_noisy_shift_hides_target_kv_after_i_minus_delta(delta):
    target = tiny_llama(seed=0, max_pos=MAX_POS)
    block = randomized(target, window=8)
    ids = torch.randint(0, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    pos = anchor_offset_positions(24, MAX_POS, np.random.default_rng(3))[None]
    kv = target_last_kv(target, ids, pos)
    with torch.no_grad():
        base = draft_token_losses(block, ids, pos, kv, delta)  # [1, 23]
        g = torch.Generator().manual_seed(2)
        for i in (0, 5, 12, 22):
            late = tuple(t.clone() for t in kv)
            for t in late:
                t[:, :, i - delta + 1:] = 10 * torch.randn(t[:, :, i - delta + 1:].shape, generator=g)
            assert torch.allclose(draft_token_losses(block, ids, pos, late, delta)[0, i], base[0, i], atol=1e-6)
            if i - delta >= 0:
                early = tuple(t.clone() for t in kv)
                for t in early:
                    t[:, :, : i - delta + 1] = 10 * torch.randn(t[:, :, : i - delta + 1].shape, generator=g)
                assert not torch.allclose(draft_token_losses(block, ids, pos, early, delta)[0, i], base[0, i])


def test_chunked_draft_logits_equal_unchunked():
    target = tiny_llama(seed=0, max_pos=MAX_POS)
    block = randomized(target, window=8)
    ids = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    pos = sample_positions(2, 30, MAX_POS, np.random.default_rng(5))
    kv = target_last_kv(target, ids, pos)
    with torch.no_grad():
        full = draft_logits(block, ids, pos, kv, 2)
        for chunk in (1, 7, 13):
            assert torch.allclose(draft_logits(block, ids, pos, kv, 2, chunk=chunk), full, atol=1e-5)
        plain = torch.arange(30)[None].expand(2, 30)  # at positions 0..L-1 the block's own forward agrees
        assert torch.allclose(draft_logits(block, ids, plain, kv, 2), block(ids, kv, plain, shift=2), atol=1e-5)
        # and at anchor-offset positions too: the forward's cross-attention visibility is by index, so no query
        # sees the target K/V of a later token however large the position jump
        assert int(pos.max()) > 30
        assert torch.allclose(full, block(ids, kv, pos, shift=2), atol=1e-5)


# -------------------------------------------------------------------------------------------------- training


def test_loss_falls_on_a_repetitive_stream(tmp_path):
    target = tiny_llama(seed=0, max_pos=MAX_POS)
    stream = np.tile(np.arange(10, 27), 200).astype(np.int32)  # a 17-token cycle
    cfg = LongSpecTrainConfig(target="tiny", out=str(tmp_path / "block"), seq_len=32, batch=2, steps=30, window=16,
                              lr=1e-2, log_every=1, seed=0)
    manifest = train_longspec(cfg, log=lambda _: None, target=target, stream=stream)
    losses = [h["loss"] for h in manifest["loss_history"]]
    assert len(losses) == 30 and manifest["steps"] == 30 and manifest["tokens_seen"] == 30 * 2 * 32
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5  # (about 4.56 -> 3.32)
    assert all(p.grad is None and p.requires_grad for p in target.parameters())  # target untouched, flags restored
    assert sum(manifest["shift_counts"].values()) == 30


def test_cli_train_writes_a_loadable_block(cli, saved_models, tmp_path):
    from retrospec.models.loading import load_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n\n" * 40)
    out = tmp_path / "ls"
    run = cli("train", "longspec", "--target", saved_models.target, "--out", out, "--corpus", corpus, "--seq-len",
              32, "--steps", 5, "--window", 16, "--threads", 1, "--noisy-max", 3)
    assert run.rc == 0, run.err
    block = load_longspec(out, load_model(str(saved_models.target)))
    assert block.window == 16
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["steps"] == 5 and manifest["tokens_seen"] == 5 * 32 and manifest["loss_history"]
    assert manifest["config"]["anchor_offset"] is True and manifest["config"]["noisy_max"] == 3
    assert manifest["config"]["max_positions"] == saved_models.max_positions
    assert manifest["data"]["kind"] == "text file" and manifest["data"]["tokens"] > 32
    assert manifest["target"]["name"] == str(saved_models.target)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left

    report = tmp_path / "eval.json"
    run = cli("train", "longspec-eval", "--target", saved_models.target, "--draft", out, "--draft", out,
              "--corpus", corpus, "--seq-len", 64, "--docs", 2, "--bucket", 32, "--out", report, "--threads", 1)
    assert run.rc == 0, run.err
    assert "draft loss" in run.out and "anchor-offset positions" in run.out
    result = json.loads(report.read_text())
    rows = result["drafts"][str(out)]
    assert [(r["start"], r["end"]) for r in rows] == [(0, 32), (32, 64)]
    assert result["data"]["documents_used"] == 2 and "delta" in result["target_offset_check"]


# ------------------------------------------------------------------------------------------------ evaluation


def test_position_buckets_and_target_offset_check():
    target = tiny_llama(seed=0, max_pos=MAX_POS)
    block = randomized(target, window=8)
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, 90, (40,), generator=g) for _ in range(2)]
    for anchor in (False, True):
        rows = evaluate_position_buckets(block, target, docs, bucket=16, max_len=40, anchor=anchor)
        assert [(r["start"], r["end"], r["tokens"]) for r in rows] == [(0, 16, 32), (16, 32, 32), (32, 40, 14)]
        assert all(np.isfinite(r["draft_loss"]) and np.isfinite(r["target_loss"]) and 0 <= r["agree"] <= 1
                   for r in rows)
    check = target_loss_under_offset(target, docs, max_len=40)
    assert set(check) >= {"normal", "anchor_offset", "delta"} and check["tokens"] == 78
    assert check["delta"] == pytest.approx(check["anchor_offset"] - check["normal"], abs=1e-3)


# ------------------------------------------------------------------------------------------------ CLI errors


def test_cli_user_errors(cli, saved_models, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x = 1\n" * 50)
    base = ["train", "longspec", "--target", saved_models.target, "--corpus", corpus, "--steps", 1, "--seq-len", 16]
    cli("train", "longspec", "--target", tmp_path / "nope", "--out", tmp_path / "o1", "--steps", 1
        ).assert_user_error("not found")
    cli(*base, "--out", tmp_path / "o2", "--noisy-max", 0).assert_user_error("noisy-max")
    cli(*base, "--out", tmp_path / "o3", "--batch", 0).assert_user_error("batch")
    cli(*base[:-2], "--seq-len", 1, "--out", tmp_path / "o4").assert_user_error("seq-len")
    cli(*base[:-2], "--seq-len", 4096, "--out", tmp_path / "o5").assert_user_error("exceeds")
    cli(*base, "--out", tmp_path / "o6", "--lr", 0).assert_user_error("lr")
    cli(*base, "--out", tmp_path / "o7", "--anchor-offset", "maybe").assert_user_error("anchor-offset")
    cli(*base, "--out", tmp_path / "o8", "--seconds", 5).assert_user_error("steps")
    cli(*base, "--out", tmp_path).assert_user_error("already exists")
    cli("train", "longspec", "--target", saved_models.target, "--corpus", tmp_path / "none.txt", "--steps", 1,
        "--out", tmp_path / "o9").assert_user_error("--corpus not found")
    cli("train", "longspec-eval", "--target", saved_models.target, "--draft", tmp_path / "nodraft",
        "--corpus", corpus).assert_user_error("not found")
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir())


def test_longspec_eval_takes_a_bundled_blocks_name(cli, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n\n" * 80)
    run = cli("train", "longspec-eval", "--target", "zoo", "--draft", "zoo-longspec", "--corpus", corpus,
              "--seq-len", 64, "--docs", 1, "--bucket", 32, "--threads", 1, "--no-target-check")
    assert run.rc == 0, run.err
    assert "zoo-longspec" in run.out and "draft loss" in run.out
