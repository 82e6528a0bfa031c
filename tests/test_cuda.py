"""CUDA tests: skipped without a GPU; the GPU runbook's ``tests`` step (``tools.gpu``) runs them on the device
(``-k cuda``).

Each compares a CUDA result with the CPU's or with a reference path: greedy output of every lossless method equal to
the oracle, token for token, in float32; hybrid tree attention (PyTorch and Triton) equal to masked SDPA; a tiny
model's logits on CUDA equal to the CPU's.
"""

from __future__ import annotations

import pytest
import torch

from tools.gpu import common

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_logits_of_a_tiny_model_equal_the_cpu():
    model = common.tiny_causal_lm("qwen2", seed=1)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        cpu = model(ids).logits
        gpu = model.to("cuda")(ids.to("cuda")).logits.cpu()
    assert torch.allclose(cpu, gpu, atol=1e-4, rtol=1e-4)


@cuda
def test_cuda_greedy_identity_with_the_oracle(tmp_path):
    from retrospec.tasks import preset
    from tools.gpu import steps_bench
    from retrospec.models import load_model

    res = common.StepResult("tests", False, "cuda", {})
    stores = steps_bench.build_stores("zoo", tmp_path, 30_000)
    methods, _ = steps_bench.runnable(steps_bench.METHODS, stores)
    got = steps_bench.oracle_identity(res, load_model("zoo", device="cuda"),
                                      load_model("zoo-draft", role="draft", device="cuda"), preset("heldout", 2),
                                      methods, {"target": "zoo", "stores": stores}, 24)
    assert not res.errors, res.errors
    assert got and all(got.values()), got


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_hybrid_tree_attention_equals_masked_sdpa(dtype, tol):
    from retrospec.bench.hybrid_timing import measure, tree_parents

    row = measure("llama8b", 4096, tree_parents([4, 8]), torch.device("cuda"), dtype, 2, 1.0, chain=False)
    assert row["max_diff"] < tol


@cuda
def test_cuda_triton_hybrid_equals_masked_sdpa():
    from retrospec.attention import hybrid_tree_triton
    from retrospec.bench.hybrid_timing import tree_parents, triton_row

    if not hybrid_tree_triton.available():
        pytest.skip("triton is not installed")
    row = triton_row("smollm2", 2048, tree_parents([4, 8]), torch.device("cuda"), torch.float32, 2, 1.0)
    assert row["triton_max_diff"] < 5e-3  # Triton's float32 dot runs in tf32 by default


@cuda
def test_cuda_engine_verifies_through_the_triton_kernel_token_identically(monkeypatch):
    """The run path on CUDA: with the crossover forced to 0 every multi-token verification goes through hybrid tree
    attention and its Triton tree part; greedy ``sd`` equals the oracle."""
    from retrospec.attention import hybrid_tree, hybrid_tree_triton
    from retrospec.tasks import preset
    from retrospec.config import SamplingConfig
    from retrospec.decode import autoregressive_generate, speculative_generate
    from retrospec.drafters import REGISTRY
    from retrospec.fastpath import engine as engine_mod
    from retrospec.models import load_model

    if not hybrid_tree_triton.available():
        pytest.skip("triton is not installed")
    assert hybrid_tree.triton_ready(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(engine_mod, "hybrid_min_length", lambda *shape: 0)
    calls, real = [], hybrid_tree_triton.tree_attention_triton
    monkeypatch.setattr(hybrid_tree_triton, "tree_attention_triton", lambda *a: calls.append(1) or real(*a))
    target, draft = load_model("zoo", device="cuda"), load_model("zoo-draft", role="draft", device="cuda")
    # load_model caches the model and engine_for its engine: an earlier test's engine holds the measured crossover
    # (longer than this test's context), so rebuild it under the patched crossover
    engine = engine_mod.engine_for(target.model, remeasure=True)
    assert engine.mode == "hybrid-tree" and engine.hybrid_min_length == 0
    ids = target.tokenizer.encode(preset("heldout", 1)[0]["prompt"])
    greedy = SamplingConfig()
    ref = autoregressive_generate(target.model, ids, sampling=greedy, max_new_tokens=32)
    sd = REGISTRY["sd"](target=target.model, draft_model=draft.model, gamma=4)
    out = [t for chunk in speculative_generate(target.model, sd, ids, sampling=greedy, max_new_tokens=32)
           for t in chunk]
    assert out == ref and calls
