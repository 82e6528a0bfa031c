"""Weight-only formats (int8, int4, w8a8, w4a8): each a model of its own, exact within it.

- a layer computes what its dequantized weight computes (bfloat16 activations), and is row-invariant: a k-row call
  equals k one-row calls bit for bit on this machine (what keeps a verification equal to one-token steps);
- a quantized model's engine path (prefix + block attention) equals its plain forward;
- on the tiny models, every lossless method is token-identical to ``ar`` in the same format (Llama and Qwen2; on
  a real model a bfloat16-rounded activation can flip a near-tie, see ``retrospec.weight_only``), and speculative
  sampling reproduces the quantized target's law (chi-square);
- a quantized model keeps its source's identity (artefacts built on float32 load), and loads by name or path.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from retrospec.api import generate
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate
from retrospec.drafters import REGISTRY
from retrospec.errors import RetrospecError
from retrospec.fastpath import engine_for
from retrospec.identity import model_identity, same_model
from retrospec.models import LoadedModel, load_model
from retrospec.weight_only import WeightOnlyLinear, quantize_model_, reference_forward, row_invariant

from conftest import formats_here, sharpen, tiny_llama, tiny_qwen2

pytestmark = pytest.mark.usefixtures("single_thread")


def quantized(model, fmt):
    return quantize_model_(copy.deepcopy(model), fmt)


@pytest.mark.parametrize("fmt", formats_here())
@pytest.mark.parametrize("shape", [(96, 32), (64, 128), (576, 1536)])
def test_a_layer_computes_its_dequantized_weight_and_is_row_invariant(fmt, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(shape[1], shape[0], bias=True)
    layer = WeightOnlyLinear.from_linear(lin, fmt)
    x = torch.randn(5, shape[1])
    got, want = layer(x), reference_forward(layer, x)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bfloat16 output rounding
    err = (layer.dequantized() - lin.weight).abs().max() / lin.weight.abs().max()
    assert err < (0.01 if fmt == "int8" else 0.1)  # the quantization error itself
    for rows in (2, 3, 8, 16):
        assert row_invariant(layer, rows), (fmt, shape, rows)


@pytest.mark.parametrize("fmt", formats_here())
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_the_engine_path_equals_the_plain_forward(fmt, build):
    model = quantized(sharpen(build(seed=3)), fmt)
    assert isinstance(model.get_output_embeddings(), WeightOnlyLinear)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 30, 4]])
    plain = model(input_ids=ids).logits[0]
    engine = engine_for(model, "auto")
    assert engine.describe()["plan"] == f"weight-only:{fmt}"
    from transformers import DynamicCache

    logits, _ = engine.forward(ids, torch.arange(8)[None], None, DynamicCache(config=model.config))
    assert torch.allclose(logits, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", formats_here())
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_lossless_methods_equal_ar_in_the_same_format_on_tiny_models(fmt, build):
    tgt = LoadedModel(quantized(sharpen(build(seed=5)), fmt), None, "t")
    drf = LoadedModel(quantized(sharpen(build(seed=5, layers=1)), fmt), None, "d")
    prompt = [5, 9, 2, 7, 7, 1, 30, 4, 5, 9, 2]
    oracle = autoregressive_generate(tgt.model, prompt, sampling=SamplingConfig(), max_new_tokens=40)
    for method in ("ar", "sd", "pld"):
        out = generate(prompt, target=tgt, draft=drf if method == "sd" else None, method=method, max_new_tokens=40,
                       gating=False)
        assert out.token_ids == oracle[:len(out.token_ids)] and len(out.token_ids) >= 1, (fmt, method)
    float_oracle = autoregressive_generate(sharpen(build(seed=5)), prompt, sampling=SamplingConfig(),
                                           max_new_tokens=40)
    assert len(oracle) and len(float_oracle)  # both ran; they may differ: a format is a model of its own


@pytest.mark.parametrize("fmt", formats_here())
def test_sampling_follows_the_quantized_target_law(fmt, monkeypatch):
    """sd at temperature 1 on a quantized target: (x1, x2) against that model's own exact law (1,500 runs; a
    16-token vocabulary, which int4's kernel needs)."""
    import test_engine_sampling as es

    monkeypatch.setattr(es, "V", 16)
    PROMPT, V, chisq_pvalue, exact_law, joint_groups, sample_runs = (es.PROMPT, 16, es.chisq_pvalue, es.exact_law,
                                                                    es.joint_groups, es.sample_runs)
    target = quantized(sharpen(tiny_llama(seed=11, layers=1, hidden=32, vocab=V), 8.0), fmt)
    draft = sharpen(tiny_llama(seed=12, layers=1, hidden=32, vocab=V), 8.0)
    cfg = SamplingConfig(temperature=1.0)
    p1, p2, _ = exact_law(target, cfg)
    counts, stats = sample_runs(target, lambda: REGISTRY["sd"](draft_model=draft, gamma=2, adaptive=False), cfg,
                                range(7_000_000, 7_001_500))
    assert stats.accepted_tokens > 0 and len(PROMPT)
    c12 = counts.sum(2)
    assert chisq_pvalue(joint_groups(c12, p1, p2)) > 1e-3
    q1, q2, _ = exact_law(draft, cfg)  # power: the draft's law is rejected
    assert chisq_pvalue(joint_groups(c12, q1, q2), strict=False) < 1e-6
    assert np.isfinite(c12).all()


def test_identity_is_the_source_and_artefacts_accept_it():
    f32 = load_model("zoo")
    for fmt in formats_here():
        q = load_model("zoo", dtype=fmt)
        assert q.model is not f32.model and isinstance(q.model.get_output_embeddings(), WeightOnlyLinear)
        ident = model_identity(q.model)
        assert ident["fingerprint"] == model_identity(f32.model)["fingerprint"] and ident["format"] == fmt
        assert same_model(model_identity(f32.model), q.model)
        assert q.vocab_size == f32.vocab_size
    other = quantize_model_(copy.deepcopy(tiny_llama(seed=1)), "int4")
    assert not same_model(model_identity(f32.model), other)


def test_formats_on_the_cli_and_their_errors(cli):
    run = cli("generate", "--target", "zoo", "--method", "pld", "--dtype", "int4", "--prompt", "def f(x):",
              "--max-new-tokens", "8", "--json")
    assert run.rc == 0, run.err
    cli("generate", "--target", "zoo", "--dtype", "int3", "--prompt", "x").assert_user_error("int3")
    if not torch.cuda.is_available():
        cli("generate", "--target", "zoo", "--dtype", "int4", "--device", "cuda", "--prompt", "x").assert_user_error(
            "cuda")


def test_int4_needs_groups_of_32():
    with pytest.raises(RetrospecError, match="divisible by 32 and output features by 16"):
        WeightOnlyLinear.from_linear(torch.nn.Linear(48, 8), "int4")


W4A8_HERE = pytest.mark.skipif("w4a8" not in formats_here(), reason="this CPU has no AVX-512 VNNI")


@W4A8_HERE
def test_w4a8_computes_its_formula_exactly_where_floats_are_exact():
    """Weights (q - 8) * scale + zero and activations already on their int8 steps (each group's largest magnitude
    127, so the step is 1): integer products and power-of-two scales leave no rounding, so the kernel's sum must equal
    the exact one; and a group of zeros contributes nothing (its step is 0)."""
    from retrospec.weight_only import pack_w4a8

    gen = torch.Generator().manual_seed(0)
    out, inp = 32, 96
    q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.int32)
    scale = torch.full((out, inp // 32), 0.25).to(torch.bfloat16)
    zero = torch.randint(-4, 5, (out, inp // 32), generator=gen).float().to(torch.bfloat16)
    layer = WeightOnlyLinear("w4a8", inp, out, *pack_w4a8(q, scale, zero), None)
    x = torch.randint(-127, 128, (3, inp), generator=gen).float()
    x[:, ::32] = 127.0  # every group's largest magnitude: step 1
    x[2, 32:64] = 0.0  # one group of zeros
    w = (q.double() - 8) * 0.25 + zero.double().repeat_interleave(32, dim=1)
    assert torch.equal(layer(x).double(), x.double() @ w.t())
    assert torch.equal(layer.dequantized().double(), w)


@W4A8_HERE
def test_w4a8_keeps_int4_weights_and_its_own_layout_round_trips():
    from retrospec.weight_only import int4_groups, pack_w4a8, unpack_w4a8

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    q, scale, zero = int4_groups(w)
    back = unpack_w4a8(*pack_w4a8(q, scale, zero))
    assert torch.equal(back[0].int(), q) and torch.equal(back[1], scale) and torch.equal(back[2], zero)
    lin = torch.nn.Linear(64, 48, bias=False)
    lin.weight.data = w
    int4 = WeightOnlyLinear.from_linear(lin, "int4").dequantized()
    w4a8 = WeightOnlyLinear.from_linear(lin, "w4a8").dequantized()
    assert (int4 - w4a8).abs().max() <= 0.01 * w.abs().max()  # the same weights (int4's are read back in bfloat16)


def test_a_kernel_that_cannot_be_built_leaves_its_format_unavailable(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from retrospec import kernels

    monkeypatch.setenv("RETROSPEC_KERNELS_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setattr(kernels, "w4a8_cpu", lambda: True)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert kernels.w4a8() is None
    with pytest.raises(RetrospecError, match="AVX-512 VNNI and a C\\+\\+ compiler"):
        quantize_model_(tiny_llama(seed=0), "w4a8")


def test_a_built_kernel_loads_past_a_lock_left_by_a_killed_build(tmp_path):
    """A process killed while the builder held its lock file leaves the file behind: the next process loads the
    built library at once, without the builder (which would wait on that file forever)."""
    import os
    import shutil
    import subprocess
    import sys

    from retrospec import kernels

    library = kernels.w8a8()
    if library is None:
        pytest.skip("this torch build has no fbgemm kernels")
    built = Path(library).parent
    home = tmp_path / "kernels"
    shutil.copytree(built, home / built.name)
    (home / built.name / "lock").touch()  # what a build killed mid-way leaves
    code = "import torch; from retrospec import kernels; print(kernels.w8a8() is not None, torch.ops.retrospec.w8a8_mm)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RETROSPEC_KERNELS_HOME": str(home)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("True"), run.stderr[-500:]
    assert "compiling" not in run.stderr


def test_w8a8_weights_held_by_handle_compute_the_layer_and_are_freed_with_it():
    """``kernels.w8a8``: the matmul by handle is bitwise the layer's own fbgemm call; a copy of the layer holds its
    weights under a handle of its own; collecting the layer releases its weights (a stale handle is an error)."""
    import gc

    from retrospec import kernels
    from retrospec.weight_only import row_scales

    layer = WeightOnlyLinear.from_linear(torch.nn.Linear(64, 96, bias=False), "w8a8")
    if layer.packed() is None or kernels.w8a8() is None:
        pytest.skip("this torch build has no fbgemm kernels")
    x = torch.randn(5, 64)
    s = row_scales(x)
    handle = layer.handle()
    assert torch.equal(torch.ops.retrospec.w8a8_mm(x / s, layer.qweight, handle) * s, layer(x))
    twin = copy.deepcopy(layer)
    assert int(twin.handle()) != int(handle) and torch.equal(twin(x), layer(x))
    stale = handle.clone()
    del layer, handle
    gc.collect()
    with pytest.raises(RuntimeError, match="no weights are held"):
        torch.ops.retrospec.w8a8_mm(x / s, twin.qweight, stale)
