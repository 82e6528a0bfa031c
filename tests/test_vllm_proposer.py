"""Our proposers' contract with vLLM (token ids in, chains out, per-request state freed), the served-output store
against a naive oracle (bounded memory, oldest out first), and REST over a retrospec datastore. vLLM itself is not
needed: the proposer sees only numpy rows and a config object."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from retrospec.errors import RetrospecError
from retrospec.integrations.vllm_proposer import (ADAPTIVE_ENV, DATASTORE_ENV, STATS_ENV, PromptLookupProposer,
                                                  RequestTracker, RestProposer, ServedOutputProposer)
from retrospec.retrieval.served import SEPARATOR, ServedStore, majority_chain


def _config(k: int, max_model_len: int = 64, model: str = ""):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=model,
                                                        trust_remote_code=False))


class Batch:
    """vLLM's side of the call: token rows [max_num_reqs, max_model_len] and per-row valid counts."""

    def __init__(self, max_reqs: int = 4, max_len: int = 64):
        self.rows = np.zeros((max_reqs, max_len), dtype=np.int32)
        self.ids: list[list[int]] = []

    def call(self, proposer, sampled: list[list[int]]):
        for i, ids in enumerate(self.ids):
            self.rows[i, : len(ids)] = ids
        counts = np.array([len(ids) for ids in self.ids] + [0] * (len(self.rows) - len(self.ids)))
        return proposer.propose(sampled, counts, self.rows)


# ---------------------------------------------------------------------------------------------- the served store


def test_majority_chain_follows_the_most_common_path():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 4], [5, 6, -1]])
    assert majority_chain(rows, 3) == [1, 2, 4]
    assert majority_chain(rows, 2) == [1, 2]
    assert majority_chain(rows[3:], 3) == [5, 6]  # stops at the continuation's end
    assert majority_chain(np.array([[7, 8], [9, 8]]), 2) == [7, 8]  # a tie goes to the earliest row
    assert majority_chain(rows, 3, min_share=0.6) == [1, 2]  # only 2 of 4 rows go on to 4


def test_served_store_drafts_the_continuation_of_the_longest_match():
    store = ServedStore(64, min_suffix=2)
    store.add([1, 2, 3, 4, 5])
    store.add([9, 2, 3, 7, 8])
    assert store.lookup([2, 3], 3) == (2, [7, 8])  # both match 2 tokens; the most recent wins the tie, then ends
    assert store.lookup([1, 2, 3], 3) == (3, [4, 5])  # the longer match decides
    assert store.lookup([3, 3], 3) == (0, [])  # never served
    assert store.lookup([4], 3) == (0, [])  # shorter than min_suffix


def _naive_lookup(served: list[list[int]], capacity: int, n: int, max_suffix: int, max_hits: int, context, k):
    """The same search written plainly over the flat list of kept positions."""
    flat = [t for out in served for t in (list(out[-(capacity - 1):]) + [SEPARATOR])]
    oldest = max(0, len(flat) - capacity)
    ctx = list(context[-max_suffix:])
    if len(ctx) < n:
        return 0, []
    ends = [g for g in range(len(flat) - 1, oldest - 1, -1)
            if g - n + 1 >= oldest and flat[g - n + 1 : g + 1] == ctx[-n:]][:max_hits]
    if not ends:
        return 0, []

    def back(g):
        m = 0
        while m < len(ctx) and g - m >= oldest and flat[g - m] == ctx[-1 - m]:
            m += 1
        return m

    best = max(back(g) for g in ends)
    rows = []
    for g in ends:
        if back(g) == best:
            cont = []
            for t in flat[g + 1 : g + 1 + k]:
                if t == SEPARATOR:
                    break
                cont.append(t)
            rows.append(cont + [SEPARATOR] * (k - len(cont)))
    return best, majority_chain(np.array(rows), k)


@settings(max_examples=60, deadline=None)
@given(outputs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=12),
       context=st.lists(st.integers(0, 4), min_size=0, max_size=8), capacity=st.integers(4, 40))
@example(outputs=[[0, 0], [0]], context=[0, 0], capacity=4)  # an n-gram whose first token was evicted: no match
def test_served_store_equals_the_naive_search(outputs, context, capacity):
    store = ServedStore(capacity, min_suffix=2, max_suffix=6, max_hits=5)
    for out in outputs:
        store.add(out)
    assert len(store) <= capacity and len(store.heads) <= capacity
    assert store.lookup(context, 4) == _naive_lookup(outputs, capacity, 2, 6, 5, context, 4)


def test_served_store_memory_is_bounded_and_the_oldest_go_first():
    store = ServedStore(100, min_suffix=2)
    rng = np.random.default_rng(0)
    store.add([1000, 1001, 1002, 1003])
    assert store.lookup([1000, 1001], 2) == (2, [1002, 1003])
    for _ in range(200):
        store.add(rng.integers(0, 500, size=20))
    assert store.lookup([1000, 1001], 2) == (0, [])  # evicted
    assert store.tokens.shape == store.chain.shape == (100,) and len(store.heads) <= 100
    assert store.outputs == 201
    with pytest.raises(ValueError):
        ServedStore(1)


# ------------------------------------------------------------------------------------------------- the tracker


def test_tracker_recognises_requests_where_their_rows_move_and_frees_the_finished():
    tracker = RequestTracker(k=6)
    rows = np.zeros((3, 16), dtype=np.int32)
    rows[0, :4], rows[1, :3] = [1, 2, 3, 4], [7, 8, 9]
    states, gone = tracker.update([[4], [9]], np.array([4, 3]), rows)
    a, b = states
    assert gone == [] and (a.prompt_len, b.prompt_len) == (3, 2) and (a.output, b.output) == ([4], [9])
    a.proposed = 3  # the proposer offered 3 tokens to a
    rows[:] = 0
    rows[0, :4] = [7, 8, 9, 10]  # b moved to row 0; a left the batch
    states, gone = tracker.update([[10]], np.array([4]), rows)
    assert states == [b] and gone == [a] and b.output == [9, 10] and b.steps == 2
    assert list(tracker.live.values()) == [b]  # a's state is no longer held


def test_tracker_adapts_each_requests_draft_length():
    tracker = RequestTracker(k=6)
    rows = np.zeros((1, 32), dtype=np.int32)
    ids = [1, 2, 3]
    rows[0, :3] = ids
    (s,), _ = tracker.update([[3]], np.array([3]), rows)
    assert s.k == 6
    for proposed, sampled, k_after in ((6, [4, 5], 5), (5, [6], 4), (4, [7, 8, 9, 10, 11], 6), (6, [12], 5)):
        s.proposed = proposed
        ids += sampled
        rows[0, : len(ids)] = ids
        (s2,), _ = tracker.update([sampled], np.array([len(ids)]), rows)
        assert s2 is s and s.k == k_after
    assert (s.drafted, s.accepted) == (21, 1 + 0 + 4 + 0)
    fixed = RequestTracker(k=6, adaptive=False)
    (f,), _ = fixed.update([[3]], np.array([3]), rows)
    f.proposed = 6
    fixed.update([[4]], np.array([4]), rows)
    assert f.k == 6


# ----------------------------------------------------------------------------------------------- the proposers


def test_served_output_proposer_drafts_what_an_earlier_request_answered(monkeypatch, tmp_path):
    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv(STATS_ENV, str(stats))
    monkeypatch.setenv(ADAPTIVE_ENV, "0")
    proposer = ServedOutputProposer(_config(k=4))
    proposer.load_model()
    batch = Batch()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    batch.ids = [[1, 2, 3, 40]]  # a first request: prompt [1, 2, 3], its first token sampled
    assert batch.call(proposer, [[40]]) == [[]]  # nothing served yet, nothing to look up in the prompt
    batch.ids = [[1, 2, 3] + answer]
    batch.call(proposer, [answer[1:]])
    batch.ids = [[5, 6, 40, 41]]  # a new request (another prompt) starts the same answer; the first one left
    drafts = batch.call(proposer, [[41]])
    assert drafts == [[42, 43, 44, 45]]
    assert proposer.served.outputs == 1 and len(proposer.tracker.live) == 1
    line = json.loads(stats.read_text())
    assert line == {"prompt_tokens": 3, "output_tokens": 8, "steps": 2, "drafted": 0, "accepted": 0}


def test_prompt_lookup_proposer_counts_what_was_accepted(monkeypatch, tmp_path):
    stats = tmp_path / "stats.jsonl"
    monkeypatch.setenv(STATS_ENV, str(stats))
    proposer = PromptLookupProposer(_config(k=3))
    batch = Batch()
    batch.ids = [[1, 2, 3, 1, 2]]
    assert batch.call(proposer, [[2]]) == [[3, 1, 2]]
    batch.ids = [[1, 2, 3, 1, 2, 3, 1, 9]]  # two of the three accepted, then the target's own token
    batch.call(proposer, [[3, 1, 9]])
    batch.ids = []
    assert batch.call(proposer, []) == []
    line = json.loads(stats.read_text())
    assert line == {"prompt_tokens": 4, "output_tokens": 4, "steps": 2, "drafted": 3, "accepted": 2}
    assert proposer.tracker.live == {}


def _suffix_store(path, tokenizer, docs):
    from retrospec.retrieval import build_suffix_store
    from retrospec.retrieval.corpus import TokenDoc
    from retrospec.retrieval.store import tokenizer_meta

    build_suffix_store([TokenDoc(np.asarray(d, dtype=np.int32)) for d in docs], path,
                       tokenizer_info=tokenizer_meta(tokenizer, len(tokenizer), tokenizer.eos_token_id),
                       corpus={"description": "test"}, progress=False)
    return path


def test_rest_proposer_drafts_the_datastores_most_common_continuation(saved_models, monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(saved_models.target)
    store = _suffix_store(tmp_path / "store", tok, [[10, 11, 12, 13, 14], [10, 11, 12, 20, 21], [10, 11, 12, 13, 15]])
    with pytest.raises(ValueError, match=DATASTORE_ENV):
        RestProposer(_config(k=3, model=str(saved_models.target)))
    monkeypatch.setenv(DATASTORE_ENV, str(store))
    proposer = RestProposer(_config(k=3, model=str(saved_models.target)))
    batch = Batch()
    batch.ids = [[50, 51, 10, 11]]
    assert batch.call(proposer, [[11]]) == [[12, 13, 14]]  # 2 of 3 continue with 13; the tie at 14/15 by rank
    other = AutoTokenizer.from_pretrained(saved_models.draft_other_tokens)
    monkeypatch.setenv(DATASTORE_ENV, str(_suffix_store(tmp_path / "other", other, [[1, 2, 3]])))
    with pytest.raises(RetrospecError, match="another tokenizer"):
        RestProposer(_config(k=3, model=str(saved_models.target)))
