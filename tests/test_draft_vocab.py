"""Drafts with a reduced vocabulary (``draft_vocab.json``; ``train.real_draft``): the draft proposes only from a
subset of the target's tokens, q = 0 elsewhere. Greedy output equals the oracle token for token; sampled output
follows the target's law (chi-square on the first three tokens, as in ``test_engine_sampling``); the
target-initialised draft and the vocabulary mapper behave as documented."""

from __future__ import annotations

import numpy as np
import torch

from retrospec.drafters import REGISTRY
from retrospec.drafters.small_lm import SmallLMDrafter
from retrospec.models.vocab import VocabMap
from retrospec.train.real_draft import init_from_target, select_vocab


def reduced_draft(target, vocab_ids, layers=(0,), scale: float | None = None):
    draft = init_from_target(target, layers, vocab_ids).eval()
    if scale is not None:
        with torch.no_grad():
            draft.get_output_embeddings().weight.mul_(scale)
    return draft


def test_init_from_target_copies_rows_and_blocks():
    from conftest import tiny_llama

    target = tiny_llama(seed=3, layers=2)
    ids = [0, 5, 9, 17, 40, 95]
    draft = reduced_draft(target, ids)
    assert draft.config.vocab_size == len(ids) and draft.config.num_hidden_layers == 1
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight[ids])
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight[ids])
    for (n, a), (_, b) in zip(draft.model.layers[0].state_dict().items(), target.model.layers[0].state_dict().items()):
        assert torch.equal(a, b), n


def test_vocab_mapper_and_selection():
    m = VocabMap([0, 4, 7], target_vocab=10)
    assert m.to_draft.tolist() == [0, 0, 0, 0, 1, 0, 0, 2, 0, 0]  # outside the subset: the row of target id 0
    assert m.covered.tolist() == [True, False, False, False, True, False, False, True, False, False]
    full = m.scatter(torch.tensor([[1.0, 2.0, 3.0]]))  # [1, Vd] -> [1, V]
    assert full[0, [0, 4, 7]].tolist() == [1.0, 2.0, 3.0] and torch.isinf(full[0, m.ids.new_tensor([1, 2, 9])]).all()
    assert VocabMap([3, 5], target_vocab=6).to_draft.tolist() == [0, 0, 0, 0, 0, 1]  # id 0 not covered: row 0
    streams = {"a": np.array([1, 1, 1, 2, 2, 3]), "b": np.array([5, 5, 6])}
    assert select_vocab(streams, {"a": 1.0, "b": 1.0}, 3, always=[0]) == [0, 1, 5]
    assert select_vocab(streams, {"a": 1.0, "b": 0.0}, 3, always=[9]) == [1, 2, 9]


def test_greedy_reduced_vocab_equals_oracle(target, arch):
    from test_engine_greedy import PROMPT, check_stats, oracle, run

    from conftest import sharpen

    target = sharpen(target)
    vocab_ids = sorted(set(range(0, 96, 2)) | set(PROMPT))
    # all of the target's blocks: the draft agrees with the target exactly when p's argmax is in its vocabulary
    draft = reduced_draft(target, vocab_ids, layers=(0, 1))
    drafter = REGISTRY["sd"](draft_model=draft, gamma=4,
                             **{"draft": _Loaded(torch.tensor(vocab_ids)), "target": _Loaded(None, 96)})
    assert isinstance(drafter, SmallLMDrafter) and drafter.vmap is not None
    proposed: list[int] = []
    original = drafter.propose

    def spy(ctx, budget):
        tree = original(ctx, budget)
        proposed.extend(tree.tokens.tolist())
        return tree

    drafter.propose = spy
    out, stats, chunks = run(target, drafter)
    assert out == oracle(target)
    check_stats(stats, out, chunks)
    assert proposed and set(proposed) <= set(vocab_ids)  # never a token outside the draft's vocabulary
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # accepted in-vocabulary, rejected outside


class _Loaded:
    """Stands in for a ``LoadedModel`` (the factory reads ``vocab_map`` and ``vocab_size`` only)."""

    def __init__(self, vocab_map, vocab_size=None, model=None):
        self.vocab_map, self.vocab_size, self.model = vocab_map, vocab_size, model


def test_sampling_reduced_vocab_follows_target_law():
    from test_engine_sampling import (ALPHA, N_RUNS, T1, V, chisq_pvalue, exact_law, joint_groups, sample_runs,
                                      third_groups, tiny)

    target = tiny(seed=11, scale=8.0)
    vocab_ids = [0, 1, 2, 4, 5, 7, 9, 10]  # q = 0 on 3, 6, 8, 11
    draft = reduced_draft(target, vocab_ids, scale=3.0)
    opts = {"draft": _Loaded(torch.tensor(vocab_ids)), "target": _Loaded(None, V)}
    counts, stats = sample_runs(target, lambda: REGISTRY["sd"](draft_model=draft, gamma=2, **opts), T1,
                                range(7_000_000, 7_000_000 + N_RUNS))
    assert stats.drafted_tokens >= 2 * N_RUNS
    assert 0.03 * stats.drafted_tokens < stats.accepted_tokens < stats.drafted_tokens
    p1, p2, p3 = exact_law(target, T1)
    c12 = counts.sum(2)
    assert chisq_pvalue(joint_groups(c12, p1, p2)) > ALPHA
    assert chisq_pvalue(third_groups(counts, p3)) > ALPHA
    # tokens outside the draft vocabulary still appear (recovered from the residual), as often as p says
    outside = [3, 6, 8, 11]
    assert counts[outside].sum() > 0
    # power: the draft's own (scattered) law is rejected by the same histogram
    draft_full = _ScatteredDraft(draft, torch.tensor(vocab_ids), V)
    q1, q2, _ = exact_law(draft_full, T1)
    assert chisq_pvalue(joint_groups(c12, q1, q2), strict=False) < 1e-6


class _ScatteredDraft(torch.nn.Module):
    """The reduced draft seen over the full vocabulary (logits -inf off its subset), for the power check."""

    def __init__(self, draft, vocab_ids, v):
        super().__init__()
        self.draft, self.ids, self.v = draft, vocab_ids, v
        self.vmap = VocabMap(vocab_ids, v)

    def forward(self, input_ids):
        logits = self.draft(input_ids=self.vmap.to_draft[input_ids]).logits  # [B, L, Vd]
        return type("Out", (), {"logits": self.vmap.scatter(logits)})()  # [B, L, V], -inf off the subset



def test_full_vocab_draft_for_hf_matches_the_drafter_and_is_cached_weakly():
    """``bench.hf_peers.full_vocab_draft`` (transformers' view of a reduced draft) reads what our drafter reads and
    puts the draft's logits at their target ids; it is built once per draft module, and freed with it."""
    import gc

    from conftest import tiny_llama

    from retrospec.bench import hf_peers

    target = tiny_llama(seed=3, layers=2)
    vocab_ids = [0, 5, 9, 17, 40, 95]
    draft = reduced_draft(target, vocab_ids)
    full = hf_peers.full_vocab_draft(_Loaded(torch.tensor(vocab_ids), model=draft), 96)
    assert hf_peers.full_vocab_draft(_Loaded(torch.tensor(vocab_ids), model=draft), 96) is full
    vmap = VocabMap(vocab_ids, 96)
    ids = torch.tensor([[5, 3, 40, 95, 9]])  # 3 is off the subset: read as the row of target id 0
    with torch.no_grad():
        want = vmap.scatter(draft(input_ids=vmap.to_draft[ids]).logits, fill=0.0)  # [1, 5, 96]
        torch.testing.assert_close(full(input_ids=ids).logits, want)
    assert len(hf_peers._FULL_VOCAB) >= 1
    n = len(hf_peers._FULL_VOCAB)
    del draft
    gc.collect()
    assert len(hf_peers._FULL_VOCAB) == n - 1
