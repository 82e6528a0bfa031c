"""End-to-end statistical losslessness of speculative sampling through ``speculative_generate``.

A tiny model with a 12-token vocabulary and a fixed prompt: the exact target distribution of the first generated
tokens is computed by enumeration (x1, then p(x2 | prompt, x1), then p(x3 | prompt, x1, x2)), with the same
processing (temperature, top-p) the engine applies. Each run asks for ``max_new_tokens=4`` and stops reading once x1..x3 are
known: x1 comes from the prefill, and the first verification step drafts 2 tokens (the draft budget is
max_new_tokens - 2), so x2 and x3 are accepted draft tokens, recovered tokens or bonus tokens. (With
max_new_tokens=2 the budget would be 0 and nothing would ever be drafted.) The histogram of (x1, x2) is chi-squared against the exact joint, and x3 against
p(x3 | x1, x2) within each (x1, x2) group: together, a test of the joint law of (x1, x2, x3).

Run count: N_RUNS = 5,000 per case, 4 cases = 20,000 runs in this file (sd with a random draft and a fixed-chain
deterministic drafter, each at temperature 1 and with top-p 0.8). Every run has its own seed, fixed, so the
outcome is deterministic; ALPHA only bounds how far from the target a histogram may be.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from retrospec.config import SamplingConfig
from retrospec.decode import speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.drafters.base import DecodeContext
from retrospec.sampling import probs_from_logits
from retrospec.types import DraftTree, SpecStats

V = 12
PROMPT = [3, 7, 1, 9]
N_RUNS = 5_000
MAX_NEW = 4
ALPHA = 1e-3

T1 = SamplingConfig(temperature=1.0)
TOP_P = SamplingConfig(temperature=1.0, top_p=0.8)



def tiny(seed: int, scale: float):
    from conftest import sharpen, tiny_llama

    return sharpen(tiny_llama(seed=seed, layers=1, hidden=16, vocab=V), scale)


@pytest.fixture(scope="module")
def models():
    target = tiny(seed=11, scale=8.0)  # sharpened so p is far from uniform
    draft = tiny(seed=12, scale=8.0)  # an unrelated model: q differs from p (total variation ~0.4 at x1)
    return target, draft


@torch.inference_mode()
def exact_law(model, cfg: SamplingConfig):
    """p1 [V] = p(x1), p2 [V, V] = p(x2 | x1), p3 [V, V, V] = p(x3 | x1, x2), processed like the engine does."""
    base = torch.tensor(PROMPT)
    one = torch.stack([torch.cat([base, torch.tensor([a])]) for a in range(V)])  # [V, L + 1]
    two = torch.stack([torch.cat([base, torch.tensor([a, b])]) for a in range(V) for b in range(V)])  # [V^2, L + 2]
    p1 = probs_from_logits(model(input_ids=base[None]).logits[0, -1], cfg).double()
    p2 = probs_from_logits(model(input_ids=one).logits[:, -1], cfg).double()
    p3 = probs_from_logits(model(input_ids=two).logits[:, -1], cfg).double().reshape(V, V, V)
    return p1, p2, p3


def chisq_pvalue(groups, strict: bool = True) -> float:
    """Pearson chi-square over groups of (observed, expected) counts, each group with its own total. Expected < 5
    cells are pooled per group; expected-0 cells must be empty (asserted when ``strict``; otherwise such a cell is a
    certain rejection: p-value 0). df = sum over groups of (cells - 1)."""
    stat, df = 0.0, 0
    for obs, exp in groups:
        obs, exp = np.asarray(obs, float).ravel(), np.asarray(exp, float).ravel()
        impossible = exp <= 1e-9 * max(exp.sum(), 1.0)
        if obs[impossible].sum() > 0:
            assert not strict, "a token outside the target's support was generated"
            return 0.0
        big = (exp >= 5) & ~impossible
        o, e = list(obs[big]), list(exp[big])
        rest = ~big & ~impossible
        if exp[rest].sum() > 0:
            o.append(obs[rest].sum())
            e.append(exp[rest].sum())
        if len(e) >= 2:
            o, e = np.array(o), np.array(e)
            stat += float(((o - e) ** 2 / e).sum())
            df += len(e) - 1
    assert df > 0
    return float(sps.chi2.sf(stat, df))


def joint_groups(counts: np.ndarray, p1, p2):
    """(x1, x2) joint against p1[x1] * p2[x1, x2]."""
    n = counts.sum()
    return [(counts, (p1[:, None] * p2).numpy() * n)]


def third_groups(counts3: np.ndarray, p3):
    """x3 given (x1, x2), one group per observed (x1, x2)."""
    groups = []
    for a in range(V):
        for b in range(V):
            n = counts3[a, b].sum()
            if n:
                groups.append((counts3[a, b], p3[a, b].numpy() * n))
    return groups


def sample_runs(target, make_drafter, cfg: SamplingConfig, seeds, gating: bool = False
                ) -> tuple[np.ndarray, SpecStats]:
    """Histogram [V, V, V] of (x1, x2, x3) over one run per seed; the stats summed over all runs (``gating``: the
    gate picks each step's draft budget, see tests/test_gating.py)."""
    counts = np.zeros((V, V, V), dtype=np.int64)
    drafter = make_drafter()  # reused across runs: prefill() resets it
    total = SpecStats()
    for seed in seeds:
        sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        stats = SpecStats()
        steps = speculative_generate(target, drafter, PROMPT, sampling=sampling, max_new_tokens=MAX_NEW, stats=stats,
                                     gating=gating)
        out: list[int] = []
        for chunk in steps:  # stop as soon as x1..x3 are known: the rest of the run cannot change them
            out.extend(chunk)
            if len(out) >= 3:
                break
        steps.close()
        counts[out[0], out[1], out[2]] += 1
        total.target_calls += stats.target_calls
        total.drafted_tokens += stats.drafted_tokens
        total.accepted_tokens += stats.accepted_tokens
        total.new_tokens += stats.new_tokens
        for k, v in stats.draft_shapes.items():
            total.draft_shapes[k] = total.draft_shapes.get(k, 0) + v
    return counts, total


class FixedChainDrafter:
    """Deterministic test drafter: always proposes the same chain (no probabilities: one-hot q)."""

    name = "fixed-chain"
    needs: frozenset[str] = frozenset()

    def __init__(self, chain: list[int]):
        self.chain = chain

    def prefill(self, ctx: DecodeContext) -> None:
        pass

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        return DraftTree.chain(self.chain[: max(0, budget)])

    def observe(self, accepted: int, drafted: int) -> None:
        pass


CASES = {
    "sd-t1": ("sd", T1),
    "sd-top-p": ("sd", TOP_P),
    "chain-t1": ("chain", T1),
    "chain-top-p": ("chain", TOP_P),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_tokens_follow_target_law(models, case):
    target, draft = models
    method, cfg = CASES[case]
    p1, p2, p3 = exact_law(target, cfg)
    if method == "sd":
        make = lambda: REGISTRY["sd"](draft_model=draft, gamma=2, adaptive=False)  # noqa: E731
    else:
        # the most likely x2 and x3 (marginally): drafts that are often, but not always, accepted
        m2 = int((p1[:, None] * p2).sum(0).argmax())
        m3 = int((p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1)).argmax())
        make = lambda: FixedChainDrafter([m2, m3])  # noqa: E731
    offset = 1_000_000 * list(CASES).index(case)
    counts, stats = sample_runs(target, make, cfg, range(offset, offset + N_RUNS))

    # the draft really was exercised: two tokens drafted in the first step of every run, many of them accepted
    assert stats.drafted_tokens >= 2 * N_RUNS
    assert 0.03 * stats.drafted_tokens < stats.accepted_tokens < stats.drafted_tokens
    c12 = counts.sum(2)
    assert chisq_pvalue(joint_groups(c12, p1, p2)) > ALPHA
    assert chisq_pvalue(third_groups(counts, p3)) > ALPHA
    # power: the same histograms reject a law that differs from the target's
    if method == "sd":
        q1, q2, _ = exact_law(draft, cfg)
        assert chisq_pvalue(joint_groups(c12, q1, q2), strict=False) < 1e-6
    if cfg.top_p < 1.0:
        u1, u2, u3 = exact_law(target, T1)  # the unfiltered law puts mass on tokens that top-p removes
        assert ((p1[:, None] * p2) == 0).any()
        assert chisq_pvalue(joint_groups(c12, u1, u2) + third_groups(counts, u3), strict=False) < 1e-6


def test_seeded_runs_are_reproducible(models):
    target, draft = models

    def gen(seed, method):
        drafter = (REGISTRY["sd"](draft_model=draft, gamma=3) if method == "sd"
                   else FixedChainDrafter([1, 2, 3]) if method == "chain" else REGISTRY["pld"](gamma=3))
        sampling = SamplingConfig(temperature=1.0, top_p=0.9, seed=seed)
        return [t for c in speculative_generate(target, drafter, PROMPT, sampling=sampling, max_new_tokens=16)
                for t in c]

    for method in ("sd", "chain", "pld"):
        runs = {seed: gen(seed, method) for seed in range(8)}
        assert all(len(r) == 16 for r in runs.values())
        assert gen(3, method) == runs[3] and gen(5, method) == runs[5]  # same seed, same output
        assert len({tuple(r) for r in runs.values()}) >= 6  # different seeds, different outputs
