"""The ``Drafter`` protocol, the plain-decoding drafter ``NoDraft`` and helpers shared by drafters.

A drafter proposes a ``DraftTree`` below the last committed token. It declares what it needs from the target in
``needs`` (``"target_kv"``, ``"hidden_states"``, ``"layer_states"``); the decode loop fills the matching fields of
``ctx.target`` (a ``TargetViews``) and leaves the others None.
A drafter never mutates the target model or the target's KV cache.

Lifecycle per request: ``prefill(ctx)`` once, then per step ``propose(ctx, budget)`` (at most ``budget`` nodes;
``ctx.max_depth``: the deepest node the step could commit, the loop drops deeper ones) and
``observe(accepted, drafted)`` with the outcome.

Optional: ``state_bytes() -> int``, the bytes of per-request state (own KV cache, ring buffer, window cache; not
shared weights or datastores), 0 before ``prefill``; recorded in ``SpecStats.draft_state_bytes`` for the bench.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..config import SamplingConfig
from ..kv import KVCache
from ..models.loading import as_module  # noqa: F401 (the drafters import it from here)
from ..types import DraftTree


VIEWS = frozenset({"target_kv", "hidden_states", "layer_states"})  # what a drafter may declare in ``needs``


@dataclass
class TargetViews:
    """Read-only views of the target that the decode loop hands a drafter: only those its ``needs`` declare are
    filled, the rest stay None. A drafter reads them and never writes to them."""

    kv: KVCache | None = None  # "target_kv": the target's cache of every committed token but the last; per layer
    #                            keys/values [1, kv_heads, len(kv), head_dim]
    hidden_states: torch.Tensor | None = None  # "hidden_states": [H] the last-layer hidden state that produced
    #                                            tokens[-1] (updated after every step)
    layer_states: torch.Tensor | None = None  # "layer_states": [n, H] the outputs of the decoder layers the drafter
    #                                           names in ``feature_layers``, at the row that produced tokens[-1]

    @classmethod
    def declared(cls, needs: frozenset[str]) -> None:
        """Refuse a ``needs`` entry the loop cannot fill (a typo would otherwise leave a view silently None)."""
        unknown = sorted(set(needs) - VIEWS)
        if unknown:
            raise ValueError(f"unknown drafter need {unknown[0]!r}; the decode loop provides {sorted(VIEWS)}")
        if {"hidden_states", "layer_states"} <= set(needs):
            raise ValueError("a drafter reads the last hidden state or the outputs of chosen layers, not both")


@dataclass
class DecodeContext:
    tokens: list[int]  # every committed token: prompt + generated; tokens[-1] is the root of the next tree
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    target: TargetViews = field(default_factory=TargetViews)  # filled per the drafter's ``needs``
    eos_ids: frozenset[int] = frozenset()  # generation ends at these: a chain drafted past one is wasted work
    max_depth: int | None = None  # this step's deepest useful node (the new tokens left, less the target's own;
    #                               None = no limit): the loop drops deeper nodes, a chain drafter need not draft them


def chain_room(ctx: DecodeContext, n: int) -> int:
    """``n`` tokens, or fewer when the step's ``max_depth`` is smaller (what a chain drafter drafts)."""
    return n if ctx.max_depth is None else min(n, ctx.max_depth)


def draft_chain(logits: torch.Tensor, gamma: int, ctx: DecodeContext, advance: Callable[[int, int], torch.Tensor],
                keep_q: bool = False) -> DraftTree:
    """Up to ``gamma`` tokens drawn autoregressively from a draft LM, starting from ``logits`` [V].

    ``advance(token, i)`` feeds the i-th drafted token and returns the next [V] logits. Greedy: argmax tokens, q
    (softmax(logits)) only with ``keep_q``; sampling: drawn from the processed q, always kept. The chain stops after
    an EOS token, which changes no output (every chain length is valid for the acceptance rules).
    """
    from ..sampling import draw, probs_from_logits

    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    for i in range(gamma):
        if ctx.sampling.greedy:
            tok = int(logits.argmax())
            if keep_q:
                qs.append(logits.float().softmax(-1))  # [V]
        else:
            q = probs_from_logits(logits, ctx.sampling)  # [V]
            tok = int(draw(q, ctx.generator))
            qs.append(q)
        tokens.append(tok)
        if tok in ctx.eos_ids:
            break
        if i + 1 < gamma:
            logits = advance(tok, i)
    return DraftTree.chain(tokens, torch.stack(qs) if qs else None)


def adapt_gamma(gamma: int, max_gamma: int, accepted: int, drafted: int) -> int:
    """Adaptive draft length: +2 after a fully accepted chain, -1 after a rejection, within [1, max_gamma]; Hugging
    Face's ``heuristic`` assistant schedule, so comparisons are like for like."""
    if drafted == 0:
        return gamma
    return min(max_gamma, gamma + 2) if accepted == drafted else max(1, gamma - 1)


class Drafter(Protocol):
    name: str
    needs: frozenset[str]

    def prefill(self, ctx: DecodeContext) -> None: ...

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree: ...

    def observe(self, accepted: int, drafted: int) -> None: ...


def state_bytes(drafter) -> int:
    """``drafter.state_bytes()`` when the drafter defines it (see the module docstring), else 0."""
    fn = getattr(drafter, "state_bytes", None)
    return int(fn()) if callable(fn) else 0


class NoDraft:
    """Plain autoregressive decoding through the same engine: every step verifies an empty tree."""

    needs: frozenset[str] = frozenset()

    def __init__(self, name: str = "ar"):
        self.name = name

    def prefill(self, ctx: DecodeContext) -> None:
        pass

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        return DraftTree.empty()

    def observe(self, accepted: int, drafted: int) -> None:
        pass
