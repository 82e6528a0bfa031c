"""The decoder layers as ahead-of-time compiled programs (``fastpath.compiled``): same model, no per-op dispatch.

On a tiny Llama model in float32 and int4 (``RETROSPEC_COMPILE=on``; one compile per layer shape, ~30 s each, cached
for the rest of the run): the engine's logits equal the lean loop's within float tolerance for a prefill, a step, a
chain and a draft tree; in int4 a verification's rows (a chain's, a tree's) are still bitwise one-token steps
(row-exact: the compiled attention included), and greedy
``ar``, ``sd`` and ``pld`` through the compiled engine are token-identical to the naive oracle's ``generate()``.
A failed compile falls back to the lean loop with one warning; a second engine loads the cached programs; ``auto``
leaves small models alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.fastpath import aot, compiled, engine_for
from retrospec.fastpath.engine import EngineModel
from retrospec.fastpath.linear import kernel_available
from retrospec.types import DraftTree
from retrospec.verify import Verifier
from retrospec import weight_only
from retrospec.weight_only import quantize_model_

from conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 9, 2, 7, 7, 1, 30, 4, 5, 9, 2, 11, 3, 5, 9, 2]


def _model(fmt: str):
    model = tiny_llama(seed=4, layers=2, hidden=64)
    return model if fmt == "float32" else quantize_model_(copy.deepcopy(model), fmt)


@pytest.fixture(scope="module")
def models():
    return {fmt: _model(fmt) for fmt in ("float32", "int4", "w8a8", "w4a8") if weight_only.available(fmt)
            or fmt == "float32"}


def _engines(model, monkeypatch) -> tuple[EngineModel, EngineModel]:
    monkeypatch.setenv("RETROSPEC_COMPILE", "off")
    lean = EngineModel(model, "plain")
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    fast = EngineModel(model, "plain")
    return lean, fast


def _run(engine, ids, positions, mask, cache, **kw):
    with torch.inference_mode():
        return engine.forward(torch.tensor([ids]), torch.tensor([positions]), mask, cache, **kw)[0]


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_compiled_layers_compute_what_the_lean_loop_computes(models, fmt, monkeypatch):
    lean, fast = _engines(models[fmt], monkeypatch)
    assert fast.describe()["loop"] == "compiled" and lean.describe()["loop"] == "lean", fast.describe()
    assert fast.describe()["compiled"]["compiled"] is True
    n = len(PROMPT)
    caches = [DynamicCache(), DynamicCache()]
    outs = [_run(e, PROMPT, list(range(n)), None, c) for e, c in zip((lean, fast), caches)]  # prefill
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    outs = [_run(e, [17], [n], None, c) for e, c in zip((lean, fast), caches)]  # a one-token step
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    outs = [_run(e, [23, 8, 40], [n + 1, n + 2, n + 3], None, c) for e, c in zip((lean, fast), caches)]  # a chain
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for c in caches:
        c.crop(-3)
    mask = torch.zeros(1, 1, 3, n + 4)  # a tree of two siblings and a grandchild
    mask[..., n + 1:] = torch.tensor([[0, -1e30, -1e30], [-1e30, 0, -1e30], [0, -1e30, 0]])
    outs = [_run(e, [23, 9, 8], [n + 1, n + 1, n + 2], mask, c) for e, c in zip((lean, fast), caches)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_int4_verification_stays_row_exact(models, monkeypatch):
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    model = models["int4"]
    engine = engine_for(model, "auto", remeasure=True)
    assert engine.row_exact and engine.describe()["loop"] == "compiled"
    fast = engine.lean.compiled
    if fast.attn is None:  # the speed verdict kept the engine's attention here: prove the program all the same
        assert "not faster" in engine.describe()["compiled"]["attention"]
        fast.attn = compiled.attention_program(engine.lean, float(engine.lean.layers[0].attn.scaling))
    verifier = Verifier(model)
    verifier.prefill(PROMPT)
    chain = verifier.score(17, DraftTree.chain([23, 8, 40, 3]))  # [5, V]
    cache = DynamicCache()
    _run(engine, PROMPT, list(range(len(PROMPT))), None, cache, last_only=True)
    steps = torch.cat([_run(engine, [t], [len(PROMPT) + i], None, cache) for i, t in enumerate([17, 23, 8, 40, 3])])
    assert torch.equal(chain, steps)
    verifier.kv.cache.crop(-5)
    # a tree: root 17; nodes 0 (23) and 1 (9) under it, node 2 (8) under 0, node 3 (6) under 1
    scored = verifier.score(17, DraftTree(torch.tensor([23, 9, 8, 6]), torch.tensor([-1, -1, 0, 1])))  # [5, V]
    for rows, path in (([0, 1, 3], [17, 23, 8]), ([0, 2, 4], [17, 9, 6])):
        cache = DynamicCache()
        _run(engine, PROMPT, list(range(len(PROMPT))), None, cache, last_only=True)
        steps = torch.cat([_run(engine, [t], [len(PROMPT) + i], None, cache) for i, t in enumerate(path)])
        assert torch.equal(scored[rows], steps)


@pytest.mark.parametrize("fmt,how", [("float32", "plain"), ("int4", "plain"), ("float32", "kernel")])
def test_greedy_methods_through_compiled_layers_match_the_oracle(models, fmt, how, monkeypatch):
    """float32 linears as plain matmuls or through ``kernels.f32`` (row-invariant: then verification is row-exact),
    int4 through its kernel: the programs express each."""
    if how == "kernel" and not kernel_available():
        pytest.skip("the f32 kernel is not built here")
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    monkeypatch.setenv("RETROSPEC_FASTPATH", how)
    model = models[fmt]
    assert engine_for(model).describe()["loop"] == "compiled"
    assert engine_for(model).row_exact or how == "plain"
    greedy = SamplingConfig(temperature=0.0)
    oracle = autoregressive_generate(model, PROMPT, sampling=greedy, max_new_tokens=32)
    draft = tiny_llama(seed=5, layers=1, hidden=64)
    for drafter in (REGISTRY["ar"](), REGISTRY["pld"](gamma=4), REGISTRY["sd"](draft_model=draft, gamma=3,
                                                                              adaptive=False)):
        out = [t for chunk in speculative_generate(model, drafter, PROMPT, sampling=greedy, max_new_tokens=32)
               for t in chunk]
        assert out == oracle, drafter


@pytest.mark.parametrize("fmt", ["w8a8", "w4a8"])
def test_integer_format_layers_around_their_kernels_stay_row_exact_and_lossless(models, fmt, monkeypatch):
    """w8a8: small programs per layer around fbgemm's matmuls (``fastpath.integer``); w4a8: the layer programs with
    the kernel's operator inside (``torch.ops.retrospec.w4a8_mm``). Within the format's
    tolerance of the lean loop (an activation may round to the neighbouring int8 value); a chain's and a tree's rows
    bitwise one-token steps; greedy ``pld`` and ``sd`` through the compiled engine token-identical to its ``ar``."""
    if fmt not in models:
        pytest.skip(f"this machine has no {fmt} kernel")
    model = models[fmt]
    lean, fast = _engines(model, monkeypatch)
    if fmt == "w8a8" and lean.lean.layers[0].qkv_modules[0].packed() is None:
        pytest.skip("this torch build has no fbgemm kernels")
    assert fast.describe()["loop"] == "compiled", fast.describe()
    n, caches = len(PROMPT), [DynamicCache(), DynamicCache()]
    for ids in (PROMPT, [17], [23, 8, 40]):
        pos = list(range(caches[0].get_seq_length(), caches[0].get_seq_length() + len(ids)))
        outs = [_run(e, ids, pos, None, c) for e, c in zip((lean, fast), caches)]
        assert (outs[1] - outs[0]).abs().max() <= 1e-2 * outs[0].abs().max()
    engine = engine_for(model, "auto", remeasure=True)
    assert engine.row_exact and engine.describe()["loop"] == "compiled"
    verifier = Verifier(model)
    verifier.prefill(PROMPT)
    chain = verifier.score(17, DraftTree.chain([23, 8, 40, 3]))  # [5, V]
    verifier.commit([])
    verifier.kv.crop(len(PROMPT))
    scored = verifier.score(17, DraftTree(torch.tensor([23, 9, 8, 6]), torch.tensor([-1, -1, 0, 1])))  # [5, V]
    for rows, path in (([0, 1, 2, 3, 4], [17, 23, 8, 40, 3]), ([0, 1, 3], [17, 23, 8]), ([0, 2, 4], [17, 9, 6])):
        cache = DynamicCache()
        _run(engine, PROMPT, list(range(n)), None, cache, last_only=True)
        steps = torch.cat([_run(engine, [t], [n + i], None, cache) for i, t in enumerate(path)])
        assert torch.equal((chain if len(rows) == 5 else scored)[rows], steps)
    greedy = SamplingConfig(temperature=0.0)
    draft = tiny_llama(seed=5, layers=1, hidden=64)

    def run(drafter):
        return [t for chunk in speculative_generate(model, drafter, PROMPT, sampling=greedy, max_new_tokens=32)
                for t in chunk]

    plain = run(REGISTRY["ar"]())
    assert run(REGISTRY["pld"](gamma=4)) == plain
    assert run(REGISTRY["sd"](draft_model=draft, gamma=3, adaptive=False)) == plain


def test_a_failed_compile_falls_back_to_the_lean_loop(monkeypatch, tmp_path):
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))  # nothing cached: the compile must run, and fails
    monkeypatch.setattr(aot, "_LOADED", {})

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    with pytest.warns(RuntimeWarning, match="not compiled"):
        engine = EngineModel(_model("int4"), "plain")
    assert engine.describe()["loop"] == "lean" and "compile failed" in engine.describe()["compiled"]["why"]
    assert not list(tmp_path.rglob("*.pt2"))  # no half-written package left behind


def test_cached_programs_load_without_compiling(models, monkeypatch):
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    EngineModel(models["int4"], "plain")  # compiled (or already cached) by the tests above
    monkeypatch.setattr(aot, "_LOADED", {})  # forget what this process loaded: read the packages again

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    assert EngineModel(models["int4"], "plain").describe()["loop"] == "compiled"


def test_auto_leaves_small_models_to_the_lean_loop(monkeypatch):
    monkeypatch.setenv("RETROSPEC_COMPILE", "auto")
    engine = EngineModel(_model("float32"), "plain")
    assert engine.describe()["loop"] == "lean" and "smaller than" in engine.describe()["compiled"]["why"]
    monkeypatch.setenv("RETROSPEC_COMPILE", "sometimes")
    with pytest.raises(Exception, match="RETROSPEC_COMPILE must be one of"):
        EngineModel(_model("float32"), "plain")
