"""RAPID's acceptance rule on synthetic distributions (no model).

eta > 0 is lossy by design, so it is tested against the distribution it is documented to produce
(``rapid_token_distribution``), with >= 20k draws and a chi-square test that also has the power to tell that
distribution from the target's p. eta = 0 must be the exact rules (lossless).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from retrospec.acceptance import GreedyMatch, RejectionSampling
from retrospec.acceptance_rapid import (TAIL, RetrievalAugmentedRule, augmented_target, make_rapid_rule,
                                        recovery_distribution)
from retrospec.config import SamplingConfig
from retrospec.errors import RetrospecError
from retrospec.types import DraftTree

V = 8
N_DRAWS = 20_000
ALPHA = 1e-3


def rapid_token_distribution(p: torch.Tensor, q: torch.Tensor, eta: float, tail: float = TAIL) -> torch.Tensor:
    """The analytic distribution of the token one RAPID step commits at a position where x ~ q was drafted."""
    p_hat = augmented_target(p, q, eta, tail)
    accepted = torch.minimum(q, p_hat)  # P(draft y and accept it)
    return accepted + (1.0 - accepted.sum()) * recovery_distribution(p, p_hat, q)


def _world(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.8)).sample((2,))  # rows: position 0, position 1
    q = torch.distributions.Dirichlet(torch.full((V,), 0.4)).sample()
    return p.float(), q.float(), g


def _pvalue(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was produced"
    return float(sps.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum()).pvalue)


def test_augmented_target_eta_zero_is_p_and_tail_keeps_p():
    torch.manual_seed(0)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample((3,))
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((3,))
    assert torch.allclose(augmented_target(p, q, 0.0), p, atol=1e-6)
    eta = 4.0
    raw = (p.log() + eta * (q - p)).softmax(-1)
    tail = raw < 0.1 * raw.amax(-1, keepdim=True)
    expect = torch.where(tail, p, raw)
    expect = expect / expect.sum(-1, keepdim=True)
    got = augmented_target(p, q, eta)
    assert torch.allclose(got, expect, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(3))
    assert tail.any(), "the example must exercise tail preservation"
    # top-k / top-p filtered tokens (p = 0) stay at 0
    p0 = p.clone()
    p0[:, 0] = 0
    p0 = p0 / p0.sum(-1, keepdim=True)
    assert (augmented_target(p0, q, eta)[:, 0] == 0).all()


def test_make_rapid_rule_eta_zero_is_exact_and_flagged():
    assert isinstance(make_rapid_rule(0.0, SamplingConfig()), GreedyMatch)
    assert isinstance(make_rapid_rule(0.0, SamplingConfig(temperature=1.0)), RejectionSampling)
    lossy = make_rapid_rule(0.5, SamplingConfig(temperature=1.0))
    assert isinstance(lossy, RetrievalAugmentedRule) and lossy.lossless is False and "LOSSY" in lossy.name
    with pytest.raises(RetrospecError):
        make_rapid_rule(-1.0, SamplingConfig())


def test_eta_positive_matches_its_analytic_distribution_and_not_p():
    """First committed token of a one-token draft: empirical histogram == rapid_token_distribution(p, q, eta)."""
    p, q, g = _world(1)
    eta = 3.0
    rule = RetrievalAugmentedRule(eta)
    analytic = rapid_token_distribution(p[0], q, eta)
    assert abs(float(analytic.sum()) - 1) < 1e-5
    tv_to_p = 0.5 * float((analytic - p[0]).abs().sum())
    assert tv_to_p > 0.05, "the example must make the rule visibly lossy"
    drafts = torch.multinomial(q, N_DRAWS, replacement=True, generator=g).tolist()
    exact = make_rapid_rule(0.0, SamplingConfig(temperature=1.0))  # eta = 0 on the same drafts: must give p
    first = np.zeros(V, dtype=np.int64)
    first_exact = np.zeros(V, dtype=np.int64)
    bonus_after_accept = np.zeros(V, dtype=np.int64)
    q_row = q[None]
    for x in drafts:
        tree = DraftTree.chain([x], q_row)
        step = rule.accept(tree, p, g)
        if step.accepted_nodes:
            first[x] += 1
            bonus_after_accept[step.next_token] += 1
        else:
            first[step.next_token] += 1
        step = exact.accept(tree, p, g)
        first_exact[x if step.accepted_nodes else step.next_token] += 1
    assert _pvalue(first, analytic) > ALPHA
    assert _pvalue(first, p[0]) < ALPHA  # power: the same histogram tells the rule's output from p
    assert _pvalue(bonus_after_accept, p[1]) > ALPHA  # the bonus token comes from p
    assert _pvalue(first_exact, p[0]) > ALPHA  # eta = 0: lossless
    assert _pvalue(first_exact, analytic) < ALPHA


def test_recovery_distribution_is_clipped_residual():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    p_hat = torch.tensor([0.3, 0.5, 0.2, 0.0])
    r = recovery_distribution(p, p_hat, q)
    expect = torch.tensor([0.4, 0.0, 0.0, 0.0])  # max(p - p_hat, p - q) clipped: [0.4, -0.2, 0, -0.1] -> [0.4, 0, 0, 0]
    assert torch.allclose(r, expect / expect.sum())
    assert torch.equal(recovery_distribution(p, p, p), p)  # no residual mass: fall back to p


def test_greedy_eta_positive_follows_argmax_of_p_hat():
    torch.manual_seed(3)
    n = 6
    logits = torch.randn(n + 1, V) * 2
    q = torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample((n,))
    eta = 5.0
    best = augmented_target(logits[:n].softmax(-1), q, eta).argmax(-1)
    rule = RetrievalAugmentedRule(eta, greedy=True)
    full = rule.accept(DraftTree.chain(best, q), logits, None)
    assert full.accepted_nodes == list(range(n)) and full.bonus and full.next_token == int(logits[n].argmax())
    wrong = best.clone()
    wrong[2] = (best[2] + 1) % V
    step = rule.accept(DraftTree.chain(wrong, q), logits, None)
    assert step.accepted_nodes == [0, 1] and step.next_token == int(best[2]) and not step.bonus


def test_rule_refuses_trees_and_missing_q():
    rule = RetrievalAugmentedRule(1.0)
    p = torch.full((3, V), 1.0 / V)
    with pytest.raises(RetrospecError):
        rule.accept(DraftTree.chain([1, 2]), p, None)
    tree = DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.full((2, V), 1.0 / V))
    with pytest.raises(RetrospecError):
        rule.accept(tree, p, None)
