"""``dresd``: Dense Retrieval for Speculative Decoding (Gritta, Xue, Lampouras, Findings of ACL 2025).

Each step: the target's last-layer hidden state that produced the last committed token (``ctx.target.hidden_states``,
``needs = {"hidden_states"}``) is transformed as the datastore keys were (z-norm -> PCA -> L2) and searched in the
store's FAISS index. Of ``neighbours`` (default max(128, 20 x num_drafts)), those whose stored sequence does not
start with the last committed token are dropped; the first ``num_drafts`` distinct continuations, cut to
``draft_len`` tokens (and after an EOS), are merged into one trie (``tree.merge_sequences``). Defaults from the
paper: 3 x 20 greedy, 10 x 10 sampling. Deterministic, without probabilities (one-hot q): lossless.
"""

from __future__ import annotations

import numpy as np

from ..errors import RetrospecError
from ..tree import merge_sequences
from ..types import DraftTree
from .base import DecodeContext
from .registry import Knob, MethodSpec, register
from .rest import DATASTORE, DEFAULTS, DRAFT_LEN, NUM_DRAFTS, check_shape


class DresdDrafter:
    name = "dresd"
    needs: frozenset[str] = frozenset({"hidden_states"})

    def __init__(self, store, num_drafts: int | None = None, draft_len: int | None = None,
                 neighbours: int | None = None):
        check_shape(num_drafts, draft_len)
        self.store = store
        self.num_drafts, self.draft_len, self.neighbours = num_drafts, draft_len, neighbours
        self._k = self._len = self._search_k = 0

    def prefill(self, ctx: DecodeContext) -> None:
        k, length = DEFAULTS[ctx.sampling.greedy]
        self._k = self.num_drafts or k
        self._len = min(self.draft_len or length, self.store.value_len)
        self._search_k = self.neighbours or max(128, 20 * self._k)  # most neighbours fail the token filter

    def drafts(self, hidden: np.ndarray, last_token: int) -> list[list[int]]:
        """Up to num_drafts distinct continuations of ``last_token`` retrieved with ``hidden`` [H]."""
        _, ids = self.store.search(hidden[None], self._search_k)  # [1, k]
        ids = ids[0][ids[0] >= 0]
        vals = np.asarray(self.store.values[ids])  # [k, 1 + N] in similarity order
        vals = vals[vals[:, 0] == last_token, 1 : 1 + self._len]  # keep neighbours that produced last_token
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        eos = self.store.eos_id
        for row in vals.tolist():
            if eos in row:
                row = row[: row.index(eos) + 1]
            key = tuple(row)
            if key not in seen:
                seen.add(key)
                out.append(row)
                if len(out) == self._k:
                    break
        return out

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        if budget <= 0 or ctx.target.hidden_states is None:
            return DraftTree.empty()
        hidden = ctx.target.hidden_states.detach().float().cpu().numpy()  # [H]
        seqs = self.drafts(hidden, ctx.tokens[-1])
        return merge_sequences(seqs, max_nodes=budget) if seqs else DraftTree.empty()

    def observe(self, accepted: int, drafted: int) -> None:
        pass


def _make_dresd(*, datastore=None, num_drafts: int | None = None, draft_len: int | None = None,
                neighbours: int | None = None, target=None) -> DresdDrafter:
    from ..retrieval import open_store

    if datastore is None:
        raise RetrospecError("method 'dresd' needs a dense datastore (--datastore DIR; build one with "
                             "'retrospec datastore build --kind dense')")
    store = open_store(datastore, "dense", target=target)
    return DresdDrafter(store, num_drafts=num_drafts, draft_len=draft_len, neighbours=neighbours)


SPEC = register(MethodSpec(
    "dresd", _make_dresd, "ANN search over target hidden states, next-N tokens",
    knobs=(DATASTORE, NUM_DRAFTS, DRAFT_LEN,
           Knob("neighbours", "int", None, "neighbours searched (default max(128, 20 x num_drafts))", min=1,
                max=4096)),
    store="dense", needs=frozenset({"hidden_states"})))
