"""Tree utilities: depths, ancestor masks, and merging candidate continuations into one ``DraftTree``.

Invariants:
- Nodes are in topological order (parent index < child index); the root (last committed token) is implicit.
- ``ancestor_mask(parents)[i, j]`` is True iff node j is node i or one of its ancestors, so a forward pass with
  this mask scores every root-to-node path exactly as a chain forward of that path would.
- ``merge_sequences`` is deterministic: children appear in first-seen order, so the same input gives the same tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .types import DraftTree


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node below the root (root's children have depth 1). [N] int64."""
    par = parents.tolist()
    out = [0] * len(par)
    for i, p in enumerate(par):
        out[i] = 1 if p < 0 else out[p] + 1
    return torch.tensor(out, dtype=torch.long)


def within_depth(tree: DraftTree, max_depth: int | None) -> DraftTree:
    """``tree`` without its nodes deeper than ``max_depth`` (None: no limit), in the same order (parents remapped,
    ``draft_probs`` rows kept with their nodes); the tree itself when nothing is that deep."""
    if max_depth is None or len(tree) <= max_depth:  # no node of N can be deeper than N (most steps: no work)
        return tree
    if max_depth <= 0:
        return DraftTree.empty()
    if tree.is_chain:
        probs = None if tree.draft_probs is None else tree.draft_probs[:max_depth]
        return DraftTree.chain(tree.tokens[:max_depth], probs)
    keep = depths(tree.parents) <= max_depth  # [N] bool; a kept node's parent is kept (it is shallower)
    if bool(keep.all()):
        return tree
    new_index = keep.long().cumsum(0) - 1  # [N] old index -> new index, for kept nodes
    parents = tree.parents[keep]  # [M]
    parents = torch.where(parents < 0, parents, new_index[parents.clamp(min=0)])
    probs = None if tree.draft_probs is None else tree.draft_probs[keep]
    return DraftTree(tree.tokens[keep], parents, probs)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] = j is an ancestor of i or i itself."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    par = parents.tolist()
    for i, p in enumerate(par):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """children[k] lists the children of node k-1 (children[0] = children of the root), in node order."""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    return kids


def merge_sequences(seqs: Sequence[Sequence[int]], max_nodes: int | None = None) -> DraftTree:
    """Merge candidate continuations into a trie of at most ``max_nodes`` nodes, in breadth-first order (truncating
    keeps the shallow nodes, the most likely to be accepted)."""
    children: list[dict[int, int]] = [{}]  # trie node 0 = root
    trie_tokens: list[int] = [-1]
    trie_parent: list[int] = [-1]
    for seq in seqs:
        node = 0
        for tok in seq:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(trie_tokens)
                children[node][tok] = nxt
                children.append({})
                trie_tokens.append(int(tok))
                trie_parent.append(node)
            node = nxt
    order = list(children[0].values())
    for node in order:  # the list grows as it is read: a breadth-first queue
        order.extend(children[node].values())
    if max_nodes is not None:
        order = order[:max_nodes]
    index = {trie: i for i, trie in enumerate(order)}
    tokens = [trie_tokens[t] for t in order]
    parents = [index.get(trie_parent[t], -1) if trie_parent[t] != 0 else -1 for t in order]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def frequency_trie(seqs, weights, max_nodes: int, presorted: bool = False) -> DraftTree:
    """REST's draft tree: the trie of weighted continuations, pruned to the ``max_nodes`` most frequent nodes.

    ``seqs``: [S, L] token ids, -1 after a sequence's end; ``weights``: [S] positive counts (None = 1 each);
    ``presorted``: rows already in lexicographic order (suffix-array samples). A child never outweighs its parent,
    so selecting by (count desc, depth asc, lexicographic rank) keeps every node's parent. Output order: depth, then
    count desc, then token order (topological; deterministic).
    """
    import numpy as np

    if max_nodes <= 0 or len(seqs) == 0:
        return DraftTree.empty()
    s = np.asarray(seqs, dtype=np.int64).reshape(len(seqs), -1)  # [S, L]
    w = np.ones(len(s), dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64).reshape(-1)
    if s.size == 0:
        return DraftTree.empty()
    if not presorted:
        order = np.lexsort(s.T[::-1])  # rows in lexicographic order (column 0 is the primary key)
        s, w = s[order], w[order]
    n_rows, n_cols = s.shape
    diff = s[1:] != s[:-1]  # [S - 1, L]
    lcp = np.zeros(n_rows, dtype=np.int64)  # [S] length of the common prefix with the previous row
    lcp[1:] = np.where(diff.any(1), diff.argmax(1), n_cols)
    cum = np.concatenate([[0], np.cumsum(w)])  # [S + 1] prefix sums of the weights
    depth_l, start_l, tok_l, cnt_l, par_l = [], [], [], [], []
    prev_starts = prev_ids = None  # runs at depth d - 1 and their global node ids (-1: no node)
    n_total = 0
    for d in range(1, n_cols + 1):
        starts = np.flatnonzero(lcp < d)  # [R] first row of each distinct prefix of length d (sorted)
        toks = s[starts, d - 1]
        ends = np.append(starts[1:], n_rows)
        if prev_ids is None:
            parents = np.full(len(starts), -1, dtype=np.int64)
            valid = toks >= 0
        else:
            parents = prev_ids[np.searchsorted(prev_starts, starts, side="right") - 1]
            valid = (toks >= 0) & (parents >= 0)
        k = int(valid.sum())
        if k == 0:
            break
        ids = np.full(len(starts), -1, dtype=np.int64)
        ids[valid] = np.arange(n_total, n_total + k)
        n_total += k
        depth_l.append(np.full(k, d))
        start_l.append(starts[valid])
        tok_l.append(toks[valid])
        cnt_l.append((cum[ends] - cum[starts])[valid])
        par_l.append(parents[valid])
        prev_starts, prev_ids = starts, ids
    if n_total == 0:
        return DraftTree.empty()
    depth, start, tok, cnt, par = (np.concatenate(x) for x in (depth_l, start_l, tok_l, cnt_l, par_l))
    keep = np.lexsort((start, depth, -cnt))[:max_nodes]  # most frequent first; parents win ties (shallower)
    keep = keep[np.lexsort((start[keep], -cnt[keep], depth[keep]))]  # topological output order
    new_index = np.full(n_total, -1, dtype=np.int64)
    new_index[keep] = np.arange(len(keep))
    parents = np.where(par[keep] >= 0, new_index[np.maximum(par[keep], 0)], -1)
    return DraftTree(torch.as_tensor(tok[keep], dtype=torch.long), torch.as_tensor(parents, dtype=torch.long))
