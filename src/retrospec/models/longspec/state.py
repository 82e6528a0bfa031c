"""Inference state of a LongSpec draft block for one sequence: a ring buffer plus tentative (speculated) tokens.

Paper: Yang et al., "LongSpec" (sail-sg, 2025): the draft's own attention is a sliding window, so its state has a
fixed size whatever the context length; only the target's cache (read, never written) grows.

Layout: the ring ``k``, ``v`` [1, kv_heads, window, head_dim] and ``slot_pos`` [window] (absolute position held by
each slot, -1 = empty); position p lives in slot p % window and ``length`` counts every committed token. Tentative
tokens (a draft tree under construction) keep their own keys/values (``t_k``, ``t_v``: right after the ring in the
same buffers, which grow by doubling, so attention reads ring and tree in place), positions and ancestor matrix;
they never enter the ring.

Operations: ``append(ids)`` commits tokens (a projection of at most ``window`` tokens, no attention; refused while
tentative tokens exist); ``speculate(ids, parents, target_kv)`` runs the block on tentative tokens below the
committed prefix (parent -1) or below earlier tentative tokens, each attending to the ring, its tentative ancestors
and itself, and the target's K/V (``cross_visible``, shift 1); ``rollback()`` forgets every tentative token (free).

Invariant (tested): logits from ``speculate`` equal ``LongSpecDraft.forward`` over the committed tokens followed by
the tentative token's ancestor path, with a sliding window mask, as long as the sequence is longer than the window.
``nbytes()`` does not grow with the context: the key buffers hold window + ``ROOM`` slots, doubled when a tree needs
more (never shrunk); the tentative outputs and the ancestry matrix follow the tentative count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .block import KeyBuffer, LongSpecDraft, cross_visible, self_visible


ROOM = 64  # tentative tokens the buffers hold after the ring at first (the default tree leaves 53)


class DraftState:
    def __init__(self, draft: LongSpecDraft):
        self.draft = draft
        ref = next(draft.parameters())
        self.window = draft.window
        shape = (1, draft.num_kv_heads, draft.window + ROOM, draft.head_dim)
        with torch.inference_mode(False):  # plain tensors: written in place in or out of inference mode
            self.keys = ref.new_zeros(shape)  # [1, kv_heads, window + room, head_dim]: the ring, then tentative tokens
            self.values = ref.new_zeros(shape)
            self.slot_pos = torch.full((draft.window,), -1, dtype=torch.long, device=ref.device)  # [window]
        self.length = 0  # committed tokens so far = position of the next one
        self._no_out = ref.new_zeros(0, draft.config.hidden_size)  # [0, H]
        self.rollback()

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def k(self) -> torch.Tensor:  # [1, kv_heads, window, head_dim]: the ring's keys (a view)
        return self.keys[:, :, :self.window]

    @property
    def v(self) -> torch.Tensor:
        return self.values[:, :, :self.window]

    @property
    def t_k(self) -> torch.Tensor:  # [1, kv_heads, S, head_dim]: the tentative tokens' keys (a view after the ring)
        return self.keys[:, :, self.window:self.window + len(self.t_pos)]

    @property
    def t_v(self) -> torch.Tensor:
        return self.values[:, :, self.window:self.window + len(self.t_pos)]

    @property
    def tentative(self) -> int:
        return len(self.t_pos)

    def rollback(self) -> None:
        """Forget every tentative token."""
        self.t_pos: list[int] = []  # [S] positions
        self.t_out = self._no_out  # [S, H] block outputs (a block with features: what is drafted below them reads)
        self.t_anc = np.zeros((0, 0), dtype=bool)  # [S, S] t_anc[i, j]: j is i or an ancestor of i (host memory)

    @torch.no_grad()
    def append(self, ids: Sequence[int] | torch.Tensor) -> None:
        """Commit ``ids`` at positions length, length + 1, ...; only the last ``window`` are computed."""
        if self.t_pos:
            raise RuntimeError("rollback() the tentative tokens before committing")
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            return
        tail = ids[-self.window:]
        start = self.length + n - tail.numel()
        pos = torch.arange(start, start + tail.numel(), device=self.device)  # [m]
        k, v = self.draft.token_kv(tail.to(self.device)[None], pos[None])  # [1, kv_heads, m, d]
        slots = pos % self.window
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        self.slot_pos[slots] = pos
        self.length += n

    @torch.no_grad()
    def speculate(self, ids: Sequence[int] | torch.Tensor, parents: Sequence[int],
                  target_kv: tuple[torch.Tensor, torch.Tensor] | KeyBuffer | None, shift: int = 1,
                  root_feature: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] of tentative tokens ``ids`` [N]; ``parents[i]``: -1 (the token follows the committed
        prefix) or the index of an earlier tentative token (earlier calls first, then this call's, < S + i).
        ``target_kv``: the target's last-layer (keys, values) [1, kv_heads, T, d], or its buffers as a ``KeyBuffer``
        holding T (read in place; None: no target context).
        A block with ``features`` reads, per token, ``root_feature`` [H] (``target_feature`` of the committed
        prefix's last position; None: no feature) below the prefix, else its parent's output, so a parent must
        come from an earlier call."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        n, s = ids.numel(), len(self.t_pos)
        all_pos = list(self.t_pos)
        # the tree's bookkeeping in numpy on the host (a few dozen tiny operations per call; torch's cost ~10x per op)
        anc = np.zeros((s + n, s + n), dtype=bool)  # [S + N, S + N]
        anc[:s, :s] = self.t_anc
        for i, p in enumerate(parents):
            p = int(p)
            if not -1 <= p < s + i:
                raise ValueError(f"parent {p} of tentative token {s + i} is not an earlier tentative token")
            all_pos.append(self.length if p < 0 else all_pos[p] + 1)
            if p >= 0:
                anc[s + i] = anc[p]
            anc[s + i, s + i] = True
        pos = np.asarray(all_pos)  # [S + N]
        # ancestry and ``self_visible``'s rule (positions are >= 0): [N, S + N]
        visible = anc[s:] & (pos[None] <= pos[s:, None]) & (pos[None] > pos[s:, None] - self.window)
        new_pos = torch.tensor(all_pos[s:], device=self.device)[None]  # [1, N]
        feature = self._features(parents, s, root_feature) if self.draft.features else None  # [1, N, H]
        tree = torch.from_numpy(visible).to(self.device)[None]  # [1, N, S + N]
        ring = self_visible(new_pos, self.slot_pos[None], self.window)  # [1, N, window]
        # the ring, then the tentative tokens, then these: [1, kv_heads, window + S + N, d] in place
        self._room(s + n)
        past = KeyBuffer(self.keys, self.values, self.window + s)
        cross = None  # [1, N, T]; None when every new token sees the whole cache (at inference, shift 1: always)
        cached = 0 if target_kv is None else target_kv.filled if isinstance(target_kv, KeyBuffer) else \
            target_kv[0].shape[2]
        if cached > min(all_pos[s:]) - shift + 1:
            cross = cross_visible(new_pos, cached, shift)
        logits, k, v, out = self.draft.run(ids.to(self.device)[None], new_pos, tree[..., s:], past,
                                           (ring, tree[..., :s]) if s else ring, target_kv, cross, feature)
        # ``run`` wrote k, v after the earlier tentative tokens: ``t_k`` / ``t_v`` cover them with ``t_pos``
        if self.draft.features:  # the features of tokens drafted below these
            self.t_out = torch.cat([self.t_out, out[0]])
        self.t_pos, self.t_anc = all_pos, anc
        return logits[0]  # [N, V]

    def _room(self, tentative: int) -> None:
        """Buffers with room for ``tentative`` tokens after the ring (doubled when short; ring and tree kept)."""
        have = self.keys.shape[2] - self.window
        if tentative <= have:
            return
        used = self.window + len(self.t_pos)
        shape = (*self.keys.shape[:2], self.window + max(tentative, 2 * have), self.keys.shape[3])
        with torch.inference_mode(False), torch.no_grad():
            keys, values = self.keys.new_zeros(shape), self.values.new_zeros(shape)
            keys[:, :, :used], values[:, :, :used] = self.keys[:, :, :used], self.values[:, :, :used]
        self.keys, self.values = keys, values

    def _features(self, parents: Sequence[int], s: int, root_feature: torch.Tensor | None) -> torch.Tensor:
        """[1, N, H]: ``root_feature`` (zeros when None: nothing added) below the prefix, a parent's output below it."""
        p = torch.as_tensor(list(parents), dtype=torch.long)  # [N]
        if (p >= s).any():
            raise ValueError(f"a block with target features drafts one level per call: a parent among {p.tolist()} "
                             f"is in the same call (tentative tokens before it: {s})")
        hidden = self.t_out.shape[-1]
        root = (root_feature.to(self.t_out.dtype) if root_feature is not None
                else self.t_out.new_zeros(hidden))[None].expand(len(p), hidden)  # [N, H]
        if s == 0:
            return root[None]
        below = self.t_out[p.clamp(min=0).to(self.t_out.device)]  # [N, H]
        return torch.where((p < 0).to(below.device)[:, None], root, below)[None]

    def nbytes(self) -> int:
        """Bytes held by the state (ring and tentative tokens: their buffers and the ancestry matrix)."""
        tensors = (self.keys, self.values, self.slot_pos, self.t_out)
        return sum(t.numel() * t.element_size() for t in tensors) + self.t_anc.nbytes
