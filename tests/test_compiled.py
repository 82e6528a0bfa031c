"""The decoder layers as ahead-of-time compiled programs (``fastpath.compiled``): same model, no per-op dispatch.

On a tiny Llama model in float32 and int4 (``RETROSPEC_COMPILE=on``; one compile per layer shape and format, cached
for the rest of the run): the engine's logits equal the lean loop's within float tolerance for a prefill, a step, a
chain and a draft tree over the engine's cache; in int4 a verification's rows (a chain's, a tree's, in one call)
are bitwise the one-token steps along their paths (row-exact: the attention kernel included), and greedy ``ar``,
``sd`` and ``pld`` through the compiled engine are token-identical to the naive oracle's ``generate()``. The
attention kernel equals a float64 reference, and a row's result depends only on the keys it sees. A failed compile
falls back to the lean loop with one warning; a second engine loads the cached programs; ``auto`` leaves small
models alone.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.fastpath import aot, compiled, engine_for
from retrospec.fastpath.engine import EngineModel
from retrospec.fastpath.linear import kernel_available
from retrospec.types import DraftTree
from retrospec.verify import Verifier
from retrospec import kernels, weight_only
from retrospec.kv.cache import KVCache
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


def _cache(model):
    return KVCache(model).cache  # the engine's cache: the compiled layers run over it


def _run(engine, ids, positions, mask, cache, **kw):
    with torch.inference_mode():
        return engine.forward(torch.tensor([ids]), torch.tensor([positions]), mask, cache, **kw)[0]


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_compiled_layers_compute_what_the_lean_loop_computes(models, fmt, monkeypatch):
    lean, fast = _engines(models[fmt], monkeypatch)
    assert fast.describe()["loop"] == "compiled" and lean.describe()["loop"] == "lean", fast.describe()
    assert fast.describe()["compiled"]["compiled"] is True
    n = len(PROMPT)
    caches = [_cache(models[fmt]), _cache(models[fmt])]
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
    verifier = Verifier(model)
    verifier.prefill(PROMPT)
    chain = verifier.score(17, DraftTree.chain([23, 8, 40, 3]))  # [5, V]
    cache = _cache(model)
    _run(engine, PROMPT, list(range(len(PROMPT))), None, cache, last_only=True)
    steps = torch.cat([_run(engine, [t], [len(PROMPT) + i], None, cache) for i, t in enumerate([17, 23, 8, 40, 3])])
    assert torch.equal(chain, steps)
    verifier.kv.cache.crop(-5)
    # a tree: root 17; nodes 0 (23) and 1 (9) under it, node 2 (8) under 0, node 3 (6) under 1
    scored = verifier.score(17, DraftTree(torch.tensor([23, 9, 8, 6]), torch.tensor([-1, -1, 0, 1])))  # [5, V]
    for rows, path in (([0, 1, 3], [17, 23, 8]), ([0, 2, 4], [17, 9, 6])):
        cache = _cache(model)
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
    assert engine_for(draft, how, draft=True).describe()["loop"] == "compiled"  # sd drafted through programs too


@pytest.mark.parametrize("pays", [True, False])
def test_a_draft_takes_the_kernel_and_programs_where_they_beat_prepacked_linears(pays, monkeypatch, tmp_path):
    """A draft's linears measured fastest prepacked (which the programs do not express) go through the f32 kernel,
    its layers compiled, where one-token steps measured that way are faster (the timing is a double here; the
    timer itself runs once below), and stay prepacked where not; sd stays token-identical to the oracle."""
    if not kernel_available():
        pytest.skip("the f32 kernel is not built here")
    from retrospec.fastpath import engine as engine_mod

    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    monkeypatch.setenv("RETROSPEC_FASTPATH", "auto")
    monkeypatch.setattr(engine_mod, "draft_choice", lambda weights, remeasure=False, quantized=False: "packed")
    monkeypatch.setattr(engine_mod, "_draft_paths_ms", lambda model, choice: (2.0, 1.0) if pays else (1.0, 2.0))
    monkeypatch.setattr(compiled, "cache_home", lambda: tmp_path)  # the double's verdict is not kept
    draft = tiny_llama(seed=6 if pays else 7, layers=1, hidden=64)
    described = EngineModel(draft, "auto", draft=True).describe()
    assert described["loop"] == ("compiled" if pays else "lean")
    assert described["plan"].startswith("draft:kernel" if pays else "draft:packed")
    model = _model("float32")
    greedy = SamplingConfig(temperature=0.0)
    monkeypatch.setenv("RETROSPEC_FASTPATH", "plain")  # the target as in the other tests
    oracle = autoregressive_generate(model, PROMPT, sampling=greedy, max_new_tokens=24)
    out = speculative_generate(model, REGISTRY["sd"](draft_model=draft, gamma=3, adaptive=False), PROMPT,
                               sampling=greedy, max_new_tokens=24)
    assert [t for chunk in out for t in chunk] == oracle


def test_the_draft_path_timer_runs_both_engines(monkeypatch):
    if not kernel_available():
        pytest.skip("the f32 kernel is not built here")
    from retrospec.fastpath import engine as engine_mod

    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    eager_ms, compiled_ms = engine_mod._draft_paths_ms(tiny_llama(seed=6, layers=1, hidden=64), "packed", reps=2)
    assert 0 < eager_ms < float("inf") and 0 < compiled_ms < float("inf")  # both built: the programs were kept


def test_a_timing_verdict_is_taken_again_when_a_kernel_changes(monkeypatch):
    """``compiled.timed_verdict`` keeps a measurement with the kernels' sources digest: read back while they are the
    same, measured again (and saved) once they are not."""
    calls = []

    def timer():
        calls.append(1)
        return 2.0, 1.0

    name = "verdict-test-" + str(id(calls))
    assert compiled.timed_verdict(name, timer)["compiled_ms"] == 1.0 and len(calls) == 1
    assert compiled.timed_verdict(name, timer)["kernels"] == kernels.sources_digest() and len(calls) == 1
    monkeypatch.setattr(kernels, "sources_digest", lambda: "another kernel")
    assert compiled.timed_verdict(name, timer)["kernels"] == "another kernel" and len(calls) == 2


@pytest.mark.parametrize("fmt", ["w8a8", "w4a8"])
def test_integer_format_layers_around_their_kernels_stay_row_exact_and_lossless(models, fmt, monkeypatch):
    """w8a8: the layer programs calling fbgemm's matmul by handle (``torch.ops.retrospec.w8a8_mm``); w4a8: with
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
    n, caches = len(PROMPT), [_cache(model), _cache(model)]
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
        cache = _cache(model)
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


def test_a_failed_compile_falls_back_to_the_lean_loop(monkeypatch, no_compiler):
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    with pytest.warns(RuntimeWarning, match="not compiled"):
        engine = EngineModel(_model("int4"), "plain")
    assert engine.describe()["loop"] == "lean" and "compile failed" in engine.describe()["compiled"]["why"]
    assert not list(no_compiler.rglob("*.pt2"))  # no half-written package left behind


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


def _reference(qkv, kbuf, vbuf, bias, heads):  # float64 attention, as the kernel's header defines it (scaling 0.3)
    kv_heads = kbuf.shape[1]
    q = qkv[:, :heads].permute(1, 0, 2).double()  # [h, T, d]
    k, v = (b[0, :, : bias.shape[1]].repeat_interleave(heads // kv_heads, 0).double() for b in (kbuf, vbuf))
    probs = (q @ k.transpose(1, 2) * 0.3 + bias.double()).softmax(-1)
    return (probs @ v).permute(1, 0, 2).reshape(qkv.shape[0], -1)


def test_the_attention_kernel_is_attention_and_a_row_sees_only_its_keys():
    """``kernels.attention``: softmax(q k^T * scaling + bias) v per row and head (grouped heads share a key/value head)
    within float error of a float64 reference; a chain's row i is bitwise the one-row call over its keys, and a tree
    row (visible keys not a prefix) bitwise the one-row call over exactly its keys gathered in order."""
    if kernels.attention() is None:
        pytest.skip("no C++ compiler here")
    attention = torch.ops.retrospec.attention
    gen = torch.Generator().manual_seed(0)
    # d = 24: not a multiple of the kernel's 16 lanes; 300 positions: several key blocks, and rows reading them at once;
    # groups of 3, 4 and 2 query heads per key / value head (the kernel scores up to 3 heads of a row together); 20
    # rows: 60 units of a key / value head, walked in two passes
    for heads, kv_heads, d, cache, cases in ((6, 2, 24, 80, ((1, 1), (1, 37), (5, 50), (8, 73))),
                                             (6, 2, 64, 300, ((1, 300), (11, 290), (3, 129), (20, 250))),
                                             (8, 2, 64, 300, ((1, 300), (4, 131))), (4, 2, 64, 300, ((2, 200),))):
        kbuf, vbuf = (torch.randn(1, kv_heads, cache, d, generator=gen) for _ in "kv")
        for rows, length in cases:
            qkv = torch.randn(rows, heads + 2 * kv_heads, d, generator=gen)
            bias = compiled.chain_bias(rows, length)
            out = attention(qkv, kbuf, vbuf, bias, heads, 0.3)  # [rows, heads * d]
            torch.testing.assert_close(out.double(), _reference(qkv, kbuf, vbuf, bias, heads), rtol=1e-5, atol=1e-5)
            for i in range(rows):
                one = attention(qkv[i:i + 1], kbuf, vbuf, torch.zeros(1, length - rows + i + 1), heads, 0.3)
                assert torch.equal(one[0], out[i])
    visible = torch.zeros(4, 40, dtype=torch.bool)
    visible[:, :35] = True
    for row, extra in enumerate(([35], [36], [35, 37], [36, 38, 39])):
        visible[row, extra] = True
    qkv = torch.randn(4, heads + 2 * kv_heads, d, generator=gen)
    out = attention(qkv, kbuf, vbuf, torch.zeros(4, 40).masked_fill(~visible, float("-inf")), heads, 0.3)
    for row in range(4):
        seen = visible[row].nonzero()[:, 0]
        k, v = (b.index_select(2, seen).contiguous() for b in (kbuf, vbuf))
        assert torch.equal(attention(qkv[row:row + 1], k, v, torch.zeros(1, seen.numel()), heads, 0.3)[0], out[row])


def _core_alone(driver: str, width: str, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """Compile ``tests/<driver>`` (a kernel's core without PyTorch, its folder on the include path) for ``width`` at
    -O3 like the kernels, and run it; skipped without a C++ compiler or where this CPU does not run that width."""
    compiler = shutil.which("c++") or shutil.which("g++")
    order = list(kernels.VECTOR_FLAGS)  # widest first: a CPU runs its own width and every narrower one
    if compiler is None or order.index(width) < order.index(kernels.vector_width()):
        pytest.skip(f"no C++ compiler here, or this CPU does not run {width}")
    program = tmp_path / Path(driver).stem
    subprocess.run([compiler, "-O3", *flags, *kernels.VECTOR_FLAGS[width], f"-I{Path(kernels.__file__).parent}",
                    str(Path(__file__).resolve().parent / driver), "-o", str(program)], check=True, capture_output=True)
    return subprocess.run([str(program)], capture_output=True, text=True)


@pytest.mark.parametrize("width", ["avx512", "avx2", "portable"])
def test_the_attention_kernel_is_exact_at_every_vector_width(width, tmp_path):
    """The kernel's core built alone (no PyTorch: a few seconds) for each vector width this CPU runs (16 floats with
    AVX-512, 8 with AVX2, 4 with the portable build that SSE and NEON machines get): every query head of every row of
    a chain and of a tree (3 heads a row, walked together; head sizes 64, 24, 20 and 7: tails past the lanes; 1 to
    300 keys) is bitwise the one-row computation over the keys it sees, gathered in order, and within float error of
    a float64 softmax (``tests/attention_widths.cpp``)."""
    done = _core_alone("attention_widths.cpp", width, tmp_path, "-ffp-contract=off")
    lanes = {"avx512": 16, "avx2": 8, "portable": 4}[width]
    assert done.returncode == 0 and done.stdout.strip() == f"ok 504 units, {lanes} lanes", done.stdout


@pytest.mark.parametrize("width", ["avx512", "avx2"])
def test_the_f32_kernel_keeps_each_rows_bits_at_every_vector_width(width, tmp_path):
    """The f32 matmul kernel's core built alone for each width this CPU runs (16 floats with AVX-512, 8 with AVX2):
    a row's result is bitwise the same in calls of 1 to 16 rows, streamed or blocked, at any prefetch distance, and
    within float error of a float64 product (``tests/f32_widths.cpp``)."""
    done = _core_alone("f32_widths.cpp", width, tmp_path)
    lanes = {"avx512": 16, "avx2": 8}[width]
    assert done.returncode == 0 and done.stdout.strip() == f"ok 400 calls, {lanes} lanes", done.stdout
