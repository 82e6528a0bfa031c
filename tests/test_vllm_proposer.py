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
from retrospec.retrieval.served import (SEPARATOR, SIMILARITY_WEIGHT, ServedStore, context_candidates, follow_context,
                                        majority_chain, prompt_sketch, vote_chain)


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


def test_served_store_finds_every_recent_match_with_its_length():
    store = ServedStore(64, min_suffix=2)
    store.add([1, 2, 3, 4, 5])
    store.add([9, 2, 3, 7, 8])

    def found(query):
        match, nxt, _, _ = store.candidates(query)
        return list(zip(match.tolist(), nxt.tolist()))

    assert found([2, 3]) == [(2, 7), (2, 4)]  # most recent first
    assert found([1, 2, 3]) == [(2, 7), (3, 4)]
    assert found([3, 3]) == [(1, 7), (1, 4)]  # never served as a pair: its last token's positions
    assert found([SEPARATOR]) == [(1, 9), (1, 1)]  # a separator: where outputs start
    assert found([5]) == [] and found([]) == []  # 5 ends an output: nothing follows it


def _naive_candidates(served: list[list[int]], capacity: int, n: int, max_suffix: int, max_hits: int, query):
    """``ServedStore.candidates`` written plainly: the most recent kept positions ending the query's last n tokens
    (else its last token), those with a next token, each with its match length and next token."""
    flat = [SEPARATOR] + [t for out in served for t in (list(out[-(capacity - 1):]) + [SEPARATOR])]
    oldest = max(0, len(flat) - capacity)
    q = list(query[-max_suffix:])
    if not q:
        return []
    ends = []
    if len(q) >= n and SEPARATOR not in q[-n:]:
        ends = [g for g in range(len(flat) - 1, oldest - 1, -1)
                if g - n + 1 >= oldest and flat[g - n + 1 : g + 1] == q[-n:]][:max_hits]
    if not ends:
        ends = [g for g in range(len(flat) - 1, oldest - 1, -1) if flat[g] == q[-1]][:max_hits]
    out = []
    for g in ends:
        if g + 1 < len(flat) and flat[g + 1] != SEPARATOR:
            m = 0
            while m < len(q) and g - m >= oldest and flat[g - m] == q[-1 - m]:
                m += 1
            out.append((m, flat[g + 1]))
    return out


@settings(max_examples=60, deadline=None)
@given(outputs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=12),
       start=st.booleans(), query=st.lists(st.integers(0, 4), min_size=0, max_size=8), capacity=st.integers(4, 40))
@example(outputs=[[0, 0], [0]], start=False, query=[0, 0], capacity=4)  # an n-gram whose first token was evicted
def test_served_store_votes_come_from_the_naive_search(outputs, start, query, capacity):
    store = ServedStore(capacity, min_suffix=2, max_suffix=6, max_hits=5)
    for out in outputs:
        store.add(out)
    q = [SEPARATOR] * start + query  # a separator stands for the start of an output
    match, nxt, factor, at = store.candidates(q)
    assert list(zip(match.tolist(), nxt.tolist())) == _naive_candidates(outputs, capacity, 2, 6, 5, q)
    assert (factor == 1.0).all()  # no prompt sketches: every served output weighs the same
    # the positions that voted for a token, moved on by one, are among the naive search's for the query + that token,
    # with one more token of match (at most the query's width) and the same next token
    for token in set(nxt.tolist()):
        keep = nxt == token
        at1, nxt1, ok = store.follow(at[keep])
        naive = _naive_candidates(outputs, capacity, 2, 6, 10**6, q + [token])
        for m, n in zip(np.minimum(match[keep][ok] + 1, 6).tolist(), nxt1[ok].tolist()):
            assert (min(m, len((q + [token])[-6:])), n) in naive
        assert not ok.any() or (store.tokens[at1[ok] % capacity] == token).all()


def test_a_chain_is_voted_token_by_token_and_similar_prompts_weigh_more():
    store = ServedStore(64, min_suffix=2)
    asked = [[10, 11, 12, 13, 14, 15, 16, 17], [30, 31, 32, 33, 34, 35, 36, 37]]
    store.add([1, 2, 3, 4, 5], prompt_sketch(asked[0]))
    store.add([1, 2, 3, 6, 7], prompt_sketch(asked[1]))

    def served(sketch):
        return lambda chain: store.candidates([SEPARATOR, 1, *chain], sketch)

    def follow(at, chain):
        return store.follow(at)

    for refresh in (0, 10**6):  # following the voters, or searching again at every token: the same chains here
        assert vote_chain(served(None), follow, 4, refresh) == ([2, 3, 4, 5], 2)  # a tie: the smaller id
        again = [10, 11, 12, 13, 14, 15, 16, 99]  # the first prompt again, its last word changed
        assert vote_chain(served(prompt_sketch(again)), follow, 4, refresh) == ([2, 3, 4, 5], 2)
        assert vote_chain(served(prompt_sketch(asked[1])), follow, 4, refresh) == ([2, 3, 6, 7], 2)
    sim = store.similarity(np.array([0, 1]), prompt_sketch(asked[1]))
    assert sim[1] == 1.0 and sim[0] < 0.5 and store.candidates([SEPARATOR, 1], prompt_sketch(asked[1]))[2].max() == (
        1 + SIMILARITY_WEIGHT)
    # a longer match outweighs more numerous shorter ones: 4 is followed by 9 three times, by 5 once after "7, 4"
    ctx = [4, 9, 8, 4, 9, 8, 4, 9, 8, 7, 4, 5, 6, 7, 4]
    m, nxt, at = context_candidates(ctx, 8)
    assert sorted(zip(m.tolist(), nxt.tolist())) == [(1, 9), (1, 9), (1, 9), (2, 5)]
    assert (np.asarray(ctx)[at] == 4).all() and (np.asarray(ctx)[at + 1] == nxt).all()

    def own(chain):
        match, after, where = context_candidates(ctx + chain, 8)
        return match, after, np.ones(len(match)), where

    for refresh in (0, 10**6):
        assert vote_chain(own, lambda at, chain: follow_context(ctx + chain, at), 3, refresh) == ([5, 6, 7], 2)
    nothing = (np.zeros(0, dtype=np.int64),) * 2 + (np.zeros(0), np.zeros(0, dtype=np.int64))
    assert vote_chain(lambda chain: nothing, None, 3) == ([], 0)


def test_served_store_memory_is_bounded_and_the_oldest_go_first():
    store = ServedStore(100, min_suffix=2)
    rng = np.random.default_rng(0)
    store.add([1000, 1001, 1002, 1003])
    assert store.candidates([1000, 1001])[1].tolist() == [1002]
    for _ in range(200):
        store.add(rng.integers(0, 500, size=20))
    assert len(store.candidates([1000, 1001])[1]) == 0  # evicted
    assert store.tokens.shape == store.chain.shape == store.chain1.shape == store.owner.shape == (100,)
    assert len(store.heads) <= 100 and len(store.heads1) <= 100
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


def test_tracker_regrows_to_the_full_length_after_any_accepted_token():
    tracker = RequestTracker(k=6, regrow=True)
    rows = np.zeros((1, 32), dtype=np.int32)
    ids = [1, 2, 3]
    rows[0, :3] = ids
    (s,), _ = tracker.update([[3]], np.array([3]), rows)
    for proposed, sampled, k_after in ((6, [4], 5), (5, [5], 4), (4, [6, 7], 6), (6, [8], 5)):
        s.proposed = proposed
        ids += sampled
        rows[0, : len(ids)] = ids
        tracker.update([sampled], np.array([len(ids)]), rows)
        assert s.k == k_after


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
    # the request's own tokens and the served answer vote together, both followed token by token (a vote weighs
    # 8^match, the request's own 61 x that): the output so far is "40 41", the prompt holds "41 42 43 77"; the served
    # answer matches 2 tokens more (a separator, 40, 41) and outvotes the prompt's 77 (8^5 > 61 x 8^3) ...
    batch.ids = [[5, 99, 41, 42, 43, 77, 40, 41]]
    assert batch.call(proposer, [[40, 41]]) == [[42, 43, 44, 45]]
    # ... unless the prompt's run matches as far back ("40 41 42 43 77"): 77, then the prompt goes on alone (to 40)
    batch.ids = [[5, 40, 41, 42, 43, 77, 40, 41]]
    assert batch.call(proposer, [[40, 41]]) == [[42, 43, 77, 40]]


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
