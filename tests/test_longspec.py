"""LongSpec: the one-block draft, its ring-buffer state, its checkpoint, and the
``longspec`` drafter through the engine, the API and the CLI. Tiny Llama and Qwen2 targets, fp32, no training:
blocks are random (weights scaled up so every branch matters) or identity-initialised.

- the block equals a naive reference written here with plain tensor ops (explicit masks, repeat_kv by hand);
- the ring buffer (``DraftState``) equals a full-sequence forward with a sliding-window mask, chains and trees;
- the state's memory is the same at 2K and 8K context; the cross-attention shift rule is honoured;
- greedy output equals the oracle (chain and tree; random block and one that gets accepted), and after every step
  the ring equals one rebuilt from the committed tokens;
- the tree is the best nodes of the beam by cumulative draft log-prob, best first (a bigram draft, enumerated);
- tree drafts at temperature 1 commit tokens distributed as the target's (chi-square, 20k draws of the rule on a
  real LongSpec tree, and seeded end-to-end runs);
- save / load round trip; a block for another target is refused with one line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import sharpen, tiny_llama, tiny_qwen2
from test_engine_sampling import chisq_pvalue

from retrospec.acceptance import RejectionSampling
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.drafters.base import DecodeContext
from retrospec.drafters.longspec import LongSpecDrafter, graft, parse_tree
from retrospec.errors import RetrospecError
from retrospec.models.longspec import DraftState, LongSpecDraft, grouped_attention, load_longspec, save_longspec
from retrospec.models.longspec.state import ROOM
from retrospec.sampling import probs_from_logits
from retrospec.tree import depths
from retrospec.types import DraftTree, SpecStats
from retrospec.verify import Verifier

torch.set_num_threads(1)

GREEDY = SamplingConfig(temperature=0.0)
T1 = SamplingConfig(temperature=1.0)
PROMPT = [5, 17, 3, 42, 8, 17, 3, 42, 8, 61, 5, 17]


def make_target(arch: str, **kw):
    return (tiny_llama if arch == "llama" else tiny_qwen2)(**kw)


def randomized(target, window: int, seed: int = 0, std: float = 0.3) -> LongSpecDraft:
    """A block whose every branch changes the output: weights N(0, std), biases and norm weights random."""
    block = LongSpecDraft.for_target(target, window=window)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return block


def random_kv(block: LongSpecDraft, length: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (1, block.num_kv_heads, length, block.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ----------------------------------------------------------------------------------------------------------------
# the naive reference


def reference_logits(block: LongSpecDraft, ids: list[int], tk: torch.Tensor, tv: torch.Tensor, shift: int,
                     window: int) -> torch.Tensor:
    """The block with plain tensor ops. ids [L] at positions 0..L-1; tk, tv [kvh, T, d] -> logits [L, V]."""
    cfg = block.config
    w = dict(block.named_parameters())
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, block.head_dim
    n = len(ids)
    eps = cfg.rms_norm_eps

    def rms(x, name):
        return w[name + ".weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def lin(x, name):
        out = x @ w[name + ".weight"].T
        return out + w[name + ".bias"] if name + ".bias" in w else out

    pos = torch.arange(n, dtype=torch.float32)
    inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None] * inv_freq[None]  # [L, d/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)  # [L, d]

    def rope(x):  # [h, L, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attend(q, k, v, mask):  # q [nh, L, d]; k, v [nkv, S, d]; mask [L, S]
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)  # repeat_kv by hand
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)  # no visible key: zero output
        return (p @ v).transpose(0, 1).reshape(n, nh * d)

    x = block.embed_tokens.weight[torch.tensor(ids)]  # [L, H]
    h = rms(x, "norm1")
    q = rope(lin(h, "self_attn.q_proj").view(n, nh, d).transpose(0, 1))
    k = rope(lin(h, "self_attn.k_proj").view(n, nkv, d).transpose(0, 1))
    v = lin(h, "self_attn.v_proj").view(n, nkv, d).transpose(0, 1)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    x = x + lin(attend(q, k, v, (j <= i) & (j > i - window)), "self_attn.o_proj")
    h = rms(x, "norm2")
    qc = rope(lin(h, "cross_attn.q_proj").view(n, nh, d).transpose(0, 1))
    s_idx = torch.arange(tk.shape[1])[None]
    x = x + lin(attend(qc, tk, tv, s_idx <= i - shift), "cross_attn.o_proj")
    h = rms(x, "norm3")
    x = x + lin(torch.nn.functional.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
    return x @ block.lm_head.weight.T


@pytest.mark.parametrize("shift", [1, 3])
def test_block_equals_naive_reference(arch, shift):
    target = make_target(arch)
    block = randomized(target, window=6)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    tk, tv = random_kv(block, 20)
    with torch.no_grad():
        got = block(torch.tensor([ids]), (tk, tv), shift=shift)[0]
        want = reference_logits(block, ids, tk[0], tv[0], shift, window=6)
        per_query = block(torch.tensor([ids]), (tk, tv), shift=torch.full((1, 20), shift))[0]  # tensor shift
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert torch.equal(got, per_query)
    assert set(block.state_dict()) == {k for k, _ in block.named_parameters()}  # no embedding / head inside
    assert not any(k.startswith(("embed", "lm_head")) for k in block.state_dict())


def test_rotary_table_and_gradients_where_nothing_is_visible(arch):
    """The block reads cos / sin from a table the family's rotary embedding filled (grown as positions grow, rebuilt
    for another dtype): the same values as calling it. A query that sees nothing (position 0, shift >= 1) gets a zero
    attention output and finite gradients in training."""
    block = randomized(make_target(arch), window=6)
    x = torch.zeros(1, 1, block.config.hidden_size)
    for positions in ([[0, 5, 3]], [[1500, 7, 2047]], [[9, 0, 4000]]):
        pos = torch.tensor(positions)
        for dtype in (torch.float32, torch.bfloat16):
            want = block.rotary(x.to(dtype), pos)
            got = block.rope(x.to(dtype), pos)
            assert all(g.dtype == dtype and torch.equal(g, w) for g, w in zip(got, want)), (positions, dtype)
    assert block._rope_table[0].shape[0] >= 4001
    # grouped attention: a row with nothing visible gets exact zeros and zero gradients; the others equal a plain
    # repeat_kv reference, keys given in pieces
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 3, 8, generator=g, requires_grad=True)
    ks, vs = ([torch.randn(1, 2, s, 8, generator=g) for s in (5, 3)] for _ in "kv")
    allowed = torch.rand(1, 3, 8, generator=g) > 0.4
    allowed[0, 1] = False
    allowed[0, 0, 0] = allowed[0, 2, 0] = True
    k, v = (torch.cat(p, 2).repeat_interleave(2, 1) for p in (ks, vs))  # [1, 4, 8, 8]
    want = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    want = (want.nan_to_num(0.0) @ v).transpose(1, 2).reshape(1, 3, 32)
    for stacked in (False, True):  # grouped heads read in place (the CPU's way), or stacked (other devices')
        q.grad = None
        out = grouped_attention(q, tuple(ks), tuple(vs), (allowed[..., :5], allowed[..., 5:]), 0.3, stacked)
        assert torch.equal(out[0, 1], torch.zeros(32)) and torch.allclose(out, want, atol=1e-6), stacked
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, :, 1], torch.zeros(4, 8))
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    tk, tv = (t.expand(2, -1, -1, -1) for t in random_kv(block, 10))
    block.train()
    logits = block(ids, (tk, tv), shift=torch.tensor([[1], [4]]))
    logits.logsumexp(-1).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def test_cross_attention_visibility_rule(arch):
    target = make_target(arch)
    block = randomized(target, window=8)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    tk, tv = random_kv(block, 16)
    t = 12
    with torch.no_grad():
        for shift in (1, 2, 4):
            base = block(ids, (tk, tv), shift=shift)[0, t]
            for s in range(t - shift + 1, 16):  # invisible positions: changing them changes nothing
                k2, v2 = tk.clone(), tv.clone()
                k2[:, :, s] += 5.0
                v2[:, :, s] -= 5.0
                assert torch.equal(block(ids, (k2, v2), shift=shift)[0, t], base), (shift, s)
            s = t - shift  # the last visible one
            k2, v2 = tk.clone(), tv.clone()
            v2[:, :, s] += 5.0
            assert not torch.allclose(block(ids, (k2, v2), shift=shift)[0, t], base, atol=1e-4)
        # position 0 with shift 1 sees nothing: finite output (zero attention, not NaN)
        assert torch.isfinite(block(ids, (tk, tv), shift=1)).all()


# ----------------------------------------------------------------------------------------------------------------
# ring buffer


def test_ring_buffer_equals_sliding_window_forward(arch):
    window, n = 7, 30
    target = make_target(arch)
    block = randomized(target, window=window)
    ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(4)).tolist()
    tk, tv = random_kv(block, n)
    with torch.no_grad():
        full = block(torch.tensor([ids]), (tk, tv))[0]  # [n, V]
        state = DraftState(block)
        for t in range(n):  # the root at position t over a ring of tokens[:t] (wrapped many times)
            got = state.speculate([ids[t]], [-1], (tk, tv))[0]
            assert torch.allclose(got, full[t], atol=1e-5, rtol=0), t
            state.rollback()
            state.append([ids[t]])
        for cut in (3, 7, 8, 19):  # one append of many tokens (more than the window) = one at a time
            fresh = DraftState(block)
            fresh.append(ids[:cut])
            fresh.append(ids[cut:])
            assert fresh.length == state.length == n
            assert torch.equal(fresh.slot_pos, state.slot_pos)
            assert torch.allclose(fresh.k, state.k, atol=1e-6) and torch.allclose(fresh.v, state.v, atol=1e-6)

        # a tree of tentative tokens over a committed prefix: every node = the forward of its root-to-node path
        t = 17
        state = DraftState(block)
        state.append(ids[:t])
        cache = (tk[:, :, :t], tv[:, :, :t])  # the target cache holds the committed tokens only
        root = state.speculate([ids[t]], [-1], cache)  # tentative 0
        lvl1 = state.speculate([11, 23, 5], [0, 0, 0], cache)  # tentative 1..3
        lvl2 = state.speculate([40, 41, 42, 9], [1, 1, 3, 6], cache)  # 4..7; the last is a child of 6 (same call)
        paths = {0: [ids[t]]}
        for idx, (tok, par) in enumerate(zip([11, 23, 5, 40, 41, 42, 9], [0, 0, 0, 1, 1, 3, 6]), start=1):
            paths[idx] = paths[par] + [tok]
        rows = [root[0], *lvl1, *lvl2]
        for idx, row in enumerate(rows):
            seq = ids[:t] + paths[idx]
            want = block(torch.tensor([seq]), cache)[0, -1]
            assert torch.allclose(row, want, atol=1e-5, rtol=0), idx
        state.rollback()
        assert state.tentative == 0 and state.length == t


def test_tentative_tokens_past_the_room_grow_the_buffers(monkeypatch):
    """Tentative keys live right after the ring in buffers that double when short: levels wider than the room give the
    logits a roomy state gives, bitwise, and the ring survives the move."""
    import retrospec.models.longspec.state as state_mod

    block = randomized(make_target("llama"), window=8)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    cache = random_kv(block, 20)
    got = {}
    for room in (2, 256):
        monkeypatch.setattr(state_mod, "ROOM", room)
        state = DraftState(block)
        state.append(ids)
        ring = state.k.clone()
        with torch.no_grad():
            rows = [state.speculate([5], [-1], cache)]
            rows.append(state.speculate(list(range(10, 15)), [0] * 5, cache))  # 1..5
            rows.append(state.speculate(list(range(30, 50)), [1 + i % 5 for i in range(20)], cache))  # 6..25
        assert state.tentative == 26 and torch.equal(state.k, ring) and state.t_k.shape[2] == 26
        got[room] = torch.cat(rows)
        state.rollback()
        assert state.tentative == 0 and torch.equal(state.k, ring)
    assert torch.equal(got[2], got[256])


def test_state_memory_is_flat_in_context_length():
    target = tiny_llama(max_pos=9000)
    block = LongSpecDraft.for_target(target, window=64)
    sizes = []
    for context in (2048, 8192):
        state = DraftState(block)
        state.append(torch.randint(0, 96, (context,), generator=torch.Generator().manual_seed(5)))
        before = state.nbytes()
        with torch.no_grad():
            logits = state.speculate([3], [-1], random_kv(block, context))
        assert logits.shape == (1, 96) and torch.isfinite(logits).all()
        state.rollback()
        assert state.nbytes() == before and state.length == context
        sizes.append(before)
    slots = 64 + ROOM  # the ring and the room for tentative tokens after it
    assert sizes[0] == sizes[1] == 2 * slots * block.num_kv_heads * block.head_dim * 4 + 64 * 8


# ----------------------------------------------------------------------------------------------------------------
# greedy through the engine


class CheckedDrafter(LongSpecDrafter):
    """After every step that calls the block, the ring must equal one rebuilt from the committed tokens (all but the
    root); a step left undrafted (budget 0), or one the lookup chain fills alone, leaves it behind untouched, caught
    up by the next step that calls the block (``chain_only`` counts those steps)."""

    chain_only = 0

    def propose(self, ctx, budget):
        before = self.state.length
        tree = super().propose(ctx, budget)
        if budget <= 0:
            assert len(tree) == 0 and self.state.length <= len(ctx.tokens) - 1
            return tree
        if self.lookup is not None and self.state.length == before < len(ctx.tokens) - 1:
            assert len(tree) == budget and tree.is_chain and self.state.tentative == 0  # the chain alone
            self.chain_only += 1
            return tree
        fresh = DraftState(self.block)
        fresh.append(ctx.tokens[:-1])
        assert self.state.length == len(ctx.tokens) - 1 and self.state.tentative == 0
        assert torch.equal(self.state.slot_pos, fresh.slot_pos)
        assert torch.allclose(self.state.k, fresh.k, atol=1e-6) and torch.allclose(self.state.v, fresh.v, atol=1e-6)
        return tree


def mimic_pair(arch: str):
    """A target close to a bigram model and an identity block (logits = lm_head(embed(token))): drafts are often
    accepted, sometimes partly, sometimes fully rejected."""
    target = sharpen(make_target(arch), 4.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)
    return target, LongSpecDraft.for_target(target, window=8, init="identity")


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 16, 16)}, {"tree": (2, 2, 2)},
                                  {"tree": (4, 16, 16), "lookup": 6}, {"gamma": 4, "lookup": 6}],
                         ids=["chain", "tree", "narrow-tree", "tree+lookup", "chain+lookup"])
@pytest.mark.parametrize("kind", ["random", "mimic"])
def test_greedy_equals_oracle(arch, mode, kind):
    if kind == "random":
        target = make_target(arch)
        block = randomized(target, window=8, std=0.1)
    else:
        target, block = mimic_pair(arch)
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    stats = SpecStats()
    drafter = CheckedDrafter(block, **mode)
    chunks = list(speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=40, stats=stats))
    assert [t for c in chunks for t in c] == want
    assert stats.new_tokens == stats.target_calls + stats.accepted_tokens
    if kind == "mimic":  # whole drafts accepted
        assert max(len(c) for c in chunks) >= 3
    else:  # full rejections (the ring still follows the committed tokens: CheckedDrafter)
        assert any(len(c) == 1 for c in chunks[:-1])


def test_undrafted_steps_leave_the_ring_behind_and_a_drafting_step_catches_it_up():
    """A gate that leaves runs of steps undrafted (budget 0 on nine steps of every ten: the ring falls 9 tokens
    behind, more than its window of 8): the ring is not touched on those steps and equals a rebuilt one after each
    drafting step (CheckedDrafter); greedy output still equals the oracle's."""

    class Gated(CheckedDrafter):
        steps = 0

        def propose(self, ctx, budget):
            self.steps += 1
            return super().propose(ctx, budget if self.steps % 10 == 0 else 0)

    target, block = mimic_pair("llama")
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    drafter = Gated(block, gamma=4)
    out = [t for c in speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=40) for t in c]
    assert out == want and drafter.steps >= 20


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 16, 16)}], ids=["chain", "tree"])
def test_steps_the_lookup_chain_fills_leave_the_ring_behind(mode):
    """Budgets a gate might give (0, small ones the lookup chain fills alone, large ones it does not): steps that
    do not call the block leave the ring untouched, and the next one that does catches it up (CheckedDrafter);
    greedy output still equals the oracle's."""

    class Budgets(CheckedDrafter):
        steps = 0

        def propose(self, ctx, budget):
            self.steps += 1
            return super().propose(ctx, min(budget, (2, 1, 0, 3, 12, 2, 2, 16)[self.steps % 8]))

    target, block = mimic_pair("llama")
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=48)
    drafter = Budgets(block, lookup=6, **mode)
    out = [t for c in speculative_generate(target, drafter, PROMPT, sampling=GREEDY, max_new_tokens=48) for t in c]
    assert out == want
    assert 0 < drafter.chain_only < drafter.steps - 2  # both kinds of step ran


def test_tree_shape_and_budget():
    target = make_target("llama")
    block = randomized(target, window=8, std=0.1)
    drafter = LongSpecDrafter(block, tree=(3, 5, 4))
    verifier = Verifier(target)
    verifier.prefill(PROMPT[:-1])
    ctx = DecodeContext(tokens=list(PROMPT), prompt_len=len(PROMPT), sampling=GREEDY)
    ctx.target.kv = verifier.kv
    drafter.prefill(ctx)
    tree = drafter.propose(ctx, 100)
    assert len(tree) == 12 and tree.draft_probs is None
    par = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(par))  # parents before children
    assert sorted(depths(tree.parents).tolist()) == [1] * 3 + [2] * 5 + [3] * 4  # the whole beam fits in 100 nodes
    pairs = list(zip(par, tree.tokens.tolist()))
    assert len(set(pairs)) == len(pairs)  # siblings are distinct tokens
    for b in range(13):  # a smaller budget drafts a prefix of a larger one
        cut = drafter.propose(ctx, b)
        assert cut.tokens.tolist() == tree.tokens.tolist()[:b] and cut.parents.tolist() == par[:b]
    capped = LongSpecDrafter(block, tree=(3, 5, 4), nodes=4)  # the knob ``nodes``: at most the tree's best 4
    capped.prefill(ctx)
    assert capped.propose(ctx, 100).tokens.tolist() == tree.tokens.tolist()[:4]
    chain = LongSpecDrafter(block, gamma=3)
    chain.prefill(ctx)
    assert chain.propose(ctx, 10).is_chain and len(chain.propose(ctx, 10)) == 3
    assert parse_tree("4,16") == (4, 16)
    for bad in ("", "4,0", "a,b"):
        with pytest.raises(RetrospecError):
            parse_tree(bad)


def beam_reference(root: torch.Tensor, table: torch.Tensor, levels, n: int, eos=()) -> list[tuple]:
    """The best ``n`` nodes of the beam, as token paths, enumerated here without the drafter (float64): depth 1 is
    the root's top ``levels[0]`` tokens; each later depth keeps the top ``levels[d]`` (node, token) pairs over every
    node of the depth before by cumulative log-prob; a bigram draft (``table[token]``: next-token logits); nothing
    follows an EOS token."""
    lp = table.double().log_softmax(-1)
    r = root.double().log_softmax(-1)
    level = sorted((((t,), float(r[t])) for t in range(len(r))), key=lambda x: -x[1])[: levels[0]]
    found = list(level)
    for width in levels[1:]:
        cands = [(path + (t,), score + float(lp[path[-1], t]))
                 for path, score in level if path[-1] not in eos for t in range(lp.shape[1])]
        level = sorted(cands, key=lambda x: -x[1])[:width]
        found += level
    return [path for path, _ in sorted(found, key=lambda x: -x[1])[:n]]


def paths_of(tree: DraftTree) -> list[tuple]:
    out: list[tuple] = []
    for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


@pytest.mark.parametrize("sharp, depth_of_5", [(0.5, (1, 2)), (3.0, (1, 6)), (12.0, (4, 6))],
                         ids=["flat", "mixed", "peaked"])
def test_tree_is_the_best_nodes_of_the_beam_best_first(sharp, depth_of_5):
    """With a bigram draft standing in for the block, the tree of budget n is the n nodes of highest cumulative draft
    log-prob among the beam's (``beam_reference``), best first, so a smaller budget drafts a prefix of a larger one;
    drafting stops at the first depth none of whose children could enter the best n (a peaked draft goes deep in few
    nodes, a flat one stays shallow); nothing is drafted below an EOS."""
    g = torch.Generator().manual_seed(int(sharp * 10))
    v = 12
    table = sharp * torch.randn(v, v, generator=g)  # [V, V] next-token logits by token
    root = sharp * torch.randn(v, generator=g)
    target = make_target("llama")
    drafter = LongSpecDrafter(LongSpecDraft.for_target(target, window=4), tree=(4, 6, 6, 6, 6, 6))
    calls = []

    def bigram(ids, parents, target_kv):
        calls.append(len(ids))
        return table[torch.as_tensor(ids)]  # [len(ids), V]

    drafter._speculate = bigram
    levels, eos = (4, 6, 6, 6, 6, 6), {3}
    full = drafter._tree(root, 34, None, eos, levels)
    assert set(paths_of(full)) == set(beam_reference(root, table, levels, 34, eos)) and len(full) == 34
    for n in (1, 2, 5, 9, 16):
        calls.clear()
        tree = drafter._tree(root, n, None, eos, levels)
        assert paths_of(tree) == beam_reference(root, table, levels, n, eos)  # the same nodes in the same order
        assert paths_of(tree) == paths_of(full)[:n]
        assert not any(t in eos for path in paths_of(tree) for t in path[:-1])  # nothing below an EOS
        deepest = max(len(path) for path in paths_of(tree))
        assert deepest - 1 <= len(calls) <= min(deepest, len(levels) - 1)  # at most one depth drafted in vain
        if n == 5:
            assert depth_of_5[0] <= deepest <= depth_of_5[1]


def test_graft_merges_a_chain_into_a_tree():
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 1]))  # 5 -> (7, 8), 6 -> 9
    chain = DraftTree.chain([5, 8, 3])
    merged = graft(chain, tree, 100)
    assert merged.tokens.tolist() == [5, 8, 3, 6, 7, 9] and merged.parents.tolist() == [-1, 0, 1, -1, 0, 3]
    pairs = list(zip(merged.parents.tolist(), merged.tokens.tolist()))
    assert len(set(pairs)) == len(pairs)  # siblings stay distinct
    for b in range(7):  # a smaller budget drafts a prefix of a larger one
        cut = graft(chain, tree, b)
        assert cut.tokens.tolist() == merged.tokens.tolist()[:b] and cut.parents.tolist() == merged.parents.tolist()[:b]
    assert graft(DraftTree.empty(), tree, 100).tokens.tolist() == tree.tokens.tolist()


# ----------------------------------------------------------------------------------------------------------------
# sampling: the committed tokens follow the target's distribution

V = 12
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_world():
    target = sharpen(tiny_llama(seed=11, layers=1, hidden=16, vocab=V), 8.0)
    block = LongSpecDraft.for_target(target, window=4, init="identity")  # drafts get accepted at depth 1 and 2
    with torch.inference_mode():
        base = torch.tensor(PROMPT[:4]) % V
        prompt = base.tolist()
        one = torch.stack([torch.cat([base, torch.tensor([a])]) for a in range(V)])
        two = torch.stack([torch.cat([base, torch.tensor([a, b])]) for a in range(V) for b in range(V)])
        p1 = probs_from_logits(target(input_ids=base[None]).logits[0, -1], T1).double()
        p2 = probs_from_logits(target(input_ids=one).logits[:, -1], T1).double()  # [V, V]
        p3 = probs_from_logits(target(input_ids=two).logits[:, -1], T1).double().reshape(V, V, V)
    return target, block, prompt, p1, p2, p3


def test_tree_rule_draws_match_target(small_world):
    """20k draws of the multi-draft rule on one real LongSpec tree (4, 6, 6): the first three committed tokens
    follow p(x1), p(x2 | x1), p(x3 | x1, x2) whenever the earlier ones were accepted draft tokens."""
    target, block, prompt, p1, p2, p3 = small_world
    drafter = LongSpecDrafter(block, tree=(4, 6, 6))
    verifier = Verifier(target)
    verifier.prefill(prompt[:-1])
    ctx = DecodeContext(tokens=list(prompt), prompt_len=len(prompt), sampling=T1)
    ctx.target.kv = verifier.kv
    drafter.prefill(ctx)
    tree = drafter.propose(ctx, 64)
    assert len(tree) == 16 and tree.draft_probs is None
    p = probs_from_logits(verifier.score(prompt[-1], tree), T1)  # [1 + N, V]
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(0)
    toks = tree.tokens.tolist()
    firsts, pairs, triples = np.zeros(V), np.zeros((V, V)), np.zeros((V, V, V))
    for _ in range(20_000):
        step = rule.accept(tree, p, gen)
        out = [toks[i] for i in step.accepted_nodes] + [step.next_token]
        firsts[out[0]] += 1
        if len(out) > 1:
            pairs[out[0], out[1]] += 1
        if len(out) > 2:
            triples[out[0], out[1], out[2]] += 1
    assert chisq_pvalue([(firsts, p1.numpy() * 20_000)]) > ALPHA
    assert chisq_pvalue([(pairs[a], p2[a].numpy() * pairs[a].sum()) for a in range(V) if pairs[a].sum()]) > ALPHA
    groups = [(triples[a, b], p3[a, b].numpy() * triples[a, b].sum())
              for a in range(V) for b in range(V) if triples[a, b].sum()]
    assert groups and chisq_pvalue(groups) > ALPHA
    assert pairs.sum() > 8_000 and triples.sum() > 2_000  # accepted paths reach depth 2 often
    # power: the same first-token histogram rejects the draft's own distribution at the root
    with torch.no_grad():
        q1 = DraftState(block)
        q1.append(prompt[:-1])
        q1 = q1.speculate([prompt[-1]], [-1], verifier.kv.layer_tensors()[-1])[0].softmax(-1).double()
    assert chisq_pvalue([(firsts, q1.numpy() * 20_000)]) < ALPHA


@pytest.mark.parametrize("lookup", [0, 3])
def test_tree_sampling_end_to_end(small_world, lookup):
    """Seeded runs through ``speculative_generate`` with tree drafts at temperature 1 (with and without the
    prompt-lookup branch grafted in): (x1, x2) ~ p1 * p2."""
    target, block, prompt, p1, p2, _ = small_world
    drafter = REGISTRY["longspec"](block=block, tree=(4, 6, 6), lookup=lookup)  # prefill() resets it
    runs = 2_000
    counts = first_pairs(target, drafter, prompt, runs)
    assert chisq_pvalue([(counts, (p1[:, None] * p2).numpy() * runs)]) > ALPHA


def first_pairs(target, drafter, prompt, runs: int) -> np.ndarray:
    """Histogram [V, V] of the first two committed tokens over seeded runs 0..runs-1 at temperature 1."""
    counts = np.zeros((V, V))
    for seed in range(runs):
        out: list[int] = []
        steps = speculative_generate(target, drafter, prompt, sampling=SamplingConfig(temperature=1.0, seed=seed),
                                     max_new_tokens=8)
        for chunk in steps:
            out.extend(chunk)
            if len(out) >= 2:
                break
        steps.close()
        counts[out[0], out[1]] += 1
    return counts


# ----------------------------------------------------------------------------------------------------------------
# checkpoint, API, CLI


def test_save_load_round_trip_and_mismatch(arch, tmp_path):
    target = make_target(arch)
    block = randomized(target, window=5)
    out = save_longspec(block, target, tmp_path / "blk", target_path="tiny-target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blk"]  # no temporary directory left behind
    assert sorted(p.name for p in out.iterdir()) == ["block.safetensors", "longspec.json"]
    meta = json.loads((out / "longspec.json").read_text())
    assert meta["block"]["window"] == 5 and meta["target"]["path"] == "tiny-target"
    assert meta["target"]["hidden_size"] == 32 and meta["target"]["vocab_size"] == 96
    assert {"config_hash", "weights_digest", "fingerprint"} <= set(meta["target"])
    loaded = load_longspec(out, target)
    assert loaded.window == 5 and loaded.uses(target)
    for (k, a), (k2, b) in zip(block.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    ids = torch.tensor([PROMPT])
    kv = random_kv(block, len(PROMPT))
    with torch.no_grad():
        assert torch.equal(block(ids, kv), loaded(ids, kv))

    with pytest.raises(RetrospecError) as err:  # another target: same shapes, other weights
        load_longspec(out, make_target(arch, seed=7))
    msg = str(err.value)
    assert "\n" not in msg and "another target" in msg and "tiny-target" in msg
    with pytest.raises(RetrospecError, match="hidden size"):
        load_longspec(out, make_target(arch, hidden=64))
    with pytest.raises(RetrospecError, match="already exists"):
        save_longspec(block, target, out)
    save_longspec(block, target, out, overwrite=True)
    with pytest.raises(RetrospecError, match="no longspec.json"):
        load_longspec(tmp_path, target)


def test_requests_share_a_block_while_its_files_stay_the_same(tmp_path):
    """A block directory is loaded once per target for requests (``shared_block``) and again once its files
    change; ``load_block`` (what training uses) always loads a private block."""
    from retrospec.drafters.longspec import load_block, shared_block

    target = make_target("llama")
    out = save_longspec(randomized(target, window=5), target, tmp_path / "blk")
    first = shared_block(str(out), target)
    assert shared_block(out, target) is first and load_block(out, target) is not first
    assert shared_block(out, make_target("llama")) is not first  # another target module: its own
    save_longspec(randomized(target, window=5, seed=3), target, out, overwrite=True)
    again = shared_block(out, target)
    assert again is not first and not torch.equal(again.norm1.weight, first.norm1.weight)
    assert shared_block(out, target) is again
    target.to(torch.bfloat16)  # the target cast in place: its cached block no longer fits it
    cast = shared_block(out, target)
    assert cast is not again and cast.norm1.weight.dtype == torch.bfloat16 and cast.uses(target)


def test_api_and_cli(saved_models, cli, tmp_path):
    import retrospec
    from retrospec.models import load_model

    tgt = load_model(str(saved_models.target))  # cached: the API and the CLI get this same object
    block = randomized(tgt.model, window=16, std=0.1)
    blk_dir = save_longspec(block, tgt, tmp_path / "blk")
    prompt = tgt.tokenizer("def wrap(text, width):", add_special_tokens=False)["input_ids"]
    want = autoregressive_generate(tgt.model, prompt, sampling=GREEDY, max_new_tokens=12)
    for kw in ({"tree": "3,3"}, {"gamma": 3}, {}):
        for draft in (blk_dir, str(blk_dir), block):
            res = retrospec.generate(prompt, target=str(saved_models.target), draft=draft, method="longspec",
                                     max_new_tokens=12, gating=False, **kw)
            assert res.token_ids == want, (kw, type(draft))
    assert res.stats.method == "longspec" and res.stats.target_calls > 0
    with pytest.raises(RetrospecError, match="needs a LongSpec draft block"):
        retrospec.generate(prompt, target=str(saved_models.target), method="longspec")
    with pytest.raises(RetrospecError, match="not both"):
        retrospec.generate(prompt, target=str(saved_models.target), method="longspec", draft=blk_dir, gamma=2,
                           tree="2,2")

    run = cli("generate", "--prompt", "def wrap(text, width):", "--target", saved_models.target, "--method",
              "longspec", "--draft", blk_dir, "--tree", "2,2,2", "--max-new-tokens", "12", "--json")
    assert run.rc == 0, run.err
    assert json.loads(run.out)["token_ids"] == want
    cli("generate", "--prompt", "x", "--target", saved_models.target, "--method",
        "longspec").assert_user_error("needs a LongSpec draft block")
    cli("generate", "--prompt", "x", "--target", saved_models.target, "--method", "longspec", "--draft", tmp_path,
        ).assert_user_error("no longspec.json")
    cli("generate", "--prompt", "x", "--target", saved_models.target, "--method", "sd", "--tree",
        "2,2").assert_user_error("--tree applies to method longspec")


# ----------------------------------------------------------------------------------------------------------------
# draft vocabulary (FR-Spec rows of the shared head): q = 0 outside it, still lossless


def test_draft_vocab_logits_are_head_rows(arch, tmp_path):
    target = make_target(arch)
    block = randomized(target, window=6)
    ids, kv = torch.tensor([PROMPT]), random_kv(block, len(PROMPT))
    with torch.no_grad():
        full = block(ids, kv)  # [1, L, V]
        sub = [5, 0, 17, 3, 40, 9]
        block.set_vocab(sub)
        part = block(ids, kv)  # [1, L, K]
        assert part.shape[-1] == len(sub) and block.draft_vocab_size == len(sub)
        assert torch.allclose(part, full[..., sub], atol=1e-5)
        assert block.token_ids(torch.tensor([1, 4])).tolist() == [0, 40]
    out = save_longspec(block, target, tmp_path / "blk")
    assert json.loads((out / "longspec.json").read_text())["block"]["draft_vocab"] == len(sub)
    loaded = load_longspec(out, target)
    assert loaded.vocab.tolist() == sub and torch.equal(loaded(ids, kv), block(ids, kv))
    (out / "draft_vocab.json").write_text("[1, 2]\n")
    with pytest.raises(RetrospecError, match="corrupt LongSpec block"):
        load_longspec(out, target)
    for bad in ([], [1, 1], [10_000]):
        with pytest.raises(RetrospecError, match="distinct target ids"):
            block.set_vocab(bad)


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 8, 8)}], ids=["chain", "tree"])
def test_draft_vocab_greedy_equals_oracle(arch, mode):
    target, block = mimic_pair(arch)
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    # half the vocabulary: the target's greedy token is sometimes outside it (never drafted, still committed)
    block.set_vocab(list(range(0, 96, 2)))
    drafted: list[int] = []

    class Recording(CheckedDrafter):
        def propose(self, ctx, budget):
            tree = super().propose(ctx, budget)
            drafted.extend(tree.tokens.tolist())
            return tree

    stats = SpecStats()
    chunks = list(speculative_generate(target, Recording(block, **mode), PROMPT, sampling=GREEDY,
                                       max_new_tokens=40, stats=stats))
    assert [t for c in chunks for t in c] == want
    assert drafted and all(t % 2 == 0 for t in drafted)  # q = 0 outside the draft vocabulary
    assert stats.accepted_tokens > 0


def test_draft_vocab_sampling_end_to_end(small_world):
    """Seeded tree runs with a draft vocabulary that misses some tokens: (x1, x2) still ~ p1 * p2."""
    target, block, prompt, p1, p2, _ = small_world
    sub = LongSpecDraft.for_target(target, window=4, init="identity")
    sub.load_state_dict(block.state_dict())
    sub.set_vocab([0, 2, 3, 5, 7, 8, 11])
    drafter = REGISTRY["longspec"](block=sub, tree=(3, 4))
    runs = 2_000
    counts = first_pairs(target, drafter, prompt, runs)
    assert chisq_pvalue([(counts, (p1[:, None] * p2).numpy() * runs)]) > ALPHA


def test_bundled_block_found_for_a_loaded_target(tmp_path):
    """The README's load-once pattern: ``generate(target=load_model("zoo"), method="longspec")`` takes zoo's bundled
    block as ``target="zoo"`` does (matched by directory); a copy of the same weights loaded from elsewhere, or the
    bare transformers model, finds it by identity (``models.paired_longspec``). An unrelated model finds none."""
    import shutil

    import retrospec
    from retrospec.models import ZOO_DIR, load_model, paired_longspec

    zoo = load_model("zoo")
    assert paired_longspec(zoo) == paired_longspec("zoo") == paired_longspec(ZOO_DIR / "target-long")
    prompt = zoo.tokenizer("def wrap(text, width):", add_special_tokens=False)["input_ids"]
    want = retrospec.generate(prompt, target="zoo", method="longspec", max_new_tokens=10, gating=False).token_ids
    assert retrospec.generate(prompt, target=zoo, method="longspec", max_new_tokens=10, gating=False).token_ids == want
    copy = load_model(shutil.copytree(ZOO_DIR / "target-long", tmp_path / "zoo-copy"))
    assert paired_longspec(copy) == paired_longspec(copy.model) == paired_longspec("zoo")
    assert retrospec.generate(prompt, target=copy.model, method="longspec", max_new_tokens=10,
                              gating=False).token_ids == want
    assert paired_longspec(make_target("llama")) is None and paired_longspec(tmp_path) is None
