"""retrospec's prompt lookup as a vLLM proposer: our drafter inside the engine users move to for many clients.

vLLM (0.32 and its CPU build) loads an outside proposer without a fork::

    vllm serve MODEL --speculative-config '{"method": "custom_class", "num_speculative_tokens": 10,
        "model": "retrospec.integrations.vllm_proposer.PromptLookupProposer"}'

(``LLM(..., speculative_config={...})`` offline). vLLM builds the class with its config and, every step, calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``: per request of the batch, the tokens it just
sampled (empty while the request is still in prefill), how many tokens are valid in its row, and the rows
[max_num_reqs, max_model_len] of prompt + output ids. The answer is one chain of draft ids per request (possibly
empty); vLLM verifies them with its own rejection sampler, so the output is vLLM's greedy output whatever we propose
(``make peers-test`` checks that on real prompts).

The chain is ``drafters.prompt_lookup.lookup`` (Saxena, 2023: the longest suffix n-gram's most recent earlier match,
continued with overlap): the same drafts our ``pld`` makes. ``num_speculative_tokens`` is k; vLLM zeroes its own
``prompt_lookup_*`` fields for a custom class, so the n-gram sizes come from ``RETROSPEC_PLD_MAX_NGRAM`` /
``RETROSPEC_PLD_MIN_NGRAM`` (defaults 3 and 1, our ``pld``'s). Only this module's imports run inside vLLM's worker:
numpy and the drafter's lookup.

Needs of the methods that cannot live here: DReSD drafts from the target's hidden states (vLLM's EAGLE-3 path
computes them, in-tree, and a ``custom_class`` proposer is not handed them); LongSpec drafts over the target's KV
cache, which no engine exposes to a plugin.
"""

from __future__ import annotations

import os

import numpy as np

from ..drafters.prompt_lookup import lookup

MAX_NGRAM_ENV, MIN_NGRAM_ENV = "RETROSPEC_PLD_MAX_NGRAM", "RETROSPEC_PLD_MIN_NGRAM"


class PromptLookupProposer:
    """A vLLM ``custom_class`` proposer (see the module docstring). Stateless between steps: each call searches the
    rows vLLM passes, so requests may join, leave or be preempted freely."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_ngram = int(os.environ.get(MAX_NGRAM_ENV, "3"))
        self.min_ngram = int(os.environ.get(MIN_NGRAM_ENV, "1"))
        if self.k < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need num_speculative_tokens >= 1 and 1 <= {MIN_NGRAM_ENV} <= {MAX_NGRAM_ENV}, got "
                             f"{self.k}, {self.min_ngram}, {self.max_ngram}")

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM calls this on every proposer)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                *args, **kwargs) -> list[list[int]]:
        """sampled_token_ids: per request the ids sampled this step ([] = not decoding); num_tokens_no_spec [R];
        token_ids_cpu [R_max, max_model_len] -> per request a draft chain of at most k ids (room left in the
        model's length permitting)."""
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - n - 1)
            if not len(sampled) or room < 1:
                drafts.append([])
                continue
            drafts.append(lookup(token_ids_cpu[i, :n], room, self.max_ngram, self.min_ngram))
        return drafts
