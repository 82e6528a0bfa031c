"""Drafts in the measured fast path (``fastpath.draft``): prepacked and bfloat16 copies of a draft's matmuls.

The caller's block and model are left as they are, the copy shares their weights, its logits are close to the
plain ones (bfloat16 tolerance), and, the point: whatever precision the draft runs in, the output is the oracle's
(greedy token-identical for ``longspec`` chains and trees and for ``sd``; sampled ``sd`` follows the target's law,
chi-square as in ``test_engine_sampling``). The choice is measured once and cached; the overrides are checked.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_longspec import GREEDY, PROMPT, mimic_pair

from retrospec import kernels
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.drafters.longspec import LongSpecDrafter, fast_block
from retrospec.errors import RetrospecError
from retrospec.fastpath import draft as fdraft
from retrospec.fastpath import engine_for
from retrospec.fastpath.linear import KernelLinear, PackedLinear, kernel_available, onednn_available, pack_weight
from retrospec.types import SpecStats

pytestmark = pytest.mark.skipif(not onednn_available(), reason="oneDNN (mkldnn) is not available in this torch")


def _format_runs(fmt: str) -> bool:
    """Whether a draft can run in ``fmt`` here, without building a kernel while tests are collected."""
    return kernels.w4a8_cpu() if fmt == "w4a8" else fdraft.weight_only.available(fmt)


QUANTIZED_HERE = [pytest.param(f, marks=pytest.mark.skipif(not _format_runs(f), reason=f"no {f} kernel here"))
                  for f in fdraft.QUANTIZED]


def test_bf16_packed_linear_casts_in_and_out():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=True)
    fast = PackedLinear(lin, pack_weight(lin.weight, torch.bfloat16), max_rows=8)
    x = torch.randn(1, 5, 48)
    got, want = fast(x), lin(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, atol=0.05, rtol=0.02) and not torch.equal(got, want)
    x9 = torch.randn(1, 9, 48)  # more rows than max_rows: the plain product on the shared weight
    assert torch.equal(fast(x9), lin(x9))


def test_fast_copy_shares_weights_and_leaves_the_block(monkeypatch):
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "bfloat16")
    target, block = mimic_pair("llama")
    block.set_vocab(list(range(0, 96, 2)))
    fast = fast_block(block)
    assert fast is not block and fast_block(block) is fast  # cached
    assert type(block.self_attn.q_proj) is torch.nn.Linear and block.head_fn is None  # the block is untouched
    assert isinstance(fast.self_attn.q_proj, PackedLinear) and fast.self_attn.q_proj.packed.dtype == torch.bfloat16
    assert fast.embed_tokens is block.embed_tokens and fast.lm_head is block.lm_head
    assert all(a is b for a, b in zip(fast.parameters(), block.parameters()))
    ids = torch.tensor([PROMPT[:12]])
    want, got = block(ids), fast(ids)
    assert got.shape == want.shape == (1, 12, 48)
    assert torch.allclose(got, want, atol=0.1 * want.abs().max().item())
    with torch.no_grad():
        block.mlp.up_proj.weight.mul_(1.5)  # weights changed in place: a new copy
    assert fast_block(block) is not fast


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 8, 8)}], ids=["chain", "tree"])
def test_longspec_in_bfloat16_equals_oracle(monkeypatch, mode):
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "bfloat16")
    target, block = mimic_pair("llama")
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)

    drafter = LongSpecDrafter(block, **mode)
    assert isinstance(drafter.fast.mlp.down_proj, PackedLinear)
    stats = SpecStats()
    chunks = list(speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=40, stats=stats))
    assert [t for c in chunks for t in c] == want
    assert stats.accepted_tokens > 0


def assert_sd_samples_follow_the_target():
    """Sampled ``sd`` runs on tiny models (the draft's engine as the test configured it): the committed tokens follow
    the target's law (chi-square), with some drafts accepted and some rejected."""
    from test_engine_sampling import ALPHA, N_RUNS, T1, chisq_pvalue, exact_law, joint_groups, sample_runs, tiny

    small, sdraft = tiny(seed=11, scale=8.0), tiny(seed=12, scale=3.0)
    counts, stats = sample_runs(small, lambda: REGISTRY["sd"](draft_model=sdraft, gamma=2), T1,
                                range(8_000_000, 8_000_000 + N_RUNS))
    assert 0.03 * stats.drafted_tokens < stats.accepted_tokens < stats.drafted_tokens
    p1, p2, _ = exact_law(small, T1)
    assert chisq_pvalue(joint_groups(counts.sum(2), p1, p2)) > ALPHA


def test_sd_draft_in_bfloat16_is_exact(monkeypatch):
    from test_engine_greedy import oracle, run

    from conftest import sharpen, tiny_llama

    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "bfloat16")
    target = sharpen(tiny_llama(seed=0))
    draft = tiny_llama(seed=1, layers=1)
    drafter = REGISTRY["sd"](draft_model=draft, gamma=4)
    assert drafter.engine.plan.source == "draft:packed-bf16,head:packed-bf16"
    head, x = draft.lm_head.weight.detach(), torch.randn(2, draft.config.hidden_size)
    got = drafter.engine.logits_of(x)  # the head's rows in bfloat16: near the float product, not equal to it
    assert torch.allclose(got, x @ head.T, atol=0.02 * (x @ head.T).abs().max().item())
    assert not torch.equal(got, x @ head.T)
    assert engine_for(draft).head_packed is None or engine_for(draft).head_packed.dtype == torch.float32
    out, _, _ = run(target, drafter)
    assert out == oracle(target)
    # sampling: the committed tokens follow the target's law with q computed in bfloat16
    assert_sd_samples_follow_the_target()


def test_choice_is_measured_once_and_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    weights = [torch.randn(64, 32), torch.randn(200, 32)]
    monkeypatch.setenv("RETROSPEC_FASTPATH", "off")
    assert fdraft.draft_choice(weights) == "plain"
    monkeypatch.setenv("RETROSPEC_FASTPATH", "packed")
    assert fdraft.draft_choice(weights) == "packed"
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "bfloat16")
    assert fdraft.draft_choice(weights) == "packed-bf16"
    assert fdraft.draft_choice([w.bfloat16() for w in weights]) == "packed"  # already bfloat16 weights
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "half")
    with pytest.raises(RetrospecError, match="RETROSPEC_DRAFT_DTYPE"):
        fdraft.draft_choice(weights)
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "auto")
    monkeypatch.setenv("RETROSPEC_FASTPATH", "auto")
    first = fdraft.draft_choice(weights)
    files = list((tmp_path / "fastpath").glob("draft-*.json"))
    assert len(files) == 1 and first in fdraft.CHOICES  # no integer format unless the caller allows them
    data = json.loads(files[0].read_text())
    measured = set(fdraft.CHOICES) - (set() if kernel_available(weights[0]) else {"kernel"})  # no AVX-512 or AVX2: no kernel
    assert data["choice"] == first and set(data["ms"]) == measured
    monkeypatch.setattr(fdraft, "measure_choice", lambda *a, **k: pytest.fail("measured twice"))
    assert fdraft.draft_choice(weights) == first  # read from the cache
    monkeypatch.setattr(fdraft, "measure_choice", lambda w, allowed: {"version": fdraft.VERSION, "choice": "plain",
                                                                      "ms": {c: {} for c in allowed}})
    fdraft.draft_choice(weights, quantized=True)  # a block's weights: the integer formats that fit are measured too
    (new,) = set((tmp_path / "fastpath").glob("draft-*.json")) - set(files)
    fits = {f for f in fdraft.QUANTIZED if fdraft._quantizable(weights, f)}  # 200 rows: no w4a8 (tiles of 16)
    assert set(json.loads(new.read_text())["ms"]) - set(fdraft.CHOICES) == fits
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "float32")  # another allowed set: another key
    monkeypatch.setattr(fdraft, "measure_choice",
                        lambda w, allowed: {"version": fdraft.VERSION, "choice": allowed[-1], "ms": {}})
    assert fdraft.draft_choice(weights) == "kernel"  # float32 weights: plain, packed or the kernel, no bfloat16
    if kernel_available(weights[0]):  # forced: taken without measuring
        monkeypatch.setenv("RETROSPEC_FASTPATH", "kernel")
        monkeypatch.setattr(fdraft, "measure_choice", lambda *a, **k: pytest.fail("measured"))
        assert fdraft.draft_choice(weights) == "kernel"


@pytest.mark.skipif(not kernel_available(), reason="no AVX-512 or AVX2, or no C++ compiler: no f32 kernel")
def test_drafts_through_the_f32_kernel_are_exact(monkeypatch):
    """``kernel`` as a draft's path: the LongSpec block's linears and head rows and a draft model's engine run
    ``kernels.f32``; greedy output stays the oracle's."""
    from conftest import tiny_llama

    monkeypatch.setenv("RETROSPEC_FASTPATH", "kernel")
    target, block = mimic_pair("llama")
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    drafter = LongSpecDrafter(block, gamma=4)
    assert isinstance(drafter.fast.mlp.down_proj, KernelLinear)
    got = speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=40)
    assert [t for c in got for t in c] == want
    sd = REGISTRY["sd"](draft_model=tiny_llama(seed=1, layers=1), gamma=4)
    assert sd.engine.plan.source == "draft:kernel,head:kernel" and sd.engine.plan.kernel
    got = speculative_generate(target, sd, PROMPT, sampling=GREEDY, max_new_tokens=40)
    assert [t for c in got for t in c] == want


@pytest.mark.parametrize("fmt", QUANTIZED_HERE)
@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 8, 8)}], ids=["chain", "tree"])
def test_a_block_that_runs_quantized_equals_oracle(monkeypatch, tmp_path, mode, fmt):
    """A block's linears and, measured apart, its head rows may run in ``w8a8`` (int8 rows, activations quantized per
    row) or ``w4a8`` (4-bit rows in groups of 32, activations quantized per group): the logits stay near the float
    ones, the block is left as it is, and the output is the oracle's. ``RETROSPEC_DRAFT_DTYPE=float32`` rules them
    out."""
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("RETROSPEC_FASTPATH", "auto")
    target, block = mimic_pair("llama")
    rows = block.lm_head.weight.detach()
    x = torch.randn(3, rows.shape[1])
    got, want = fdraft.row_product(rows, fmt)(x), x @ rows.T
    near = {"w8a8": 0.03, "w4a8": 0.15}[fmt]
    assert torch.allclose(got, want, atol=near * want.abs().max().item()) and not torch.equal(got, want)
    monkeypatch.setattr(fdraft, "measure_choice", lambda w, allowed: {"version": fdraft.VERSION,
                                                                      "choice": allowed[-1], "ms": {}})
    last = [f for f in fdraft.QUANTIZED if fdraft._quantizable([rows], f)][-1]  # what the stub picks
    assert fdraft.draft_choice([rows], quantized=True) == last and fdraft.draft_choice([rows]) not in fdraft.QUANTIZED
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "float32")
    assert fdraft.draft_choice([rows], quantized=True) not in fdraft.QUANTIZED
    monkeypatch.setenv("RETROSPEC_DRAFT_DTYPE", "auto")
    monkeypatch.setattr("retrospec.drafters.longspec.draft_choice",
                        lambda weights, remeasure=False, quantized=False:
                        fmt if quantized and fdraft._quantizable(list(weights), fmt) else "plain")
    plain = block(torch.tensor([PROMPT]))  # [1, L, V]
    drafter = LongSpecDrafter(block, **mode)
    fast = drafter.fast
    assert fast is not block and fast.head_choice == fmt and block.head_fn is None
    assert type(block.mlp.down_proj) is torch.nn.Linear  # the caller's block is untouched
    assert isinstance(fast.mlp.down_proj, fdraft.weight_only.WeightOnlyLinear) and fast.mlp.down_proj.fmt == fmt
    with torch.inference_mode():
        quantized = fast(torch.tensor([PROMPT]))
    assert torch.allclose(quantized, plain, atol=2 * near * plain.abs().max().item())
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    stats = SpecStats()
    chunks = list(speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=40, stats=stats))
    assert [t for c in chunks for t in c] == want and stats.accepted_tokens > 0


@pytest.mark.parametrize("fmt", QUANTIZED_HERE)
def test_an_sd_draft_whose_head_runs_quantized_is_exact(monkeypatch, fmt):
    """A draft model's head is measured apart from its linears and may run in ``w8a8`` or ``w4a8`` (its linears may
    not: the error compounds through its layers): its q changes, the output does not (greedy == oracle; sampled tokens
    follow the target's law), and the caller's draft is left as it was."""
    from test_engine_greedy import oracle, run

    from conftest import sharpen, tiny_llama

    monkeypatch.setattr("retrospec.fastpath.engine.draft_choice",  # where allowed and the shapes fit
                        lambda weights, remeasure=False, quantized=False:
                        fmt if quantized and fdraft._quantizable(list(weights), fmt) else "plain")
    target = sharpen(tiny_llama(seed=0))
    draft = tiny_llama(seed=1, layers=1)
    drafter = REGISTRY["sd"](draft_model=draft, gamma=4)
    assert drafter.engine.plan.source == f"draft:plain,head:{fmt}" and type(draft.lm_head) is torch.nn.Linear
    assert not any(isinstance(m, fdraft.weight_only.WeightOnlyLinear) for m in drafter.engine.decoder.modules())
    head, x = draft.lm_head.weight.detach(), torch.randn(2, draft.config.hidden_size)
    got = drafter.engine.logits_of(x)
    near = {"w8a8": 0.03, "w4a8": 0.15}[fmt]
    assert torch.allclose(got, x @ head.T, atol=near * (x @ head.T).abs().max().item())
    assert not torch.equal(got, x @ head.T)
    out, _, _ = run(target, drafter)
    assert out == oracle(target)
    if fmt == [f for f in fdraft.QUANTIZED if _format_runs(f)][-1]:  # the rule reads q as the draft made it, in any
        assert_sd_samples_follow_the_target()  # format: one format's chi-square covers the path (~20 s each)
