"""``rapid``: retrieval-augmented speculative decoding (RAPID: Chen, Feng, Ni, Li, Shieh, ICML 2025), and the
long-context baselines ``lc`` and ``rag``.

RAPID's drafter is a causal LM sharing the target's vocabulary (default: the target itself = self-speculation; a
larger model = upward speculation) that reads a *short* prompt, template(retrieved chunks, query), instead of the
long one the target verifies over. It continues ``draft_prompt_ids + generated tokens`` (the target's committed
tokens after its own prompt) with its own KV cache, gamma tokens per step (default 10), and returns q with every
drafted token so either acceptance rule can run: exact speculative sampling (eta = 0, lossless) or the
retrieval-augmented target of ``acceptance_rapid`` (eta > 0, lossy).

``lc`` (target autoregressive over the full context) and ``rag`` (target autoregressive over the retrieved
context) draft nothing: which prompt the target reads is decided by ``retrospec.long_requests``, not here.
"""

from __future__ import annotations

import torch

from .base import DecodeContext, NoDraft, as_module, register
from .small_lm import SmallLMDrafter, vocab_map_options

DEFAULT_GAMMA = 10


class RapidDrafter(SmallLMDrafter):
    name = "rapid"

    def __init__(self, model: torch.nn.Module, draft_prompt_ids: list[int], gamma: int = DEFAULT_GAMMA,
                 adaptive: bool = False, probs_when_greedy: bool = False, **vocab_map):
        super().__init__(model, gamma=gamma, adaptive=adaptive, probs_when_greedy=probs_when_greedy,
                         prefill_prompt=True, **vocab_map)
        if not draft_prompt_ids:
            raise ValueError("the RAPID drafter needs a non-empty prompt")
        self.draft_prompt_ids = list(draft_prompt_ids)

    def sequence(self, ctx: DecodeContext) -> list[int]:
        return self.draft_prompt_ids + ctx.tokens[ctx.prompt_len:]


class _Baseline(NoDraft):
    def __init__(self, name: str):
        self.name = name


@register("rapid")
def _make_rapid(*, target=None, draft=None, draft_model=None, draft_prompt_ids=None, gamma: int = DEFAULT_GAMMA,
                adaptive: bool = False, eta: float = 0.0, **_) -> RapidDrafter:
    model = draft_model if draft_model is not None else as_module(target)
    if model is None or draft_prompt_ids is None:
        raise ValueError("method 'rapid' needs a long context (context=... / --context-file)")
    vocab = vocab_map_options(draft, target) if draft_model is not None else {}
    return RapidDrafter(model, draft_prompt_ids, gamma=gamma, adaptive=adaptive, probs_when_greedy=eta > 0, **vocab)


@register("lc")
def _make_lc(**_) -> NoDraft:
    return _Baseline("lc")


@register("rag")
def _make_rag(**_) -> NoDraft:
    return _Baseline("rag")
