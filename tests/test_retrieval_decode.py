"""rest and dresd through the engine: greedy output token-identical to the oracle (Llama and Qwen2), and exact
sampling (chi-square of the first generated tokens against the target's law)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

import retrospec
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.retrieval import build_dense_store, build_suffix_store
from retrospec.retrieval.corpus import TokenDoc
from retrospec.retrieval.store import target_meta, tokenizer_meta
from retrospec.sampling import probs_from_logits
from retrospec.types import SpecStats

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingConfig()


def make_stores(model, docs, root, vocab, pca_dims=8):
    eos = vocab - 1
    tok = tokenizer_meta(None, vocab, eos)
    build_suffix_store(docs, root / "suffix", tokenizer_info=tok, corpus={"description": "test"}, progress=False)
    build_dense_store(model, docs, root / "dense", tokenizer_info=tok, target_info=target_meta(model, "tiny"),
                      corpus={"description": "test"}, pca_dims=pca_dims, progress=False)
    return {"rest": root / "suffix", "dresd": root / "dense"}


def run(model, method, store, prompt, sampling, max_new, eos=frozenset(), **opts):
    stats = SpecStats()
    drafter = REGISTRY[method](datastore=store, target=model, **opts)
    out = [t for c in speculative_generate(model, drafter, prompt, sampling=sampling, max_new_tokens=max_new,
                                           eos_ids=eos, stats=stats) for t in c]
    return out, stats


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def greedy_setup(request, tmp_path_factory):
    from conftest import VOCAB, sharpen, tiny_llama, tiny_qwen2

    model = sharpen((tiny_llama if request.param == "llama" else tiny_qwen2)(seed=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB - 2, size=int(rng.integers(3, 12))).tolist() for _ in range(10)]
    # ID documents: the model's own greedy continuations of *other* prompts; plus some raw random text (OOD)
    docs = [TokenDoc(np.asarray(p + autoregressive_generate(model, p, sampling=GREEDY, max_new_tokens=60),
                                dtype=np.int32), index_from=len(p)) for p in prompts[4:]]
    docs += [TokenDoc(rng.integers(0, VOCAB - 2, size=200).astype(np.int32)) for _ in range(3)]
    stores = make_stores(model, docs, tmp_path_factory.mktemp(f"stores-{request.param}"), VOCAB)
    return model, prompts[:4], stores


RANKED = [("rest", {}), ("dresd", {}), ("dresd", {"rank": "nearest"})]  # (method, options)


@pytest.mark.parametrize("method,opts", RANKED)
@pytest.mark.parametrize("shape", [{}, {"num_drafts": 1, "draft_len": 4}, {"num_drafts": 5, "draft_len": 3}])
def test_greedy_equals_oracle(greedy_setup, method, opts, shape):
    shape = shape | opts
    model, prompts, stores = greedy_setup
    accepted = 0
    for prompt in prompts:
        want = autoregressive_generate(model, prompt, sampling=GREEDY, max_new_tokens=40)
        got, stats = run(model, method, stores[method], prompt, GREEDY, 40, **shape)
        assert got == want
        accepted += stats.accepted_tokens
        assert stats.target_calls <= stats.new_tokens
    assert accepted > 0  # the retrieved drafts were really used


def test_greedy_through_the_api_with_eos(greedy_setup):
    model, prompts, stores = greedy_setup
    eos = frozenset({model.config.eos_token_id})
    for method in ("rest", "dresd"):
        res = retrospec.generate(prompts[0], target=model, method=method, datastore=stores[method], num_drafts=2,
                                 draft_len=6, max_new_tokens=30)
        assert res.token_ids == autoregressive_generate(model, prompts[0], sampling=GREEDY, max_new_tokens=30,
                                                        eos_ids=eos)
        assert res.stats.method == method


def test_missing_or_wrong_datastore_is_a_user_error(greedy_setup):
    model, prompts, stores = greedy_setup
    with pytest.raises(retrospec.RetrospecError, match="needs a suffix datastore"):
        retrospec.generate(prompts[0], target=model, method="rest", max_new_tokens=4)
    with pytest.raises(retrospec.RetrospecError, match="needs a dense store"):
        retrospec.generate(prompts[0], target=model, method="dresd", datastore=stores["rest"], max_new_tokens=4)
    with pytest.raises(retrospec.RetrospecError, match="draft_len must be"):
        retrospec.generate(prompts[0], target=model, method="rest", datastore=stores["rest"], draft_len=0)
    with pytest.raises(retrospec.RetrospecError, match="rank must be one of votes, nearest"):
        retrospec.generate(prompts[0], target=model, method="dresd", datastore=stores["dresd"], rank="best")


class FakeDense:
    """Neighbours in similarity order with fixed values [x_{t+1}, continuation...] (EOS = 9)."""

    value_len, eos_id = 4, 9

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int32)  # [n, 1 + 4]

    def search(self, hidden, k):
        ids = np.arange(min(k, len(self.values)))[None]
        return np.zeros(ids.shape, np.float32), ids


def test_dresd_ranks_continuations_by_votes_or_by_similarity():
    from test_retrieval_suffix import paths

    from retrospec.drafters.base import DecodeContext
    from retrospec.drafters.dresd import DresdDrafter

    store = FakeDense([[5, 1, 2, 3, 4],  # nearest, but alone
                       [6, 7, 7, 7, 7],  # fails the token filter (did not produce the last token, 5)
                       [5, 2, 9, 8, 8],  # ends at EOS: nothing after it is drafted
                       [5, 2, 9, 3, 3],
                       [5, 2, 3, 1, 1]])
    ctx = DecodeContext(tokens=[0, 5], prompt_len=1, sampling=GREEDY)
    h = np.zeros(4, np.float32)

    votes = DresdDrafter(store, num_drafts=1, draft_len=2)
    votes.prefill(ctx)
    assert paths(votes.tree(votes.continuations(h, 5), 60)) == {(2,), (2, 9)}  # 3 votes for 2, 2 of them for 2 -> EOS
    nearest = DresdDrafter(store, num_drafts=2, draft_len=4, rank="nearest")
    nearest.prefill(ctx)
    assert nearest.drafts(nearest.continuations(h, 5)) == [[1, 2, 3, 4], [2, 9]]  # similarity order, cut after EOS
    full = DresdDrafter(store, num_drafts=3, draft_len=4)
    full.prefill(ctx)
    assert paths(full.tree(full.continuations(h, 5), 60)) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (2,), (2, 9),
                                                              (2, 3), (2, 3, 1), (2, 3, 1, 1)}  # nothing after an EOS


# ---- sampling: chi-square on the first generated tokens ------------------------------------------------------------

V = 8
PROMPT = [3, 1, 4, 1]
N_RUNS = 2_000
MAX_NEW = 5  # the first step drafts trees at most MAX_NEW - 2 = 3 deep: x2, x3 are accepted, recovered or bonus tokens
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    from conftest import sharpen, tiny_llama

    model = sharpen(tiny_llama(seed=21, layers=1, hidden=16, vocab=V), 3.0)
    # the store holds the model's own samples, so drafts are often (not always) accepted
    docs = []
    for i in range(40):
        s = SamplingConfig(temperature=1.0, seed=10_000 + i)
        docs.append(TokenDoc(np.asarray(PROMPT + autoregressive_generate(model, PROMPT, sampling=s, max_new_tokens=12),
                                        dtype=np.int32)))
    return model, make_stores(model, docs, tmp_path_factory.mktemp("sampling-stores"), V, pca_dims=4)


@torch.inference_mode()
def exact_law(model):
    base = torch.tensor(PROMPT)
    one = torch.stack([torch.cat([base, torch.tensor([a])]) for a in range(V)])  # [V, L + 1]
    two = torch.stack([torch.cat([base, torch.tensor([a, b])]) for a in range(V) for b in range(V)])  # [V^2, L + 2]
    p1 = probs_from_logits(model(input_ids=base[None]).logits[0, -1], T1).double().numpy()  # [V]
    p2 = probs_from_logits(model(input_ids=one).logits[:, -1], T1).double().numpy()  # [V, V]
    p3 = probs_from_logits(model(input_ids=two).logits[:, -1], T1).double().numpy().reshape(V, V, V)
    return p1, p2, p3


def chisq(groups) -> float:
    """Pearson chi-square over (observed, expected) groups; cells with expected < 5 pooled per group."""
    stat, df = 0.0, 0
    for obs, exp in groups:
        obs, exp = np.asarray(obs, float).ravel(), np.asarray(exp, float).ravel()
        big = exp >= 5
        o, e = list(obs[big]), list(exp[big])
        if exp[~big].sum() > 0:
            o.append(obs[~big].sum())
            e.append(exp[~big].sum())
        if len(e) >= 2:
            stat += float(((np.array(o) - np.array(e)) ** 2 / np.array(e)).sum())
            df += len(e) - 1
    return float(sps.chi2.sf(stat, df))


@pytest.mark.parametrize("method,opts", RANKED)
def test_sampling_follows_the_target_law(sampling_setup, method, opts):
    model, stores = sampling_setup
    p1, p2, p3 = exact_law(model)
    counts = np.zeros((V, V, V), dtype=np.int64)
    drafter = REGISTRY[method](datastore=stores[method], target=model, **opts)  # sampling defaults: 10 x 10
    drafted = accepted = 0
    for seed in range(N_RUNS):
        stats = SpecStats()
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        out = [t for c in speculative_generate(model, drafter, PROMPT, sampling=sampling, max_new_tokens=MAX_NEW,
                                               stats=stats) for t in c]
        counts[out[0], out[1], out[2]] += 1
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    assert 0.02 * drafted < accepted < 0.9 * drafted  # drafts were accepted and rejected (wide trees: most rejected)
    c12 = counts.sum(2)
    assert chisq([(c12, p1[:, None] * p2 * N_RUNS)]) > 1e-3
    groups = [(counts[a, b], p3[a, b] * counts[a, b].sum()) for a in range(V) for b in range(V) if counts[a, b].sum()]
    assert chisq(groups) > 1e-3
    # power: the same histogram rejects a different law (the same model at temperature 0.6)
    hot = SamplingConfig(temperature=0.6)
    with torch.inference_mode():
        base = torch.tensor(PROMPT)
        one = torch.stack([torch.cat([base, torch.tensor([a])]) for a in range(V)])
        q1 = probs_from_logits(model(input_ids=base[None]).logits[0, -1], hot).double().numpy()
        q2 = probs_from_logits(model(input_ids=one).logits[:, -1], hot).double().numpy()
    assert chisq([(c12, q1[:, None] * q2 * N_RUNS)]) < 1e-4
