"""``rapid``: retrieval-augmented speculative decoding (RAPID: Chen, Feng, Ni, Li, Shieh, ICML 2025).

RAPID's drafter is a causal LM with the target's vocabulary (default the target itself; a larger model = upward
speculation) that reads a *short* prompt, template(retrieved chunks, query), and continues ``draft_prompt_ids +
generated tokens`` with its own KV cache, gamma tokens per step (default 10), returning q so either rule can run:
exact sampling (eta = 0, lossless) or ``acceptance_rapid``'s retrieval-augmented target (eta > 0, lossy).
"""

from __future__ import annotations

import torch

from ..errors import RetrospecError
from .base import DecodeContext, as_module
from .registry import ADAPTIVE, Knob, MethodSpec, gamma_knob, register
from .small_lm import SmallLMDrafter, load_draft_lm, vocab_map_options

DEFAULT_GAMMA = 10


class RapidDrafter(SmallLMDrafter):
    name = "rapid"

    def __init__(self, model: torch.nn.Module, draft_prompt_ids: list[int], gamma: int = DEFAULT_GAMMA,
                 adaptive: bool = False, probs_when_greedy: bool = False, prefill_prompt: bool = True, **vocab_map):
        super().__init__(model, gamma=gamma, adaptive=adaptive, probs_when_greedy=probs_when_greedy,
                         prefill_prompt=prefill_prompt, **vocab_map)
        if not draft_prompt_ids:
            raise RetrospecError("the RAPID drafter needs a non-empty prompt")
        self.draft_prompt_ids = list(draft_prompt_ids)

    def sequence(self, ctx: DecodeContext) -> list[int]:
        return self.draft_prompt_ids + ctx.tokens[ctx.prompt_len:]


def _make_rapid(*, target=None, draft=None, draft_model=None, draft_prompt_ids=None, gamma: int = DEFAULT_GAMMA,
                adaptive: bool = False, eta: float = 0.0, prefill_prompt: bool = True) -> RapidDrafter:
    model = draft_model if draft_model is not None else as_module(target)
    if model is None or draft_prompt_ids is None:
        raise RetrospecError("method 'rapid' needs a long context (context=... / --context-file)")
    vocab = vocab_map_options(draft, target) if draft_model is not None else {}
    return RapidDrafter(model, draft_prompt_ids, gamma=gamma, adaptive=adaptive, probs_when_greedy=eta > 0,
                        prefill_prompt=prefill_prompt, **vocab)


SPEC = register(MethodSpec(
    "rapid", _make_rapid, "a draft LM over retrieved chunks of the long context",
    knobs=(gamma_knob(DEFAULT_GAMMA), ADAPTIVE,
           Knob("eta", "float", 0.0, "retrieval-augmented target strength (0 = exact; > 0 is LOSSY)", min=0, max=100)),
    context_gamma=DEFAULT_GAMMA, draft="lm", context="required", retrieval=True, lossy_when="eta > 0",
    load=load_draft_lm))
