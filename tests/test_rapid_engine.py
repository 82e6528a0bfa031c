"""RAPID and MagicDec in the engine, with tiny random models (Llama and Qwen2).

- RAPID with eta = 0 is lossless: greedy output token-identical to lc (the target's own greedy decoding over the
  full prompt) and to the oracle; sampled output distributed as the target's p (chi-square on a small vocabulary).
- MagicDec is lossless (greedy identical to the oracle) and its StreamingLLM cache holds exactly the sinks plus
  the window.
- A prefill memo gives the same outputs as a fresh prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from conftest import sharpen, tiny_llama, tiny_qwen2
from retrospec.acceptance_rapid import make_rapid_rule
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters.base import NoDraft
from retrospec.drafters.magicdec import MagicDecDrafter
from retrospec.drafters.rapid import RapidDrafter
from retrospec.kv.streaming import SinkWindowCache
from retrospec.verify import PrefillMemo, Verifier

GREEDY = SamplingConfig()


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny forwards: one thread avoids thread-pool barriers (several times faster on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(target, drafter, prompt, sampling=GREEDY, max_new=24, rule=None, memo=None, stats=None):
    out: list[int] = []
    for chunk in speculative_generate(target, drafter, prompt, sampling=sampling, max_new_tokens=max_new, rule=rule,
                                      prefill_memo=memo, stats=stats):
        out.extend(chunk)
    return out


def _prompt(n: int, seed: int = 0, vocab: int = 90) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_rapid_eta0_greedy_identical_to_lc_and_oracle(target, draft):
    sharpen(target, 4.0)
    prompt = _prompt(90)
    oracle = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=24)
    lc = _run(target, NoDraft(), prompt)
    short = prompt[-24:]  # the drafter's "retrieved" prompt
    self_spec = _run(target, RapidDrafter(target, short, gamma=10), prompt)
    upward = _run(target, RapidDrafter(draft, short, gamma=10), prompt)  # another model as the drafter
    assert lc == oracle
    assert self_spec == oracle
    assert upward == oracle


def test_rapid_eta_positive_is_flagged_and_runs(target):
    sharpen(target, 4.0)
    prompt = _prompt(60)
    from retrospec.types import SpecStats

    stats = SpecStats()
    rule = make_rapid_rule(2.0, GREEDY)
    out = _run(target, RapidDrafter(target, prompt[-20:], gamma=10, probs_when_greedy=True), prompt, rule=rule,
               stats=stats)
    assert len(out) == 24 and stats.lossless is False and "LOSSY" in stats.rule


def test_rapid_eta0_sampling_matches_target_distribution():
    """Marginal of the second generated token (committed by the rule after a rapid draft) equals the target's
    exact marginal sum_a p(a | prompt) p(. | prompt, a); the drafter's own marginal is rejected (power)."""
    vocab = 6
    target = sharpen(tiny_llama(seed=0, layers=1, hidden=16, vocab=vocab), 16.0)
    drafter = sharpen(tiny_llama(seed=5, layers=1, hidden=16, vocab=vocab), 16.0)
    prompt = _prompt(12, seed=1, vocab=vocab)
    short = prompt[-4:]
    with torch.no_grad():
        p1 = target(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = target(input_ids=torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1].softmax(-1)
        q2 = drafter(input_ids=torch.tensor([short + [a] for a in range(vocab)])).logits[:, -1].softmax(-1)
    exact = (p1[:, None] * p2).sum(0).double().numpy()  # [V]
    draft_marginal = (p1[:, None] * q2).sum(0).double().numpy()  # what always accepting the draft would give
    assert 0.5 * np.abs(exact - draft_marginal).sum() > 0.2, "the example must give the test power"
    n_runs = 1500
    counts = np.zeros(vocab, dtype=np.int64)
    memo = PrefillMemo()
    rule = make_rapid_rule(0.0, SamplingConfig(temperature=1.0))
    for seed in range(n_runs):
        s = SamplingConfig(temperature=1.0, seed=seed)
        out = _run(target, RapidDrafter(drafter, short, gamma=2), prompt, sampling=s, max_new=2, rule=rule, memo=memo)
        counts[out[1]] += 1
    assert memo.hits == n_runs - 1
    assert sps.chisquare(counts, exact / exact.sum() * n_runs).pvalue > 1e-3
    assert sps.chisquare(counts, draft_marginal / draft_marginal.sum() * n_runs).pvalue < 1e-3


def test_magicdec_greedy_identical_to_oracle_and_cache_is_sinks_plus_window(arch):
    target = sharpen((tiny_llama if arch == "llama" else tiny_qwen2)(seed=0, max_pos=512), 4.0)
    prompt = _prompt(120, seed=2)
    oracle = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=40)
    sink, window = 4, 16
    seen_layouts = []

    class Checked(MagicDecDrafter):
        def propose(self, ctx, budget):
            tree = super().propose(ctx, budget)
            if not len(tree):  # no budget left: nothing fed, nothing to check
                return tree
            c = self.cache
            assert c.positions == list(range(sink)) + list(range(c.seen - window, c.seen))
            assert c.seen == len(ctx.tokens)
            assert len(c) == sink + window + max(0, len(tree) - 1)  # plus this step's draft tokens
            seen_layouts.append(c.seen)
            return tree

    out = _run(target, Checked(target, gamma=6, sink=sink, window=window), prompt, max_new=40)
    assert out == oracle
    assert len(seen_layouts) >= 2
    # the default window follows the context (RAPID's retrieval budget: at least 1,024 tokens); where sinks + window
    # hold the whole context the draft would be the target itself: the drafter declines and every step is plain
    default = MagicDecDrafter(target, gamma=6)
    assert _run(target, default, prompt, max_new=40) == oracle
    assert default.kv_budget == sink + 1024 and default.cache is None and default.state_bytes() == 0


def test_sink_window_cache_copies_exactly_the_sink_and_window_slices(target):
    prompt = _prompt(50, seed=3)
    ver = Verifier(target)
    ver.prefill(prompt)
    full = ver.kv.layer_tensors()
    cache = SinkWindowCache.from_layers(target.config, full, sink=4, window=10)
    keep = list(range(4)) + list(range(40, 50))
    assert cache.positions == keep and len(cache) == 14
    for (k, v), (k2, v2) in zip(full, cache.layer_tensors()):
        assert torch.equal(k[..., keep, :], k2) and torch.equal(v[..., keep, :], v2)
    small = SinkWindowCache.from_layers(target.config, full, sink=4, window=100)
    assert small.positions == list(range(50))


def test_prefill_memo_gives_identical_outputs(target):
    sharpen(target, 4.0)
    prompt = _prompt(70, seed=4)
    memo = PrefillMemo()
    first = _run(target, NoDraft(), prompt, memo=memo)
    again = _run(target, MagicDecDrafter(target, gamma=5, sink=2, window=8), prompt, memo=memo)
    fresh = _run(target, NoDraft(), prompt)
    assert memo.hits == 1 and memo.seconds > 0
    assert first == again == fresh
