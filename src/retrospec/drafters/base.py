"""The ``Drafter`` protocol and the registry of drafting methods.

A drafter proposes a ``DraftTree`` below the last committed token. It declares what it needs from the target in
``needs`` (e.g. ``{"hidden_states"}``); the decode loop hands it read-only views through ``DecodeContext``.
A drafter never mutates the target model or the target's KV cache.

Lifecycle per request: ``prefill(ctx)`` once after the prompt is known, then per step ``propose(ctx, budget)``
(at most ``budget`` nodes) and ``observe(accepted, drafted)`` with the outcome (for adaptive lengths and the
drafter's own cache bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..config import SamplingConfig
from ..types import DraftTree


@dataclass
class DecodeContext:
    tokens: list[int]  # every committed token: prompt + generated; tokens[-1] is the root of the next tree
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    target_hidden: torch.Tensor | None = None  # [H] hidden state that produced tokens[-1], if declared in needs
    extras: dict = field(default_factory=dict)


class Drafter(Protocol):
    name: str
    needs: frozenset[str]

    def prefill(self, ctx: DecodeContext) -> None: ...

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree: ...

    def observe(self, accepted: int, drafted: int) -> None: ...


class NoDraft:
    """Plain autoregressive decoding through the same engine: every step verifies an empty tree."""

    name = "ar"
    needs: frozenset[str] = frozenset()

    def prefill(self, ctx: DecodeContext) -> None:
        pass

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        return DraftTree.empty()

    def observe(self, accepted: int, drafted: int) -> None:
        pass


# name -> factory(**options) -> Drafter. Factories receive the method's options (draft model, gamma, ...).
REGISTRY: dict[str, Callable[..., Drafter]] = {"ar": lambda **_: NoDraft()}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory

    return deco
