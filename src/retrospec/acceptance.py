"""Acceptance rules: decide which draft nodes the target keeps, and the one token it adds.

Given a ``DraftTree`` and the target's distributions (``p[0]`` at the root, ``p[i + 1]`` after node i), a rule
returns the accepted root-to-node path and one more token: *recovered* (from the residual after the last rejection)
or *bonus* (from p after a fully accepted path).

``GreedyMatch`` (temperature 0): follow the child whose token equals argmax p; the output equals greedy decoding.

``RejectionSampling``: speculative sampling (Leviathan et al., 2023; Chen et al., 2023), generalised to trees by
recursive rejection over a node's children (SpecInfer, Miao et al., 2024). At a node with children c_1..c_m and
residual r (initially p): accept c_i with probability min(1, r(x_i) / q_i(x_i)); on rejection set
r <- norm(max(r - q_i, 0)) and try the next child; when all are rejected, draw the recovered token from r.
A child without probabilities counts as one-hot q, so accepting it has probability r(x_i) and rejecting it zeroes
r(x_i). Lossless when the children of a node are distinct one-hot drafts or independent draws from their q_i:
the committed tokens are distributed exactly as samples from p (tested statistically). The recovered or bonus token
is drawn by the exponential race (``_race``: no normalisation, no host sync).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .tree import children_lists
from .types import DraftTree, StepResult


class AcceptanceRule(Protocol):
    lossless: bool
    name: str

    def accept(self, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> StepResult:
        """``p``: [N + 1, V] processed target probabilities (row 0 = root); or [N + 1] argmax ids for greedy."""
        ...


class GreedyMatch:
    """Accept while the draft token equals the target's argmax. Lossless for greedy decoding."""

    lossless = True
    name = "greedy"

    def accept(self, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None = None) -> StepResult:
        # [N + 1] target argmax per position: max's indices are argmax's (the first maximal value), 2-4x faster on CPU
        best = p.max(-1).indices.tolist() if p.dim() == 2 else p.tolist()
        if tree.is_chain:  # fast path: no child lists needed
            toks = tree.tokens.tolist()
            n = 0
            while n < len(toks) and toks[n] == best[n]:
                n += 1
            return StepResult(list(range(n)), best[n], bonus=n == len(toks))
        kids = children_lists(tree.parents)
        toks = tree.tokens.tolist()
        path: list[int] = []
        node = -1
        while True:
            want = best[node + 1]
            nxt = next((c for c in kids[node + 1] if toks[c] == want), None)
            if nxt is None:
                return StepResult(path, want, bonus=not kids[node + 1])
            path.append(nxt)
            node = nxt


def _residual(r: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(r - q, 0)); q None = one-hot at ``token``. Falls back to r when the residual has no mass."""
    if q is None:
        res = r.clone()
        res[token] = 0.0
    else:
        res = (r - q).clamp_min_(0.0)
    total = res.sum()
    if total <= 0:  # only reachable through float round-off (e.g. q == p); keep r rather than divide by zero
        return r
    return res / total


def _race(r: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """One draw from each row of ``r`` [..., V] (unnormalised) by the exponential race, argmax r / e with
    e [V] ~ Exp(1): exact (the first arrival of independent Poisson clocks of rates r), and free of host syncs."""
    return (r / e).argmax(-1)


class RejectionSampling:
    """Exact speculative sampling over a chain or tree; one-hot q for deterministic drafts. Lossless.

    Random draws per step, in this order from ``generator``: ``u`` [N] (one uniform per node's acceptance test) and
    ``e`` [V] (the race's exponentials). A chain is decided in one batch of tensor operations with one host sync; a
    tree walks its nodes (``_walk``). Both give the same result on the same draws (tested).
    """

    lossless = True
    name = "rejection-sampling"

    def accept(self, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> StepResult:
        n_nodes = len(tree)
        u = torch.rand(max(1, n_nodes), generator=generator)  # [N] on the generator's device
        e = torch.empty(p.shape[-1]).exponential_(generator=generator).clamp_min_(1e-30)  # [V], never 0
        if tree.is_chain:
            return self._chain(tree, p, u.to(p.device), e.to(p.device))
        return self._walk(tree, p, u.tolist(), e.to(p.device))

    @staticmethod
    def _chain(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, e: torch.Tensor) -> StepResult:
        n = len(tree)
        x = tree.tokens.to(p.device)  # [N]
        rows = torch.arange(n, device=p.device)  # [N]
        px = p[rows, x]  # [N] p(x_i) at the position of node i (row i: after node i - 1)
        q = tree.draft_probs
        if q is None:  # one-hot q: accept with probability p(x); the residual is p with x removed
            qx = torch.ones_like(px)
            res = p[:n].clone().index_put_((rows, x), torch.zeros_like(px))  # [N, V]
        else:
            q = q.to(p.device)
            qx = q[rows, x]  # [N]
            res = (p[:n] - q).clamp_min_(0.0)  # [N, V] unnormalised max(p - q, 0)
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, p[:n])  # an empty residual (round-off) keeps p
        tokens = _race(torch.cat([res, p[n:n + 1]]), e)  # [N + 1]: recovered at each position, bonus at N
        ok = (qx > 0) & (u[:n] * qx < px)  # [N] u < min(1, p(x)/q(x)), without dividing
        accepted = ok.long().cumprod(0).sum()  # [] length of the accepted prefix
        k, token = torch.stack([accepted, tokens[accepted]]).tolist()  # the one host sync of the step
        return StepResult(list(range(k)), token, bonus=k == n)

    @staticmethod
    def _walk(tree: DraftTree, p: torch.Tensor, u: list[float], e: torch.Tensor) -> StepResult:
        kids = children_lists(tree.parents)
        toks = tree.tokens.tolist()
        q_all = tree.draft_probs
        path: list[int] = []
        node = -1
        while True:
            r = p[node + 1]  # [V] residual starts as p at this position
            chosen = None
            for c in kids[node + 1]:
                x = toks[c]
                q = None if q_all is None else q_all[c]
                qx = 1.0 if q is None else float(q[x])
                rx = float(r[x])
                if qx > 0 and u[c] * qx < rx:  # u < min(1, r(x)/q(x)), without dividing
                    chosen = c
                    break
                r = _residual(r, q, x)
            if chosen is None:
                return StepResult(path, int(_race(r, e)), bonus=not kids[node + 1])
            path.append(chosen)
            node = chosen
