"""``rest``: Retrieval-Based Speculative Decoding (He et al., NAACL 2024).

Each step: the longest suffix of the committed tokens (16 down to 2 tokens) is looked up in a suffix-array
datastore (``retrieval.suffix_array``); the next ``draft_len`` tokens after up to ``max_samples`` of its
occurrences are counted into a trie, and the ``num_drafts x draft_len`` most frequent nodes form the draft tree
(``tree.frequency_trie``), verified in one target forward.

The draft is deterministic and carries no probabilities (one-hot q): lossless at any temperature. Node budget
defaults: 3 x 20 greedy, 10 x 10 sampling, as ``dresd``, so the two compare at equal draft size.
"""

from __future__ import annotations

import numpy as np

from ..errors import RetrospecError
from ..tree import frequency_trie
from ..types import DraftTree
from .base import DecodeContext
from .registry import MAX_DRAFT, Knob, MethodSpec, register

DEFAULTS = {True: (3, 20), False: (10, 10)}  # greedy -> (num_drafts, draft_len); sampling -> ...


def check_shape(num_drafts: int | None, draft_len: int | None) -> None:
    for name, v in (("num_drafts", num_drafts), ("draft_len", draft_len)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise RetrospecError(f"{name} must be an integer >= 1, got {v!r}")


class RestDrafter:
    name = "rest"
    needs: frozenset[str] = frozenset()

    def __init__(self, store, num_drafts: int | None = None, draft_len: int | None = None, max_nodes: int | None = None,
                 max_samples: int = 512, max_suffix: int = 16, min_suffix: int = 2):
        check_shape(num_drafts, draft_len)
        self.store = store
        self.num_drafts, self.draft_len, self.max_nodes = num_drafts, draft_len, max_nodes
        self.max_samples, self.max_suffix, self.min_suffix = max_samples, max_suffix, min_suffix
        self._len, self._nodes = 0, 0

    def prefill(self, ctx: DecodeContext) -> None:
        k, length = DEFAULTS[ctx.sampling.greedy]
        self._len = self.draft_len or length
        self._nodes = self.max_nodes or (self.num_drafts or k) * self._len

    def continuations(self, tokens) -> np.ndarray:
        """[S, L] continuations of the longest suffix of ``tokens`` found in the store, in lexicographic order
        (-1 after an EOS); no rows where no suffix of ``min_suffix`` tokens occurs."""
        match = self.store.search(tokens, self.max_suffix, self.min_suffix)
        if match is None:
            return np.zeros((0, self._len), dtype=np.int32)
        return self.store.sample(match, self._len, self.max_samples)

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        n = min(self._nodes, budget)
        if n <= 0:
            return DraftTree.empty()
        return frequency_trie(self.continuations(ctx.tokens), None, n, presorted=True)

    def observe(self, accepted: int, drafted: int) -> None:
        pass


def _make_rest(*, datastore=None, num_drafts: int | None = None, draft_len: int | None = None,
               target=None) -> RestDrafter:
    from ..retrieval import open_store

    if datastore is None:
        raise RetrospecError("method 'rest' needs a suffix datastore (--datastore DIR; build one with "
                             "'retrospec datastore build --kind suffix')")
    store = open_store(datastore, "suffix", target=target)
    return RestDrafter(store, num_drafts=num_drafts, draft_len=draft_len)


DATASTORE = Knob("datastore", "path", None, "the method's datastore: a directory (retrospec datastore build) or an "
                 "opened store")
NUM_DRAFTS = Knob("num_drafts", "int", None, "drafts per step (default 3 greedy, 10 sampling)", min=1, max=MAX_DRAFT)
DRAFT_LEN = Knob("draft_len", "int", None, "tokens per draft (default 20 greedy, 10 sampling)", min=1, max=MAX_DRAFT)
SPEC = register(MethodSpec("rest", _make_rest, "suffix-array datastore, trie of continuations",
                           knobs=(DATASTORE, NUM_DRAFTS, DRAFT_LEN), store="suffix"))
