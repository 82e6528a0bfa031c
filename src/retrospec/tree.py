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
    """Merge candidate continuations into a prefix tree (trie) of at most ``max_nodes`` nodes.

    Nodes are created in breadth-first order over the trie so that truncating to ``max_nodes`` keeps the
    shallow nodes that are most likely to be accepted.
    """
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
    order: list[int] = []
    frontier = [0]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for child in children[node].values():
                order.append(child)
                nxt_frontier.append(child)
        frontier = nxt_frontier
    if max_nodes is not None:
        order = order[:max_nodes]
    index = {trie: i for i, trie in enumerate(order)}
    tokens = [trie_tokens[t] for t in order]
    parents = [index.get(trie_parent[t], -1) if trie_parent[t] != 0 else -1 for t in order]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to ``node``."""
    path = []
    par = parents.tolist()
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]
