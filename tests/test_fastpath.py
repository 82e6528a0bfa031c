"""The engine's fast path (``fastpath``): each piece equals the plain computation, greedy decoding through it is
token-identical to the oracle, the caller's model is never changed, and the measured plan round-trips its cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import sharpen, tiny_llama
from retrospec.attention import hybrid_tree, hybrid_tree_triton
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.fastpath import engine as engine_mod
from retrospec.fastpath import engine_for
from retrospec.fastpath.linear import (HEAD_LAYOUTS, KernelLinear, PackedLinear, head_logits, kernel_available,
                                       kernel_matmul, kernel_prefetch, kernel_streamed, onednn_available,
                                       pack_weight)
from retrospec.fastpath.rows import rows_invariant
from retrospec.fastpath.plan import ATTENTION_AHEAD, PREFETCH_BYTES, ROWS, Plan, attention_prefetch, \
    attention_shape, load_or_measure, linear_layers
from retrospec.types import DraftTree
from retrospec.verify import Verifier

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")
HAS_KERNEL = kernel_available()
HOWS = ["packed", "plain", *(["kernel"] if HAS_KERNEL else [])]  # forced matmul paths (``RETROSPEC_FASTPATH``)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin, pack_weight(lin.weight), max_rows=8)
    with torch.inference_mode():
        for shape in [(1, 1, 48), (1, 5, 48), (8, 48), (1, 30, 48)]:  # the last is above max_rows: plain F.linear
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed.weight is lin.weight  # shared, never copied


@pytest.mark.skipif(not HAS_KERNEL, reason="no AVX-512 or AVX2, or no C++ compiler here: the f32 kernel is not built")
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_linear_equals_linear_and_each_row_is_alone(bias):
    """``kernels.f32`` on shapes off its blocking (inputs not a multiple of 16, outputs not of 8): within float
    tolerance of the float64 product, a row's bits the same whatever the number of rows (up to 64), and over 64 rows
    (a prompt) the plain matmul's result."""
    torch.manual_seed(0)
    for n, k in ((80, 48), (37, 50), (9, 16), (300, 23)):
        lin = torch.nn.Linear(k, n, bias=bias)
        fast = KernelLinear(lin)
        with torch.inference_mode():
            for rows in (1, 2, 3, 4, 5, 7, 9, 64, 65):
                x = torch.randn(rows, k)
                exact = (x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)).float()
                torch.testing.assert_close(fast(x), exact, rtol=1e-5, atol=1e-5)
            assert rows_invariant([fast]) and torch.equal(fast(x[None])[0], fast(x))
            assert fast(x[:0]).shape == (0, n)  # no rows: an empty result (it once crashed the process)
    assert fast.weight is lin.weight  # shared, never copied


@pytest.mark.skipif(not HAS_KERNEL, reason="no AVX-512 or AVX2, or no C++ compiler here: the f32 kernel is not built")
def test_the_kernels_loop_orders_and_prefetch_distances_give_the_same_bits():
    """Streamed (output after output) and register-blocked calls of 1..4 rows, and any prefetch distance at any row
    count: bitwise the same products, so the plan's choices among them change the speed only."""
    torch.manual_seed(0)
    before, ahead = kernel_streamed(0), kernel_prefetch(0)
    try:
        for n, k in ((80, 48), (37, 50), (300, 23), (64, 576)):
            w = torch.randn(n, k)
            for rows in (1, 2, 3, 4, 5, 9):
                x = torch.randn(rows, k)
                kernel_streamed(0), kernel_prefetch(0)
                blocked = kernel_matmul(x, w)
                for streamed, nbytes in ((4, 0), (0, 64), (4, 4096), (0, 1 << 15)):
                    kernel_streamed(streamed), kernel_prefetch(nbytes)
                    assert torch.equal(kernel_matmul(x, w), blocked), (n, k, rows, streamed, nbytes)
    finally:
        kernel_streamed(before), kernel_prefetch(ahead)


def test_the_attention_kernels_prefetch_distance_changes_no_bit():
    """Prefetching keys and values any distance ahead (or not at all), over caches and masks of several shapes,
    rows of one call and a tree's gaps: bitwise the same attention, so the plan's choice changes the speed only."""
    from retrospec import kernels

    if kernels.attention() is None:
        pytest.skip("no C++ compiler here: the attention kernel is not built")
    op, gen = torch.ops.retrospec.attention, torch.Generator().manual_seed(0)
    before = attention_prefetch(0)
    try:
        for length, d, heads, kv_heads, rows in ((1029, 64, 9, 3, 1), (777, 64, 8, 2, 5), (300, 48, 4, 4, 16),
                                                 (70, 72, 6, 3, 3)):
            qkv = torch.randn(rows, heads + 2 * kv_heads, d, generator=gen)
            k, v = (torch.randn(1, kv_heads, length + 40, d, generator=gen) for _ in "kv")
            bias = torch.zeros(rows, length)
            bias[:, 3::7] = float("-inf")  # keys a row does not see, as a tree's rows skip their siblings
            attention_prefetch(0)
            plain = op(qkv, k, v, bias, heads, 0.125)
            for keys in (1, 16, 64, 4096):
                attention_prefetch(keys)
                assert torch.equal(op(qkv, k, v, bias, heads, 0.125), plain), (length, d, rows, keys)
    finally:
        attention_prefetch(before)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_every_head_layout_equals_the_model_logits(target, layout):
    if layout == "packed" and not onednn_available():
        pytest.skip("PyTorch built without oneDNN")
    if layout == "kernel" and not HAS_KERNEL:
        pytest.skip("the f32 kernel is not built here")
    w = target.get_output_embeddings().weight
    ids = torch.tensor([[5, 17, 3, 42, 8, 61, 2]])
    with torch.inference_mode():
        ref = target(input_ids=ids).logits[0]  # [T, V]
        hidden = target.get_decoder()(input_ids=ids).last_hidden_state[0]  # [T, H]
        for rows in (slice(0, 1), slice(0, 2), slice(0, 7), slice(6, 7)):
            got = head_logits(hidden[rows], w, layout, pack_weight(w))
            torch.testing.assert_close(got, ref[rows], rtol=1e-5, atol=1e-5)


def _scores(model, how, prompt, trees):
    ver = Verifier(model, fastpath=how)
    out = [ver.prefill(prompt)]
    root = prompt[-1]
    for tree in trees:
        out.append(ver.score(root, tree))
        ver.commit([])
    return out


@pytest.mark.parametrize("how", HOWS)
def test_fast_verifier_equals_the_model_as_it_is(target, how):
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    trees = [DraftTree.empty(), DraftTree.chain([4, 5, 6, 7]),
             DraftTree(torch.tensor([4, 9, 5, 6, 2]), torch.tensor([-1, -1, 0, 0, 2]))]
    for got, ref in zip(_scores(target, how, prompt, trees), _scores(target, "off", prompt, trees)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert engine_for(target, how).mode == how
    if how == "kernel":  # every matmul row-invariant: a verification is bitwise one-token steps
        assert engine_for(target, how).row_exact


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("method", ["ar", "pld", "sd"])
def test_greedy_through_the_fast_path_equals_the_oracle(arch, method, how):
    target = sharpen(tiny_llama(seed=3, layers=2) if arch == "llama" else __import__("conftest").tiny_qwen2(seed=3))
    draft = tiny_llama(seed=4, layers=1) if arch == "llama" else __import__("conftest").tiny_qwen2(seed=4, layers=1)
    prompt = [5, 17, 3, 42, 8, 61, 2, 5, 17, 3]
    greedy = SamplingConfig()
    ref = autoregressive_generate(target, prompt, sampling=greedy, max_new_tokens=24)
    drafter = REGISTRY[method](target=target, draft_model=draft, **({} if method == "ar" else {"gamma": 4}))
    out = [t for chunk in speculative_generate(target, drafter, prompt, sampling=greedy, max_new_tokens=24,
                                               fastpath=how) for t in chunk]
    assert out == ref


def _snapshot(model):
    return (model.config._attn_implementation, [type(m) for m in model.modules()],
            [(n, p.data_ptr(), p._version) for n, p in model.named_parameters()])


def test_the_callers_model_is_unchanged(target):
    before = _snapshot(target)
    sd = REGISTRY["sd"](draft_model=target, gamma=3)
    list(speculative_generate(target, sd, [1, 2, 3, 4], sampling=SamplingConfig(), max_new_tokens=8))
    assert engine_for(target).module is not target  # the engine ran its own copy
    assert _snapshot(target) == before


def test_the_engine_follows_in_place_weight_updates(target):
    prompt = [3, 14, 15, 9, 26]
    first = Verifier(target).prefill(prompt)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2.0)  # e.g. tests that sharpen a model after first use
        for m in target.modules():
            if isinstance(m, torch.nn.Linear) and m is not target.get_output_embeddings():
                m.weight.mul_(1.0)
    again = Verifier(target).prefill(prompt)
    ref = Verifier(target, fastpath="off").prefill(prompt)
    torch.testing.assert_close(again, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(first, again)


def test_other_families_run_as_they_are():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    engine = engine_for(model, "packed")
    assert engine.mode == "off" and engine.module is model


def test_a_measured_plan_is_cached_per_machine_and_shapes(target, tmp_path, monkeypatch):
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    lins, head = linear_layers(target.get_decoder()), target.get_output_embeddings().weight
    plan = load_or_measure(lins, head)
    assert plan.source == "measured" and set(plan.head) == set(ROWS)
    assert set(plan.packed_rows) <= set(ROWS) and all(lay in HEAD_LAYOUTS for lay in plan.head.values())
    files = list((tmp_path / "fastpath").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == plan.key
    again = load_or_measure(lins, head)
    assert again.source == "cache" and again.packed_rows == plan.packed_rows and again.head == plan.head
    assert (again.streamed, again.prefetch) == (plan.streamed, plan.prefetch)
    if HAS_KERNEL:  # the prefetch distance is one of those timed, the fastest of them
        timed = {int(nbytes): ms for nbytes, ms in plan.ms["prefetch"].items()}
        assert set(timed) == set(PREFETCH_BYTES) and plan.prefetch == min(timed, key=timed.get)
    files[0].write_text("{not json")  # a corrupt cache entry is measured again, not trusted
    assert load_or_measure(lins, head).source == "measured"
    from retrospec import kernels

    shape = attention_shape(target.config)  # with the attention's shape: its prefetch timed too, its own entry
    timed = load_or_measure(lins, head, attention=shape, layers=2)
    assert timed.key != plan.key and len(list((tmp_path / "fastpath").glob("*.json"))) == 2
    if kernels.attention() is not None:
        ms = {int(keys): t for keys, t in timed.ms["attention_ahead"].items()}
        assert set(ms) == set(ATTENTION_AHEAD) and timed.attention_ahead == min(ms, key=ms.get)
    assert load_or_measure(lins, head, attention=shape, layers=2).attention_ahead == timed.attention_ahead


def test_auto_mode_uses_the_measured_plan(target, tmp_path, monkeypatch):
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    engine = engine_for(target, "auto")
    assert engine.mode == "auto" and isinstance(engine.plan, Plan)
    prompt = [3, 14, 15, 9, 26]
    torch.testing.assert_close(Verifier(target, fastpath="auto").prefill(prompt),
                               Verifier(target, fastpath="off").prefill(prompt), rtol=1e-4, atol=1e-4)


def test_a_misspelt_mode_is_a_user_error(monkeypatch):
    from retrospec.errors import RetrospecError

    monkeypatch.setenv("RETROSPEC_FASTPATH", "fastest")
    with pytest.raises(RetrospecError, match="RETROSPEC_FASTPATH"):
        engine_for(tiny_llama())



def test_padded_batches_use_the_sdpa_copy_and_the_decode_copy_refuses_them(target):
    from transformers import DynamicCache

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    copy = engine_for(target, "packed", attention="sdpa")
    assert copy.module is not target and copy.module.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        ref = target(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=DynamicCache()).logits
        got = copy.module(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=DynamicCache()).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one sequence"):
        engine_for(target, "packed").forward(ids, pos, None, DynamicCache())


def test_a_request_through_the_api_leaves_the_loaded_model_as_it_was(saved_models):
    from retrospec.api import generate
    from retrospec.models import load_model

    model = load_model(saved_models.target).model  # the cached model later requests share
    before = _snapshot(model)
    for method in ("ar", "pld", "sd"):
        generate("def dedent(text):\n    ", target=saved_models.target, draft=saved_models.draft, method=method,
                 max_new_tokens=8)
    assert _snapshot(model) == before and model.config._attn_implementation == "sdpa"


def _stand_in_kernel(calls):
    def kernel(q, k, v, mask, scaling):  # the Triton kernel's contract, computed by its PyTorch reference
        assert mask.dtype == torch.bool and mask.ndim == 3
        calls.append(tuple(q.shape))
        out, lse = hybrid_tree.tree_attention(q, k, v, mask, scaling)
        return out.to(q.dtype), lse
    return kernel


def test_on_cuda_with_triton_the_engine_verifies_through_hybrid_tree_attention(monkeypatch):
    """The CUDA branch, run here with its device check patched and the Triton kernel stood in for by its reference
    (the kernel itself: test_hybrid_tree_attention): the engine's private copy verifies through hybrid tree attention
    from the measured length on, the tree part goes to the kernel, logits equal the model's as it is, greedy decoding
    equals the oracle, and the caller's model is unchanged."""
    calls = []
    monkeypatch.setattr(engine_mod, "_on_cuda", lambda device: True)
    monkeypatch.setattr(hybrid_tree, "triton_ready", lambda device, dtype, *dims: True)
    monkeypatch.setattr(hybrid_tree, "use_triton", lambda query, value: True)
    monkeypatch.setattr(hybrid_tree_triton, "tree_attention_triton", _stand_in_kernel(calls))
    monkeypatch.setattr(engine_mod, "hybrid_min_length", lambda *shape: 12)
    target, draft = sharpen(tiny_llama(seed=3, layers=2)), tiny_llama(seed=4, layers=1)
    before = _snapshot(target)
    engine = engine_for(target)
    assert engine.mode == "hybrid-tree" and engine.module is not target
    assert engine.describe()["attention"] == hybrid_tree.ATTN_NAME and engine.describe()["hybrid_min_length"] == 12
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    trees = [DraftTree.empty(), DraftTree.chain([4, 5, 6, 7]),
             DraftTree(torch.tensor([4, 9, 5, 6, 2]), torch.tensor([-1, -1, 0, 0, 2]))]
    for got, ref in zip(_scores(target, None, prompt, trees), _scores(target, "off", prompt, trees)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert calls == [(1, 4, 5, 8)] * 2 + [(1, 4, 6, 8)] * 2  # chain, tree: each layer; prefill, 1 query: sdpa
    calls.clear()
    greedy = SamplingConfig()
    ref = autoregressive_generate(target, prompt[:4], sampling=greedy, max_new_tokens=24)
    sd = REGISTRY["sd"](target=target, draft_model=draft, gamma=4)
    out = [t for chunk in speculative_generate(target, sd, prompt[:4], sampling=greedy, max_new_tokens=24)
           for t in chunk]
    assert out == ref
    assert calls  # the tree part of sd's chains went to the kernel
    assert _snapshot(target) == before


@pytest.mark.parametrize("why", ["self-check", "never-faster", "timing-fails"])
def test_on_cuda_without_a_working_kernel_or_a_win_the_model_runs_as_it_is(monkeypatch, why):
    def timing(*shape):
        if why == "timing-fails":
            raise RuntimeError("CUDA out of memory")
        return None

    monkeypatch.setattr(engine_mod, "_on_cuda", lambda device: True)
    monkeypatch.setattr(hybrid_tree, "triton_ready", lambda device, dtype, *dims: why != "self-check")
    monkeypatch.setattr(engine_mod, "hybrid_min_length", timing)
    target = tiny_llama(seed=3, layers=1)
    if why == "timing-fails":
        with pytest.warns(RuntimeWarning, match="out of memory"):
            engine = engine_for(target)
    else:
        engine = engine_for(target)
    assert engine.mode == "off" and engine.module is target


def test_the_crossover_is_the_shortest_length_from_which_hybrid_always_wins(monkeypatch):
    def scripted(*ms):  # (sdpa, hybrid) per length in CROSSOVER_LENGTHS
        times = iter(ms)
        monkeypatch.setattr(engine_mod, "median_ms", lambda fn, device=None: next(times))
        return engine_mod.hybrid_min_length.__wrapped__(4, 2, 16, torch.float32, torch.device("cpu"))

    assert engine_mod.CROSSOVER_LENGTHS == (256, 1024, 4096, 16384)
    assert scripted(1, 2, 1, 2, 2, 1, 3, 1) == 4096
    assert scripted(2, 1, 1, 2, 2, 1, 3, 1) == 4096  # a win at 256 alone does not count
    assert scripted(2, 1, 2, 1, 2, 1, 3, 1) == 256
    assert scripted(2, 1, 2, 1, 2, 1, 1, 3) is None  # loses at the longest length
    monkeypatch.undo()
    measured = engine_mod.hybrid_min_length(4, 2, 16, torch.float32, torch.device("cpu"))  # really timed
    assert measured is None or measured in engine_mod.CROSSOVER_LENGTHS
