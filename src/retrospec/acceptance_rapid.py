"""RAPID's retrieval-augmented target and its acceptance rule — NOT lossless for eta > 0.

RAPID (Chen, Feng, Ni, Li, Shieh, ICML 2025) lets the drafter, which reads a short *retrieved* context, pull the
long-context target towards what it saw. With target p (logits z at temperature T) and draft q at one position,
the retrieval-augmented target is p_hat = softmax(z / T + eta * (q - p)), with *tail preservation*: wherever
p_hat(x) < 0.1 * max p_hat, p_hat(x) is replaced by p(x) (then renormalised), so only the head moves. Per drafted
token x ~ q: accept with probability min(1, p_hat(x) / q(x)); after a rejection draw the recovered token from
norm(max(p - p_hat, p - q)) clipped at 0 (p when that has no mass); after full acceptance the bonus token from p.

Output distribution of one position (what the tests check against):
P(y) = min(q(y), p_hat(y)) + (1 - sum_x min(q(x), p_hat(x))) * r(y), r = norm(max(p - p_hat, p - q, 0)).
This is not p in general: the output leans toward the drafter, which is the method's purpose (better answers than
the long-context target when retrieval helps) and the reason ``lossless = False``: every report names and flags it.

z / T is taken as log p of the *processed* target distribution (equal up to a constant; filtered tokens stay at 0).
At temperature 0 the rule gets raw logits: p and q are the untempered softmaxes, drafts are accepted while they
equal argmax p_hat, the recovered token is argmax p_hat, and the bonus token is argmax p.

With eta = 0, ``make_rapid_rule`` returns the exact rules (``GreedyMatch`` / ``RejectionSampling``): lossless.
"""

from __future__ import annotations

import torch

from .acceptance import AcceptanceRule, GreedyMatch, RejectionSampling
from .config import SamplingConfig
from .errors import RetrospecError
from .sampling import draw
from .types import DraftTree, StepResult

TAIL = 0.1  # tail preservation threshold relative to max p_hat (RAPID)


def augmented_target(p: torch.Tensor, q: torch.Tensor, eta: float, tail: float = TAIL) -> torch.Tensor:
    """p_hat for [..., V] probabilities p (target) and q (draft); rows sum to one."""
    logp = torch.where(p > 0, p.clamp_min(1e-38).log(), torch.full_like(p, float("-inf")))
    p_hat = (logp + eta * (q - p)).softmax(-1)  # [..., V]
    in_tail = p_hat < tail * p_hat.amax(-1, keepdim=True)
    p_hat = torch.where(in_tail, p, p_hat)
    return p_hat / p_hat.sum(-1, keepdim=True)


def recovery_distribution(p: torch.Tensor, p_hat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - p_hat, p - q)) clipped at 0; falls back to p when it has no mass. [V]."""
    r = torch.maximum(p - p_hat, p - q).clamp_min_(0.0)
    total = r.sum()
    return r / total if total > 0 else p


class RetrievalAugmentedRule:
    """RAPID's acceptance against p_hat (chains only). Lossy: ``lossless = False``."""

    lossless = False

    def __init__(self, eta: float, greedy: bool = False, tail: float = TAIL):
        if not eta > 0:
            raise RetrospecError(f"the retrieval-augmented rule needs eta > 0 (eta = 0 is exact sampling), got {eta}")
        self.eta = float(eta)
        self.greedy = greedy
        self.tail = tail
        self.name = f"rapid-augmented(eta={self.eta:g}, LOSSY)"

    def accept(self, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> StepResult:
        """``p``: [N + 1, V] processed target probabilities, or raw logits when greedy."""
        n = len(tree)
        if n and not tree.is_chain:
            raise RetrospecError("the retrieval-augmented rule verifies chains only")
        if n and tree.draft_probs is None:
            raise RetrospecError("the retrieval-augmented rule needs the drafter's probabilities q")
        toks = tree.tokens.tolist()
        if self.greedy:
            probs = p.float().softmax(-1)  # [N + 1, V] untempered target probabilities
            if n:
                best = augmented_target(probs[:n], tree.draft_probs.float(), self.eta, self.tail).argmax(-1).tolist()
                for i in range(n):
                    if toks[i] != best[i]:
                        return StepResult(list(range(i)), best[i], bonus=False)
            return StepResult(list(range(n)), int(probs[n].argmax()), bonus=True)
        if n:
            q = tree.draft_probs.float()  # [N, V]
            p_hat = augmented_target(p[:n], q, self.eta, self.tail)  # [N, V]
            u = torch.rand(n, generator=generator).tolist()
            for i, x in enumerate(toks):
                if not u[i] * float(q[i, x]) < float(p_hat[i, x]):  # reject: u >= min(1, p_hat(x) / q(x))
                    r = recovery_distribution(p[i], p_hat[i], q[i])
                    return StepResult(list(range(i)), int(draw(r, generator)), bonus=False)
        return StepResult(list(range(n)), int(draw(p[n], generator)), bonus=True)


def make_rapid_rule(eta: float, sampling: SamplingConfig) -> AcceptanceRule:
    """eta = 0: the exact (lossless) rule for the sampling mode; eta > 0: ``RetrievalAugmentedRule`` (lossy)."""
    if eta < 0:
        raise RetrospecError(f"eta must be >= 0, got {eta}")
    if eta == 0:
        return GreedyMatch() if sampling.greedy else RejectionSampling()
    return RetrievalAugmentedRule(eta, greedy=sampling.greedy)
