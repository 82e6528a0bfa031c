"""A LongSpec block's drafting call as one compiled program (``fastpath.compiled_block``).

On a tiny Llama target (``RETROSPEC_COMPILE=on``; one compile, cached for the run): the program's logits and the keys
it writes into the ring equal the block's own modules' within float tolerance, for a step's first token, a chain and
a tree level over a ring that has wrapped; ``longspec`` drafting through it (``fast_block`` keeps it when its timing
verdict says faster) stays token-identical to the naive oracle, greedy (the ring checked after every step) and seeded
at temperature 1 (the same tokens as drafting without it: its logits are the block's); the target's cache is read in
place from its buffers (``KVCache.last_buffers``). A failed compile leaves the block's modules with one warning;
``auto`` leaves small blocks alone.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_longspec import GREEDY, PROMPT, CheckedDrafter, randomized

from retrospec import kernels
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters.longspec import LongSpecDrafter, fast_block
from retrospec.fastpath import compiled, compiled_block
from retrospec.kv import KeyBuffer, KVCache
from retrospec.models.longspec import DraftState

SEEDED = SamplingConfig(temperature=1.0, seed=11)

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(kernels.attention() is None, reason="the attention kernel cannot be built here")]


@pytest.fixture(scope="module")
def world():
    target = tiny_llama(seed=3, hidden=64)
    return target, randomized(target, window=8, std=0.1)


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv("RETROSPEC_COMPILE", "on")
    monkeypatch.setenv("RETROSPEC_FASTPATH", "plain")  # the block's own linears: the program's "linear" kind


def _states(block):
    """Two states over the same 13 committed tokens (the ring of 8 has wrapped) and the target's cache of those 13
    as its buffers (room to spare), as drafting sees it: every cached position visible to every drafted token."""
    committed = PROMPT + [1]
    kv = KeyBuffer(*(torch.randn(1, block.num_kv_heads, len(committed) + 5, block.head_dim) for _ in "kv"),
                   len(committed))
    plain, fast = DraftState(block), DraftState(block)
    for s in (plain, fast):
        s.append(committed)
    return plain, fast, kv


def test_the_program_computes_what_the_block_computes(world, compiling, monkeypatch):
    _, block = world
    program, why = compiled_block.program_for(block)
    assert program is not None, why
    calls = []
    monkeypatch.setattr(program, "run", lambda args, run=program.run: calls.append(1) or run(args))
    plain, fast, kv = _states(block)
    try:
        with torch.inference_mode():
            for ids, parents in (([4], [-1]), ([7, 2, 9], [0, 0, 1]), ([3, 3], [1, 3])):  # first, a level, deeper
                block.program = None
                want = plain.speculate(ids, parents, kv)
                block.program = program
                got = fast.speculate(ids, parents, kv)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(fast.keys, plain.keys, rtol=1e-5, atol=1e-5)  # ring and tentative keys
                torch.testing.assert_close(fast.values, plain.values, rtol=1e-5, atol=1e-5)
    finally:
        block.program = None
    assert len(calls) == 3  # every call above went through the program
    program.max_rows = 2  # a level wider than the program takes runs the block's modules, the same logits
    with torch.inference_mode():
        block.program = program
        try:
            got = fast.speculate([6, 1, 8], [-1, -1, -1], kv)
        finally:
            block.program = None
        want = plain.speculate([6, 1, 8], [-1, -1, -1], kv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == 3


def test_drafting_through_the_program_is_lossless(world, compiling, monkeypatch, tmp_path):
    target, block = world
    monkeypatch.setattr(compiled_block, "_timed", lambda *a: {"eager_ms": 2.0, "compiled_ms": 1.0, "max_rows": 2})
    monkeypatch.setattr(compiled, "cache_home", lambda: tmp_path)  # ...and not cached for other tests
    drafter = CheckedDrafter(block, tree=(3, 4, 4), lookup=0)
    assert drafter.fast is not block and drafter.fast.program is not None and block.program is None
    assert drafter.fast.program_info["compiled"] and drafter.fast.program.max_rows == 2  # the (doubled) verdict's
    # levels wider than 2 (the tree's 4-wide ones) run the block's modules, narrower ones the program
    through_program = LongSpecDrafter(block, tree=(3, 4, 4), lookup=0)  # the same copy, its program kept
    calls, call = [], compiled_block.BlockProgram.__call__
    monkeypatch.setattr(compiled_block.BlockProgram, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    monkeypatch.setenv("RETROSPEC_COMPILE", "off")  # the target's layers are not compiled for this test
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=30)
    assert [t for c in speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=30)
            for t in c] == want
    assert calls  # the drafting calls ran the program

    def sampled(drafter):
        return [t for c in speculative_generate(target, drafter, PROMPT, sampling=SEEDED, max_new_tokens=30)
                for t in c]

    through = sampled(through_program)
    without = LongSpecDrafter(block, tree=(3, 4, 4), lookup=0)
    assert getattr(without.fast, "program", None) is None
    assert sampled(without) == through


def test_the_target_cache_is_read_in_place(world):
    target, _ = world
    kv = KVCache(target)
    assert kv.last_buffers() is None
    with torch.inference_mode():
        target(torch.tensor([PROMPT]), past_key_values=kv.cache, use_cache=True)
    buffers, (k, v) = kv.last_buffers(), kv.last_layer()
    assert buffers.filled == len(PROMPT) == k.shape[2] and buffers.k.shape[2] >= len(PROMPT)
    assert torch.equal(buffers.k[:, :, :len(PROMPT)], k) and buffers.k.data_ptr() == k.data_ptr()


def test_a_failed_compile_leaves_the_block_its_modules(world, compiling, no_compiler):
    block = randomized(world[0], window=8, seed=5)  # a block of its own: drafting copies are kept per block
    with pytest.warns(RuntimeWarning, match="draft block was not compiled"):
        fast = fast_block(block)
    assert fast.program is None and "compile failed" in fast.program_info["why"]
    assert not list(no_compiler.rglob("*.pt2"))


def test_auto_leaves_small_blocks_alone(world, monkeypatch):
    _, block = world
    monkeypatch.setenv("RETROSPEC_COMPILE", "auto")
    assert not compiled_block.wanted(block)  # hidden size 64
    program, info = compiled_block.build(block)
    assert program is None and "hidden size" in info["why"]
