"""The verifier: one target forward over ``[root, *tree]`` and commitment of the accepted path.

The root is the last committed token, which is not yet in the KV cache (invariant of the decode loop: the cache
holds every committed token except the last). A chain is scored with the model's own causal mask; a tree gets an
explicit 4D additive mask (each node sees the cached prefix, the root and its own ancestors) and explicit
``position_ids`` (prefix length + depth), through the public ``attention_mask`` / ``position_ids`` arguments.

The forward runs on the engine's private copy of the target (``fastpath.engine_for``); the caller's model is never
changed, logits equal the plain forward's within float tolerance (tested), and ``RETROSPEC_FASTPATH=off`` runs the
caller's model as it is. A tree's block mask and position offsets are cached per tree shape.
"""

from __future__ import annotations

import copy

import torch

from .fastpath import device_clock, engine_for
from .kv import KVCache
from .tree import ancestor_mask, depths
from .types import DraftTree


class Verifier:
    def __init__(self, model: torch.nn.Module, want_hidden: bool | tuple[int, ...] = False,
                 fastpath: str | None = None):
        self.model = model
        self.engine = engine_for(model, fastpath)  # fastpath None = RETROSPEC_FASTPATH / measured; "off" = as is
        self.want_hidden = want_hidden
        self.kv = KVCache(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # when want_hidden: [1 + N, H] (True: the last layer's), or [1 + N, n, H] (the outputs of n decoder layers)
        self.last_hidden: torch.Tensor | None = None
        self._pending = 0  # positions written by the last score() and not yet committed
        self._tree_masks: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # parents -> (block mask, depths)

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 last_only: bool = False) -> torch.Tensor:
        logits, hidden = self.engine.forward(ids, position_ids, mask, self.kv.cache, want_hidden=self.want_hidden,
                                             last_only=last_only)
        if self.want_hidden:
            self.last_hidden = hidden
        return logits  # [T, V] (or [1, V])

    def _tree_block(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """(additive [1 + N, 1 + N] block mask, [1 + N] depth offsets) of a tree shape, built once per shape."""
        key = tree.parents.cpu().numpy().tobytes()
        hit = self._tree_masks.get(key)
        if hit is None:
            n = len(tree)
            allowed = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
            allowed[:, 0] = True
            allowed[1:, 1:] = ancestor_mask(tree.parents)
            block = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])
            hit = self._tree_masks[key] = (block.to(self.device), offsets.to(self.device))
            if len(self._tree_masks) > 256:  # drafters with ever-new shapes: keep the cache bounded
                self._tree_masks.pop(next(iter(self._tree_masks)))
        return hit

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], memo: "PrefillMemo | None" = None) -> torch.Tensor:
        """Run the prompt; returns the [V] logits for the first new token. With a ``memo`` holding this model and
        prompt, the cache is a copy of the memo's and no forward runs."""
        if memo is not None and memo.matches(self.model, prompt_ids, self.want_hidden):
            self.kv, self.last_hidden = copy.deepcopy(memo.kv), memo.hidden
            return memo.logits
        clock = device_clock(self.device)
        t0 = clock()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        logits = self._forward(ids, pos, None, last_only=True)[-1]
        if memo is not None:
            memo.store(self.model, prompt_ids, self, logits, clock() - t0)
        return logits

    @torch.inference_mode()
    def score(self, root: int, tree: DraftTree) -> torch.Tensor:
        """[1 + N, V] logits: row 0 after the root, row i + 1 after node i (given its ancestors)."""
        past = len(self.kv)
        n = len(tree)
        self._pending = 1 + n
        ids = torch.cat([torch.tensor([root]), tree.tokens]).to(self.device)[None]  # [1, 1 + N]
        if tree.is_chain:
            pos = torch.arange(past, past + 1 + n, device=self.device)[None]
            return self._forward(ids, pos, None)
        block, offsets = self._tree_block(tree)
        mask = torch.zeros(1 + n, past + 1 + n, dtype=self.dtype, device=self.device)  # the prefix: all visible
        mask[:, past:] = block
        return self._forward(ids, (past + offsets)[None], mask[None, None])

    def commit(self, accepted_nodes: list[int]) -> None:
        """Keep the root and the accepted path in the cache; drop every other scored node."""
        start = len(self.kv) - self._pending
        self.kv.keep(start, [0] + [a + 1 for a in accepted_nodes])
        self._pending = 0


class PrefillMemo:
    """One prompt forward reused by several requests on the same target and prompt (the long-context bench runs
    several methods over one context: the prompt is run and timed once, ``seconds``). Every hit gets its own deep
    copy of the cache, so requests never share state. Not thread-safe; a new prompt replaces the old entry."""

    def __init__(self) -> None:
        self._model_id: int | None = None
        self._prompt: list[int] = []
        self.kv: KVCache | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.hidden_kind: bool | tuple[int, ...] = False  # the verifier's ``want_hidden`` behind ``hidden``
        self.seconds = 0.0  # the prompt forward's wall time
        self.hits = 0

    def matches(self, model: torch.nn.Module, prompt_ids: list[int], want_hidden: bool | tuple[int, ...]) -> bool:
        hit = (self._model_id == id(model) and self.kv is not None
               and (self.hidden_kind == want_hidden or not want_hidden)
               and self._prompt == list(prompt_ids))
        self.hits += hit
        return hit

    def store(self, model: torch.nn.Module, prompt_ids: list[int], verifier: Verifier, logits: torch.Tensor,
              seconds: float) -> None:
        self._model_id, self._prompt = id(model), list(prompt_ids)
        self.kv, self.logits, self.hidden = copy.deepcopy(verifier.kv), logits, verifier.last_hidden
        self.hidden_kind = verifier.want_hidden
        self.seconds, self.hits = seconds, 0
