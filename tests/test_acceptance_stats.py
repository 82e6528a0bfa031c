"""Acceptance rules on synthetic distributions (no model).

The statistical tests live in a small Markov "world" over a vocabulary of V tokens: the target's next-token
distribution depends only on the previous token, p(. | ..., a) = P[a], and the draft's is q(. | ..., a) = Q[a]
(both random Dirichlet rows, Q != P). Rows of the ``p`` matrix handed to a rule are then per position: row 0 = P[root],
row i + 1 = P[token of node i]. A lossless rule must commit a first token distributed as P[root] and, whenever the
first committed token a was an accepted draft token, a second token distributed as P[a].

Every test uses fixed seeds, so the outcome is deterministic; the chi-square threshold ALPHA only decides how far
from the target a histogram may be. Each test also checks that the same histogram *rejects* the draft distribution
q, so the test is shown to have the power to tell p from q.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from retrospec.acceptance import GreedyMatch, RejectionSampling, _residual
from retrospec.config import SamplingConfig
from retrospec.sampling import probs_from_logits
from retrospec.tree import merge_sequences
from retrospec.types import DraftTree

V = 8
ROOT = 0
N_DRAWS = 20_000
ALPHA = 1e-3  # p-values below this fail the test (fixed seeds: the outcome does not change between runs)



# ----------------------------------------------------------------------------------------------------------------
# helpers


def dirichlet_rows(n: int, seed: int, zeros: int = 0) -> torch.Tensor:
    """[n, V] random distributions; ``zeros`` tokens per row get probability exactly 0."""
    g = torch.Generator().manual_seed(seed)
    rows = -torch.log(torch.rand(n, V, generator=g))  # Exp(1) draws: Dirichlet(1, ..., 1) after normalising
    if zeros:
        for i in range(n):
            rows[i, torch.randperm(V, generator=g)[:zeros]] = 0.0
    return (rows / rows.sum(-1, keepdim=True)).float()


def chisq_pvalue(groups: list[tuple[np.ndarray, np.ndarray]], strict: bool = True) -> float:
    """Pearson chi-square over independent groups of (observed counts, expected counts), each group with its own
    total. Cells with expected count < 5 are merged into one cell per group; cells with expected count 0 must be
    empty (asserted when ``strict``; otherwise such a cell is a certain rejection: p-value 0). Degrees of freedom =
    sum over groups of (cells - 1)."""
    stat, df = 0.0, 0
    for obs, exp in groups:
        obs = np.asarray(obs, dtype=float)
        exp = np.asarray(exp, dtype=float)
        assert obs.sum() == pytest.approx(exp.sum(), rel=1e-6)
        impossible = exp <= 1e-9 * max(exp.sum(), 1.0)
        if obs[impossible].sum() > 0:
            assert not strict, "a token with target probability 0 was committed"
            return 0.0
        big = (exp >= 5) & ~impossible
        o = list(obs[big])
        e = list(exp[big])
        rest_o, rest_e = obs[~big & ~impossible].sum(), exp[~big & ~impossible].sum()
        if rest_e > 0:
            o.append(rest_o)
            e.append(rest_e)
        if len(e) < 2:
            continue
        o, e = np.array(o), np.array(e)
        stat += float(((o - e) ** 2 / e).sum())
        df += len(e) - 1
    assert df > 0
    return float(sps.chi2.sf(stat, df))


def first_token_groups(firsts: list[int], target: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    obs = np.bincount(np.array(firsts), minlength=V)
    return [(obs, target.double().numpy() * len(firsts))]


def second_token_groups(pairs: list[tuple[int, int]], P: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """pairs (a, b): a = first committed (an accepted draft token), b = the second committed token; b ~ P[a]."""
    counts = np.zeros((V, V))
    for a, b in pairs:
        counts[a, b] += 1
    groups = []
    for a in range(V):
        n_a = counts[a].sum()
        if n_a > 0:
            groups.append((counts[a], P[a].double().numpy() * n_a))
    return groups


def committed(tree: DraftTree, step) -> list[int]:
    toks = tree.tokens.tolist()
    return [toks[i] for i in step.accepted_nodes] + [step.next_token]


def run_draws(make_step, n: int = N_DRAWS, depth: int = 1):
    """make_step(i) -> (tree, StepResult). Returns the first committed tokens, and for d = 1..depth the pairs
    (committed[d - 1], committed[d]) from steps whose first d committed tokens were all accepted draft tokens."""
    firsts, pairs = [], [[] for _ in range(depth)]
    for i in range(n):
        tree, step = make_step(i)
        toks = committed(tree, step)
        firsts.append(toks[0])
        for d in range(min(depth, len(step.accepted_nodes))):
            pairs[d].append((toks[d], toks[d + 1]))
    return firsts, pairs


@pytest.fixture(scope="module")
def world():
    P = dirichlet_rows(V, seed=1)  # target: p(. | previous token a) = P[a]
    Q = dirichlet_rows(V, seed=2)  # draft:  q(. | previous token a) = Q[a]
    return P, Q


# ----------------------------------------------------------------------------------------------------------------
# RejectionSampling: chains with draft probabilities


def sample_chains(Q: torch.Tensor, gamma: int, seed: int) -> torch.Tensor:
    """[N_DRAWS, gamma + 1]: the root, then x_1 ~ Q[root], x_{k+1} ~ Q[x_k]."""
    g = torch.Generator().manual_seed(seed)
    cols = [torch.full((N_DRAWS,), ROOT, dtype=torch.long)]
    for _ in range(gamma):
        cols.append(torch.multinomial(Q[cols[-1]], 1, generator=g)[:, 0])
    return torch.stack(cols, 1)


@pytest.mark.parametrize("gamma", [1, 3])
def test_rejection_chain_follows_p(world, gamma):
    """Chains drawn from q, with q given: the first committed token ~ p(. | root) and, for every depth d, the
    committed token after d accepted draft tokens ~ p(. | previous token)."""
    P, Q = world
    seqs = sample_chains(Q, gamma, seed=10 + gamma)  # [N, gamma + 1]
    p_rows, q_rows = P[seqs], Q[seqs[:, :-1]]  # [N, gamma + 1, V], [N, gamma, V]: q each token was drawn from
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(20 + gamma)

    def step(i):
        tree = DraftTree.chain(seqs[i, 1:], draft_probs=q_rows[i])
        res = rule.accept(tree, p_rows[i], gen)
        assert res.bonus == (len(res.accepted_nodes) == gamma)
        assert res.accepted_nodes == list(range(len(res.accepted_nodes)))
        return tree, res

    firsts, pairs = run_draws(step, depth=gamma)
    assert chisq_pvalue(first_token_groups(firsts, P[ROOT])) > ALPHA
    assert chisq_pvalue(first_token_groups(firsts, Q[ROOT]), strict=False) < 1e-6  # power: q is told apart from p
    for d in range(gamma):
        assert len(pairs[d]) > 1000
        assert chisq_pvalue(second_token_groups(pairs[d], P)) > ALPHA, f"depth {d + 2}"
    assert chisq_pvalue(second_token_groups(pairs[0], Q), strict=False) < 1e-6
    # the chance that the first draft token is accepted is sum_x min(p(x), q(x)) = 1 - TV(p, q)
    rate = len(pairs[0]) / N_DRAWS
    expect = float(torch.minimum(P[ROOT], Q[ROOT]).sum())
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / N_DRAWS) ** 0.5


# ----------------------------------------------------------------------------------------------------------------
# RejectionSampling: trees


def test_rejection_tree_distinct_one_hot_children(world):
    """A deterministic tree (draft_probs=None): distinct children below the root, some with children of their own."""
    P, _ = world
    # children of the root: 3, 5, 1, 6 (deterministic, distinct); 3 has children 2 and 7, 5 has child 3
    tree = merge_sequences([[3, 2], [5, 3], [3, 7], [1], [6, 0, 4]])
    assert not tree.is_chain and tree.draft_probs is None
    p = P[torch.cat([torch.tensor([ROOT]), tree.tokens])]  # [N + 1, V]
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(40)

    def step(i):
        res = rule.accept(tree, p, gen)
        path = res.accepted_nodes
        for a, b in zip([-1] + path[:-1], path):  # the path really is a root-to-node path
            assert int(tree.parents[b]) == a
        return tree, res

    firsts, (pairs,) = run_draws(step)
    assert chisq_pvalue(first_token_groups(firsts, P[ROOT])) > ALPHA
    assert chisq_pvalue(second_token_groups(pairs, P)) > ALPHA
    # root children cover {3, 5, 1, 6}: the accepted-first-token rate is their total mass under p
    rate = len(pairs) / N_DRAWS
    expect = float(P[ROOT, [3, 5, 1, 6]].sum())
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / N_DRAWS) ** 0.5 + 1e-3


@pytest.mark.parametrize("k", [2, 4])
def test_rejection_tree_iid_children_with_q(world, k):
    """k children of the root drawn i.i.d. from q (duplicates allowed), each with one child drawn from q after it."""
    P, Q = world
    draft_gen = torch.Generator().manual_seed(50 + k)
    firsts_d = torch.multinomial(Q[ROOT].expand(N_DRAWS, V), k, replacement=True, generator=draft_gen)  # [N, k]
    seconds_d = torch.multinomial(Q[firsts_d.reshape(-1)], 1, generator=draft_gen).reshape(N_DRAWS, k)
    parents = torch.tensor([-1] * k + list(range(k)), dtype=torch.long)
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(60 + k)

    toks = torch.cat([firsts_d, seconds_d], 1)  # [N, 2k]
    q_rows = torch.cat([Q[ROOT].expand(N_DRAWS, k, V), Q[firsts_d]], 1)  # [N, 2k, V]
    p_rows = P[torch.cat([torch.full((N_DRAWS, 1), ROOT), toks], 1)]  # [N, 2k + 1, V]

    def step(i):
        tree = DraftTree(toks[i], parents, q_rows[i])
        return tree, rule.accept(tree, p_rows[i], gen)

    firsts, (pairs,) = run_draws(step)
    assert chisq_pvalue(first_token_groups(firsts, P[ROOT])) > ALPHA
    assert chisq_pvalue(first_token_groups(firsts, Q[ROOT]), strict=False) < 1e-6
    assert chisq_pvalue(second_token_groups(pairs, P)) > ALPHA


# ----------------------------------------------------------------------------------------------------------------
# RejectionSampling: edge cases


def test_rejection_q_equal_p_accepts_everything():
    P = dirichlet_rows(4, seed=70)
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(71)
    chain = DraftTree.chain([1, 2, 3], draft_probs=P[:3].clone())
    iid = DraftTree(torch.tensor([4, 4, 0]), torch.tensor([-1, -1, -1]), P[0].expand(3, V).clone())
    for _ in range(2000):
        res = rule.accept(chain, P, gen)
        assert res.accepted_nodes == [0, 1, 2] and res.bonus
        assert 0 <= res.next_token < V
        res = rule.accept(iid, P, gen)
        assert res.accepted_nodes == [0] and res.bonus  # the first child is always accepted, and is a leaf
    # the residual of q == p has no mass: it must fall back to a valid distribution, not 0/0 = NaN
    res_row = _residual(P[0], P[0].clone(), 3)
    assert torch.isfinite(res_row).all() and float(res_row.sum()) == pytest.approx(1.0)
    # q equal to p up to float round-off: rejections (and near-empty residuals) stay valid and the law stays p
    noisy = P[0] * (1 + 1e-6 * torch.randn(V, generator=torch.Generator().manual_seed(73)))
    noisy = noisy / noisy.sum()
    draws = torch.multinomial(noisy.expand(N_DRAWS // 4, V), 1, generator=gen)[:, 0]
    firsts = []
    for x in draws.tolist():
        tree = DraftTree(torch.tensor([x, x]), torch.tensor([-1, -1]), noisy.expand(2, V).clone())
        res = rule.accept(tree, P[:3], gen)
        assert 0 <= res.next_token < V
        firsts.append(committed(tree, res)[0])
    assert chisq_pvalue(first_token_groups(firsts, P[0])) > ALPHA
    # a fully-accepted chain adds a bonus token drawn from the leaf's p row
    P1 = dirichlet_rows(2, seed=72)
    bonus = [rule.accept(DraftTree.chain([5], P1[:1].clone()), P1, gen).next_token for _ in range(N_DRAWS // 2)]
    assert chisq_pvalue(first_token_groups(bonus, P1[1])) > ALPHA


def test_rejection_target_zeros_where_q_has_mass():
    """p is exactly 0 on tokens where q has mass: such tokens are never committed, and the first token ~ p."""
    P = dirichlet_rows(V, seed=80, zeros=3)
    Q = dirichlet_rows(V, seed=81)
    assert ((P[ROOT] == 0) & (Q[ROOT] > 0)).any()
    seqs = sample_chains(Q, 2, seed=82)
    p_rows, q_rows = P[seqs], Q[seqs[:, :-1]]
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(83)

    def step(i):
        tree = DraftTree.chain(seqs[i, 1:], draft_probs=q_rows[i])
        res = rule.accept(tree, p_rows[i], gen)
        toks = committed(tree, res)
        ctx = [ROOT] + toks[:-1]
        assert all(float(P[a, b]) > 0 for a, b in zip(ctx, toks))  # never a token the target rules out
        return tree, res

    firsts, (pairs,) = run_draws(step)
    # chisq_pvalue asserts that no zero-probability token was ever committed
    assert chisq_pvalue(first_token_groups(firsts, P[ROOT])) > ALPHA
    assert chisq_pvalue(second_token_groups(pairs, P)) > ALPHA


def test_rejection_one_hot_target():
    """A one-hot p (what greedy processing gives) commits exactly its token, whatever the draft proposes."""
    p = torch.zeros(3, V)
    p[:, 6] = 1.0
    q = dirichlet_rows(2, seed=90)
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(91)
    for tok in range(V):
        for tree in (DraftTree.chain([tok, 6], q), DraftTree(torch.tensor([tok, (tok + 1) % V]),
                                                               torch.tensor([-1, -1]))):
            for _ in range(20):
                res = rule.accept(tree, p[: len(tree) + 1], gen)
                toks = committed(tree, res)
                assert toks[0] == 6
                assert all(t == 6 for t in toks)


def test_rejection_empty_tree_samples_p():
    P = dirichlet_rows(1, seed=95)
    rule, gen = RejectionSampling(), torch.Generator().manual_seed(96)
    out = []
    for _ in range(N_DRAWS // 2):
        res = rule.accept(DraftTree.empty(), P, gen)
        assert res.accepted_nodes == [] and res.bonus
        out.append(res.next_token)
    assert chisq_pvalue(first_token_groups(out, P[0])) > ALPHA


# ----------------------------------------------------------------------------------------------------------------
# GreedyMatch


def logits_with_argmax(best: list[int], seed: int = 0) -> torch.Tensor:
    """[len(best), V] random logits whose row-wise argmax is ``best``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(best), V, generator=g)
    x[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return x


@pytest.mark.parametrize("fast", [False, True], ids=["logits", "ids"])
def test_greedy_chain(fast):
    rule = GreedyMatch()
    best = [4, 1, 7, 2]
    p = logits_with_argmax(best)
    p = p.argmax(-1) if fast else p
    res = rule.accept(DraftTree.chain([4, 1, 7]), p)  # everything matches: bonus = argmax at the leaf
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([0, 1, 2], 2, True)
    res = rule.accept(DraftTree.chain([4, 3, 7]), p)  # mismatch at depth 2: recovered = target argmax there
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([0], 1, False)
    res = rule.accept(DraftTree.chain([5, 1, 7]), p)
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([], 4, False)
    res = rule.accept(DraftTree.empty(), p[:1])
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([], 4, True)


@pytest.mark.parametrize("fast", [False, True], ids=["logits", "ids"])
def test_greedy_tree(fast):
    rule = GreedyMatch()
    #            node: 0  1  2  3  4  5  6
    tokens = torch.tensor([2, 4, 6, 1, 3, 7, 5])
    parents = torch.tensor([-1, -1, -1, 1, 1, 3, 2])
    tree = DraftTree(tokens, parents)
    # target argmax per row (row 0 = root, row i + 1 after node i)
    best = [4, 0, 3, 0, 7, 0, 2, 0]  # root -> 4 (node 1) -> 3 (node 4) -> leaf: bonus = best[5] = 0
    p = logits_with_argmax(best, seed=1)
    p = p.argmax(-1) if fast else p
    res = rule.accept(tree, p)
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([1, 4], 0, True)
    best = [4, 0, 1, 0, 7, 0, 2, 0]  # root -> 4 (node 1) -> 1 (node 3) -> 7 (node 5, a leaf): bonus = best[6]
    p = logits_with_argmax(best, seed=2)
    p = p.argmax(-1) if fast else p
    res = rule.accept(tree, p)
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([1, 3, 5], 2, True)
    best = [4, 0, 5, 0, 7, 0, 2, 0]  # root -> 4 (node 1) -> wants 5, children are 1, 3: recovered 5
    p = logits_with_argmax(best, seed=3)
    p = p.argmax(-1) if fast else p
    res = rule.accept(tree, p)
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([1], 5, False)
    best = [0, 0, 0, 0, 0, 0, 0, 0]  # no child of the root matches
    p = logits_with_argmax(best, seed=4)
    p = p.argmax(-1) if fast else p
    res = rule.accept(tree, p)
    assert (res.accepted_nodes, res.next_token, res.bonus) == ([], 0, False)


# ----------------------------------------------------------------------------------------------------------------
# sampling.probs_from_logits


def test_probs_temperature():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(100))
    for t in (0.5, 1.0, 2.0):
        got = probs_from_logits(logits, SamplingConfig(temperature=t))
        torch.testing.assert_close(got, (logits / t).softmax(-1))
        assert got.dtype == torch.float32
    lo = probs_from_logits(logits, SamplingConfig(temperature=0.25))
    hi = probs_from_logits(logits, SamplingConfig(temperature=2.0))  # the highest temperature accepted
    assert (lo.max(-1).values > hi.max(-1).values).all()  # lower temperature = sharper


def test_probs_greedy_is_one_hot():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(101))
    got = probs_from_logits(logits, SamplingConfig(temperature=0.0))
    assert torch.equal(got.sum(-1), torch.ones(5))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert ((got == 0) | (got == 1)).all()


def test_probs_top_k():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(102))
    for k in (1, 3, V, V + 5):
        got = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=k))
        kk = min(k, V)
        assert ((got > 0).sum(-1) == kk).all()
        top = torch.topk(logits, kk, dim=-1).indices
        keep = torch.zeros_like(got, dtype=torch.bool).scatter_(-1, top, True)
        assert (got[~keep] == 0).all()
        torch.testing.assert_close(got, logits.masked_fill(~keep, float("-inf")).softmax(-1))


def test_probs_top_p_keeps_smallest_prefix_reaching_p():
    base = torch.tensor([0.1, 0.4, 0.05, 0.2, 0.15, 0.03, 0.04, 0.03])  # sorted: 1, 3, 4, 0, 2, 6, ...
    logits = base.log()
    order = [1, 3, 4, 0, 2, 6]
    cases = {0.05: 1, 0.39: 1, 0.41: 2, 0.55: 2, 0.61: 3, 0.74: 3, 0.76: 4, 0.84: 4, 0.86: 5, 0.999: V}
    for top_p, n_keep in cases.items():
        got = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        kept = set(torch.nonzero(got).flatten().tolist())
        want = set(order[:n_keep]) if n_keep < V else set(range(V))
        assert kept == want, (top_p, kept, want)
        assert float(base[list(want)].sum()) >= top_p  # the kept prefix reaches top_p ...
        if n_keep > 1:  # ... and no shorter prefix does
            assert float(base[order[: n_keep - 1]].sum()) < top_p
        torch.testing.assert_close(got[list(want)], base[list(want)] / base[list(want)].sum())
    # the top token is always kept, even for a tiny top_p or a very flat distribution
    flat = torch.zeros(2, V)
    flat[1, 5] = 1e-3
    got = probs_from_logits(flat, SamplingConfig(temperature=1.0, top_p=1e-6))
    assert int((got[1] > 0).sum()) == 1 and float(got[1, 5]) == 1.0
    assert int((got[0] > 0).sum()) >= 1 and torch.allclose(got.sum(-1), torch.ones(2))


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-38, 1e-20, 1e-6])
@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-40, 0.5, 1.0])
def test_probs_extreme_knobs_stay_a_distribution(temperature, top_p):
    """Any accepted temperature and top_p (down to the smallest double) gives a distribution that can be drawn from:
    finite, summing to 1, on the argmax. A tiny temperature once overflowed the logits to inf (NaN after softmax)
    and a top_p that rounds to 0 in float32 once dropped every token."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(103)) * 30
    logits[2, 4:] = float("-inf")  # a row whose vocabulary is partly masked, as a mapped draft's is
    for top_k in (0, 2):
        got = probs_from_logits(logits, SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k))
        assert torch.isfinite(got).all() and (got >= 0).all()
        torch.testing.assert_close(got.sum(-1), torch.ones(3))
        assert (got.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()
        torch.multinomial(got, 1)  # drawable
    if temperature < 1e-30:  # colder than any logit gap: one-hot on the argmax
        got = probs_from_logits(logits, SamplingConfig(temperature=temperature, top_p=top_p))
        assert torch.equal(got, probs_from_logits(logits, SamplingConfig(temperature=0.0)))


def test_probs_top_k_then_top_p():
    """top-k is applied before top-p (as in Hugging Face), and top-p renormalises over the top-k survivors."""
    base = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0]) + 1e-9
    logits = base.log()
    # top-k 3 leaves [.444, .333, .222]: mass before the third is .777 >= .75, so top-p .75 keeps two tokens;
    # top-p .75 on the untruncated distribution would keep three (mass before the third is .7)
    got = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.75))
    assert torch.nonzero(got).flatten().tolist() == [0, 1]
    only_p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    assert torch.nonzero(only_p).flatten().tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------------
# seeded determinism


def _decisions(seed: int, P: torch.Tensor, Q: torch.Tensor, n: int = 300):
    gen = torch.Generator().manual_seed(seed)
    rule = RejectionSampling()
    out = []
    for i in range(n):
        k = 1 + i % 3
        toks = torch.multinomial(Q[ROOT], k, replacement=True, generator=gen)
        tree = DraftTree(toks, torch.full((k,), -1, dtype=torch.long), Q[ROOT].expand(k, V).clone())
        res = rule.accept(tree, P[torch.cat([torch.tensor([ROOT]), toks])], gen)
        chain = DraftTree.chain(toks, Q[torch.cat([torch.tensor([ROOT]), toks[:-1]])])
        res2 = rule.accept(chain, P[torch.cat([torch.tensor([ROOT]), toks])], gen)
        one_hot = rule.accept(merge_sequences([[3, 1], [5]]), P[[ROOT, 3, 5, 1]], gen)
        out.append((res, res2, one_hot))
    return out


def test_seeded_determinism(world):
    P, Q = world
    a, b, c = _decisions(7, P, Q), _decisions(7, P, Q), _decisions(8, P, Q)
    assert a == b
    assert a != c


def test_vectorised_chain_equals_the_per_node_walk_on_the_same_draws():
    """``RejectionSampling`` decides a chain in one batch (one host sync); the same chain walked node by node (the
    tree path, forced with ``is_chain=False``) must give the identical step on the same random draws: drafts with
    q and one-hot drafts, tokens drawn from q or anywhere (some with q(x) = 0 or p(x) = 0), residuals with no mass
    (q == p), and every chain length from 0 to 6."""
    rule = RejectionSampling()
    seen = set()  # (chain length, accepted length): rejections at every depth and full acceptances both occur
    for seed in range(300):
        g = torch.Generator().manual_seed(1000 + seed)
        n = seed % 7
        p = dirichlet_rows(n + 1, seed=2 * seed, zeros=seed % 3)  # [n + 1, V]
        q = None if seed % 4 == 0 else dirichlet_rows(max(n, 1), seed=2 * seed + 1, zeros=seed % 2)[:n]  # [n, V]
        if q is not None and seed % 5 == 0 and n:
            q[0] = p[0]  # an empty residual at position 0
        if q is not None and seed % 2:
            toks = torch.multinomial(q, 1, generator=g)[:, 0] if n else torch.zeros(0, dtype=torch.long)
        else:
            toks = torch.randint(0, V, (n,), generator=g)
        parents = torch.arange(-1, n - 1)
        chain = DraftTree(toks, parents, None if q is None else q.clone())
        walked = DraftTree(toks, parents, None if q is None else q.clone(), is_chain=False)
        assert chain.is_chain
        for draw in range(5):
            a = rule.accept(chain, p, torch.Generator().manual_seed(seed * 10 + draw))
            b = rule.accept(walked, p, torch.Generator().manual_seed(seed * 10 + draw))
            assert (a.accepted_nodes, a.next_token, a.bonus) == (b.accepted_nodes, b.next_token, b.bonus), (seed, draw)
            seen.add((n, len(a.accepted_nodes)))
    assert {(6, k) for k in range(7)} <= seen and {(n, n) for n in range(7)} <= seen
