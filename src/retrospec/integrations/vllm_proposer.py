"""retrospec's token-level drafters as vLLM proposers: our drafting inside the engine users move to for many clients.

vLLM (0.32 and its CPU build) loads an outside proposer without a fork::

    vllm serve MODEL --speculative-config '{"method": "custom_class", "num_speculative_tokens": 10,
        "model": "retrospec.integrations.vllm_proposer.ServedOutputProposer"}'

(``LLM(..., speculative_config={...})`` offline). vLLM builds the class with its config and, every step, calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``: per request of the batch, the tokens it just
sampled (empty while the request is still in prefill), how many tokens are valid in its row, and the rows
[max_num_reqs, max_model_len] of prompt + output ids. The answer is one chain of draft ids per request (possibly
empty); vLLM verifies them with its own rejection sampler, so the output is vLLM's greedy output whatever we propose
(``make peers-test`` checks that on real prompts).

Three proposers, one per source of drafts (the first two take, per request, the source whose matched suffix is
longest; ties: the order below):
- ``PromptLookupProposer``: ``drafters.prompt_lookup`` (Saxena, 2023) over the request's own prompt and output: our
  ``pld``'s drafts.
- ``RestProposer``: REST (He et al., NAACL 2024) over a retrospec suffix datastore (``retrospec datastore build
  --kind suffix``; the directory in ``RETROSPEC_DATASTORE``): the longest suffix's continuations, their most common
  path as the chain (vLLM verifies chains, not trees); prompt lookup too.
- ``ServedOutputProposer``: a ``retrieval.served.ServedStore`` fed every finished output of this engine process
  (SuffixDecoding's setting, Oliaro et al., 2024): repeated and similar requests draft from what was already served.
  Its chain is voted token by token (``retrieval.served.vote_chain``) by the positions matching the request's output
  so far in the served outputs (weighted by how similar the prompt each one answered is to the request's) and in the
  request's own prompt and output (prompt lookup, weighted ``OWN_FACTOR``); the datastore's chain instead when
  ``RETROSPEC_DATASTORE`` is set and it matches longer.

Per-request state: vLLM does not pass request ids to a ``custom_class`` proposer, so a request is recognised by its
row's content (the ids it had at the previous call are a prefix of its row now), wherever its row moved in the batch.
A request missing from a call has finished (or was preempted): its output goes into the served store and its state
is freed. Each request's draft length adapts (``RETROSPEC_ADAPTIVE``, on by default): +2 after a fully accepted chain,
-1 otherwise, between 1 and ``num_speculative_tokens``; ``ServedOutputProposer`` goes back to the full length after
any accepted token (a served answer that starts to match tends to go on matching).

Settings (vLLM passes only its own fields to a custom class, and zeroes ``prompt_lookup_*`` for one, so these come
from the environment of the process that loads the proposer): ``RETROSPEC_PLD_MAX_NGRAM`` / ``RETROSPEC_PLD_MIN_NGRAM``
(3 and 1, our ``pld``'s), ``RETROSPEC_DATASTORE``, ``RETROSPEC_SERVED_TOKENS`` (the served store's size in tokens,
default 1,048,576: 28 MiB), ``RETROSPEC_ADAPTIVE`` (0 = always ``num_speculative_tokens``), ``RETROSPEC_PROPOSER_STATS``
(a file: one JSON line per finished request: prompt and output tokens, steps, drafted and accepted tokens).

Needs of the methods that cannot live here: DReSD drafts from the target's hidden states (vLLM's EAGLE-3 path
computes them, in-tree, and a ``custom_class`` proposer is not handed them); LongSpec drafts over the target's KV
cache, which no engine exposes to a plugin.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..drafters.prompt_lookup import lookup_match
from ..retrieval.served import (SEPARATOR, ServedStore, context_candidates, follow_context, majority_chain,
                               prompt_sketch, vote_chain)

MAX_NGRAM_ENV, MIN_NGRAM_ENV = "RETROSPEC_PLD_MAX_NGRAM", "RETROSPEC_PLD_MIN_NGRAM"
DATASTORE_ENV, SERVED_ENV = "RETROSPEC_DATASTORE", "RETROSPEC_SERVED_TOKENS"
ADAPTIVE_ENV, STATS_ENV = "RETROSPEC_ADAPTIVE", "RETROSPEC_PROPOSER_STATS"


EDGE = 32  # ids kept from each end of a request's row to recognise it at the next call
OWN_FACTOR = 61.0  # ServedOutputProposer: a vote from the request's own tokens, against 1-21 for a served output's
MAX_SUFFIX = 32  # ... and the longest match a vote counts


def _edges(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row's first and last EDGE ids (copies: vLLM reuses its buffer)."""
    return row[:EDGE].copy(), row[-EDGE:].copy() if len(row) else row[:0].copy()


@dataclass
class RequestState:
    """What the proposer keeps for one live request (freed when it leaves the batch)."""

    seen: int  # tokens of the row taken in so far
    head: np.ndarray  # [<= EDGE] row[:EDGE] at the last call
    tail: np.ndarray  # [<= EDGE] row[seen - EDGE:seen] at the last call
    k: int  # its current draft length
    prompt_len: int = -1  # known at its first sampled token
    output: list[int] = field(default_factory=list)
    proposed: int = 0  # length of the chain proposed at the last call
    steps: int = 0  # calls that brought sampled tokens (target forwards that produced output)
    drafted: int = 0
    accepted: int = 0
    sketch: np.ndarray | None = None  # [SKETCH] its prompt's sketch (ServedOutputProposer)


class RequestTracker:
    """Recognises requests across calls by their rows' content and adapts each one's draft length (see the module
    docstring). A request is the one whose row, cut to its previous length, has the same first and last ``EDGE`` ids
    (constant work per row; a mix-up of two requests alike at both ends could only change drafts, never what vLLM
    outputs)."""

    def __init__(self, k: int, adaptive: bool = True, regrow: bool = False):
        self.k, self.adaptive, self.regrow = k, adaptive, regrow  # regrow: full length again after any accepted token
        self.live: dict[int, RequestState] = {}  # row index at the last call -> state

    def update(self, sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
               token_ids: np.ndarray) -> tuple[list[RequestState], list[RequestState]]:
        """sampled_token_ids [R] lists; num_tokens [R]; token_ids [>= R, max_len] -> (per row its state, the states
        of requests that have left)."""
        previous, claimed = self.live, set()
        states: list[RequestState] = []
        for i, sampled in enumerate(sampled_token_ids):
            row = token_ids[i, : int(num_tokens[i])]
            state = self._find(row, previous, claimed, hint=i)
            if state is None:
                state = RequestState(seen=0, head=row[:0].copy(), tail=row[:0].copy(), k=self.k)
            self._take_in(state, row, sampled)
            states.append(state)
        self.live = dict(enumerate(states))
        return states, [s for slot, s in previous.items() if slot not in claimed]

    @staticmethod
    def _find(row: np.ndarray, previous: dict[int, RequestState], claimed: set[int], hint: int) -> RequestState | None:
        def same(slot: int) -> bool:
            state = previous[slot]
            n = state.seen
            return (slot not in claimed and n <= len(row) and np.array_equal(row[: len(state.head)], state.head)
                    and np.array_equal(row[n - len(state.tail) : n], state.tail))

        # the row's own slot first (the common case: constant work per row); the others only when rows moved
        slot = hint if hint in previous and same(hint) else next((s for s in previous if s != hint and same(s)), None)
        if slot is None:
            return None
        claimed.add(slot)
        return previous[slot]

    def _take_in(self, state: RequestState, row: np.ndarray, sampled: list[int]) -> None:
        if len(sampled):
            if state.prompt_len < 0:
                state.prompt_len = len(row) - len(sampled)
            state.steps += 1
            if state.proposed:
                got = len(sampled) - 1  # tokens of the last chain the target accepted
                state.drafted += state.proposed
                state.accepted += got
                if self.adaptive and self.regrow:
                    state.k = self.k if got else max(1, state.k - 1)
                elif self.adaptive:
                    state.k = min(self.k, state.k + 2) if got >= state.proposed else max(1, state.k - 1)
                state.proposed = 0
        if state.prompt_len >= 0:
            state.output.extend(row[max(state.seen, state.prompt_len):].tolist())
        state.seen = len(row)
        state.head, state.tail = _edges(row)


class PromptLookupProposer:
    """A vLLM ``custom_class`` proposer (see the module docstring): prompt lookup, per-request adaptive length."""

    regrow = False  # the tracker's rule: full length again after any accepted token (else +2 after a full chain)

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_ngram = int(os.environ.get(MAX_NGRAM_ENV, "3"))
        self.min_ngram = int(os.environ.get(MIN_NGRAM_ENV, "1"))
        if self.k < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need num_speculative_tokens >= 1 and 1 <= {MIN_NGRAM_ENV} <= {MAX_NGRAM_ENV}, got "
                             f"{self.k}, {self.min_ngram}, {self.max_ngram}")
        self.tracker = RequestTracker(self.k, adaptive=os.environ.get(ADAPTIVE_ENV, "1") != "0", regrow=self.regrow)
        self.stats_path = os.environ.get(STATS_ENV) or None
        self.datastore = None
        self.served: ServedStore | None = None

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM calls this on every proposer)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                *args, **kwargs) -> list[list[int]]:
        """sampled_token_ids: per request the ids sampled this step ([] = not decoding); num_tokens_no_spec [R];
        token_ids_cpu [R_max, max_model_len] -> per request a draft chain of at most its draft length (room left
        in the model's length permitting)."""
        states, finished = self.tracker.update(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        for state in finished:
            self.finish(state)
        drafts = []
        for i, (sampled, state) in enumerate(zip(sampled_token_ids, states, strict=True)):
            n = int(num_tokens_no_spec[i])
            room = min(state.k, self.max_model_len - n - 1)
            chain = self.draft(token_ids_cpu[i, :n], room, state) if len(sampled) and room >= 1 else []
            state.proposed = len(chain)
            drafts.append(chain)
        return drafts

    def draft(self, context: np.ndarray, k: int, state: RequestState | None = None) -> list[int]:
        """context [n] (prompt and output so far) -> the chain of the source with the longest matched suffix (ties:
        prompt, datastore)."""
        best_len, best = lookup_match(context, k, self.max_ngram, self.min_ngram)
        return self.datastore_chain(context, k, best_len, best)

    def datastore_chain(self, context: np.ndarray, k: int, best_len: int, best: list[int]) -> list[int]:
        """The datastore's chain where it matches longer than ``best_len``, else ``best``."""
        if self.datastore is not None:
            match = self.datastore.search(context)
            if match is not None and match.length > best_len:
                rows = self.datastore.sample(match, k)  # [S, k], -1 after an EOS
                chain = majority_chain(rows, k)
                if chain:
                    best = chain
        return best

    def finish(self, state: RequestState) -> None:
        """A request left the batch: its output feeds the served store (if any) and the stats file."""
        if self.served is not None and state.output:
            self.served.add(state.output, state.sketch)
        if self.stats_path:
            line = {"prompt_tokens": max(state.prompt_len, 0), "output_tokens": len(state.output), "steps": state.steps,
                    "drafted": state.drafted, "accepted": state.accepted}
            with open(self.stats_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")


def _open_datastore(vllm_config):
    """The suffix datastore named by RETROSPEC_DATASTORE (None if unset), checked against the served model's
    tokenizer (a store built for another vocabulary is refused with one line)."""
    path = os.environ.get(DATASTORE_ENV)
    if not path:
        return None
    from transformers import AutoTokenizer

    from ..retrieval import open_store

    model = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
    return open_store(path, "suffix", tokenizer=tokenizer)


class RestProposer(PromptLookupProposer):
    """REST over the suffix datastore in ``RETROSPEC_DATASTORE``, with prompt lookup (see the module docstring)."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.datastore = _open_datastore(vllm_config)
        if self.datastore is None:
            raise ValueError(f"RestProposer needs {DATASTORE_ENV}=DIR, a suffix datastore "
                             f"('retrospec datastore build --kind suffix')")


class ServedOutputProposer(PromptLookupProposer):
    """Drafts from the outputs this engine has served and the request's own tokens, by vote (and a datastore when one
    is set; see the module docstring)."""

    regrow = True

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.served = ServedStore(int(os.environ.get(SERVED_ENV, str(1 << 20))), max_suffix=MAX_SUFFIX, max_hits=64)
        self.datastore = _open_datastore(vllm_config)

    def draft(self, context: np.ndarray, k: int, state: RequestState | None = None) -> list[int]:
        start = state.prompt_len if state is not None and state.prompt_len >= 0 else len(context)
        if state is not None and state.sketch is None:
            state.sketch = prompt_sketch(context[:start])
        sketch = None if state is None else state.sketch
        context = np.asarray(context, dtype=np.int64)  # [n]
        output = np.concatenate([[SEPARATOR], context[start:]])  # a separator: where the output starts

        def search(chain: list[int]):  # the request's own positions first, as ~index (< 0); then the served ones
            own_match, own_next, own_at = context_candidates(np.concatenate([context, chain]), MAX_SUFFIX)
            match, nxt, factor, at = self.served.candidates(np.concatenate([output, chain]), sketch)
            return (np.concatenate([own_match, match]), np.concatenate([own_next, nxt]),
                    np.concatenate([np.full(len(own_match), OWN_FACTOR), factor]), np.concatenate([~own_at, at]))

        def follow(at: np.ndarray, chain: list[int]):  # each position moved on by its own source, in place
            own = at < 0
            moved, nxt, ok = at.copy(), np.empty_like(at), np.empty(len(at), dtype=bool)
            own_at, nxt[own], ok[own] = follow_context(np.concatenate([context, chain]), ~at[own])
            moved[own] = ~own_at
            moved[~own], nxt[~own], ok[~own] = self.served.follow(at[~own])
            return moved, nxt, ok

        chain, matched = vote_chain(search, follow, k)
        return self.datastore_chain(context, k, matched, chain)
