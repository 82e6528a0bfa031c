"""``dresd``: Dense Retrieval for Speculative Decoding (Gritta, Xue, Lampouras, Findings of ACL 2025).

Each step: the target's last-layer hidden state that produced the last committed token (``ctx.target.hidden_states``,
``needs = {"hidden_states"}``) is transformed as the datastore keys were (z-norm -> PCA -> L2) and searched in the
store's FAISS index. Of the ``neighbours`` found, those whose stored sequence does not start with the last committed
token are dropped (the paper's token filter); their continuations, cut to ``draft_len`` tokens (and after an EOS),
become the draft tree in one of two ways (``rank``):

- ``votes`` (default): every kept neighbour votes for its continuation; the trie of all of them is pruned to the
  ``num_drafts x draft_len`` most supported nodes (``tree.frequency_trie``, REST's rule), default 512 neighbours.
  On the target's own held-out replies this drafts ~15 % more accepted tokens a step than ``nearest`` with the same
  node budget (docs/results.md, "DReSD against REST from the same corpus");
- ``nearest`` (the paper's rule): the first ``num_drafts`` distinct continuations in similarity order, merged into
  one trie (``tree.merge_sequences``), default max(128, 20 x num_drafts) neighbours.

Draft shape defaults from the paper: 3 x 20 greedy, 10 x 10 sampling. Deterministic given the store, without
probabilities (one-hot q): lossless under either rule.
"""

from __future__ import annotations

import numpy as np

from ..errors import RetrospecError
from ..tree import frequency_trie, merge_sequences
from ..types import DraftTree
from .base import DecodeContext
from .registry import Knob, MethodSpec, register
from .rest import DATASTORE, DEFAULTS, DRAFT_LEN, NUM_DRAFTS, check_shape


RANKS = ("votes", "nearest")  # the first is the default


def parse_rank(value) -> str:
    if value not in RANKS:
        raise RetrospecError(f"rank must be one of {', '.join(RANKS)}, got {value!r}")
    return value


class DresdDrafter:
    name = "dresd"
    needs: frozenset[str] = frozenset({"hidden_states"})

    def __init__(self, store, num_drafts: int | None = None, draft_len: int | None = None,
                 neighbours: int | None = None, rank: str = RANKS[0]):
        check_shape(num_drafts, draft_len)
        self.store = store
        self.num_drafts, self.draft_len, self.neighbours = num_drafts, draft_len, neighbours
        self.rank = parse_rank(rank)
        self._k = self._len = self._search_k = 0

    def prefill(self, ctx: DecodeContext) -> None:
        k, length = DEFAULTS[ctx.sampling.greedy]
        self._k = self.num_drafts or k
        self._len = min(self.draft_len or length, self.store.value_len)
        # most neighbours fail the token filter; votes need many survivors to rank continuations
        self._search_k = self.neighbours or (512 if self.rank == "votes" else max(128, 20 * self._k))

    def continuations(self, hidden: np.ndarray, last_token: int) -> np.ndarray:
        """[M, draft_len] continuations of ``last_token`` retrieved with ``hidden`` [H], in similarity order;
        -1 after an EOS (kept) ends a row."""
        _, ids = self.store.search(hidden[None], self._search_k)  # [1, k]
        ids = ids[0][ids[0] >= 0]
        vals = np.asarray(self.store.values[ids])  # [k, 1 + N] in similarity order
        vals = vals[vals[:, 0] == last_token, 1 : 1 + self._len].astype(np.int64)  # [M, L]: produced last_token
        ended = np.cumsum(vals == self.store.eos_id, axis=1) - (vals == self.store.eos_id)  # EOSs strictly before
        vals[ended > 0] = -1
        return vals

    def drafts(self, rows: np.ndarray) -> list[list[int]]:
        """Up to num_drafts distinct ``continuations`` rows, nearest first (the paper's rule)."""
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for row in rows.tolist():
            key = tuple(t for t in row if t >= 0)
            if key not in seen:
                seen.add(key)
                out.append(list(key))
                if len(out) == self._k:
                    break
        return out

    def tree(self, rows: np.ndarray, budget: int) -> DraftTree:
        """The draft tree of ``continuations`` rows: at most ``budget`` nodes (and num_drafts x draft_len for
        ``votes``)."""
        if not len(rows):
            return DraftTree.empty()
        if self.rank == "nearest":
            return merge_sequences(self.drafts(rows), max_nodes=budget)
        return frequency_trie(rows, None, min(budget, self._k * self._len))

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        if budget <= 0 or ctx.target.hidden_states is None:
            return DraftTree.empty()
        hidden = ctx.target.hidden_states.detach().float().cpu().numpy()  # [H]
        return self.tree(self.continuations(hidden, ctx.tokens[-1]), budget)

    def observe(self, accepted: int, drafted: int) -> None:
        pass


def _make_dresd(*, datastore=None, num_drafts: int | None = None, draft_len: int | None = None,
                neighbours: int | None = None, rank: str | None = None, target=None) -> DresdDrafter:
    from ..retrieval import open_store

    if datastore is None:
        raise RetrospecError("method 'dresd' needs a dense datastore (--datastore DIR; build one with "
                             "'retrospec datastore build --kind dense')")
    store = open_store(datastore, "dense", target=target)
    return DresdDrafter(store, num_drafts=num_drafts, draft_len=draft_len, neighbours=neighbours,
                        rank=rank or RANKS[0])


SPEC = register(MethodSpec(
    "dresd", _make_dresd, "ANN search over target hidden states, next-N tokens",
    knobs=(DATASTORE, NUM_DRAFTS, DRAFT_LEN,
           Knob("neighbours", "int", None, "neighbours searched (default 512 for votes, max(128, 20 x num_drafts) "
                "for nearest)", min=1, max=4096),
           Knob("rank", "str", RANKS[0], "how continuations become the tree: votes (the most supported nodes) or "
                "nearest (the paper's: the first num_drafts distinct ones)", parse=parse_rank)),
    store="dense", needs=frozenset({"hidden_states"})))
