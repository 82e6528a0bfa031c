"""The verifier: one target forward over ``[root, *tree]`` and commitment of the accepted path.

The root is the last committed token, which is not yet in the KV cache (invariant of the decode loop: the cache
holds every committed token except the last). A chain is scored with the model's own causal mask; a tree gets an
explicit 4D additive mask (each node sees the cached prefix, the root and its own ancestors) and explicit
``position_ids`` (prefix length + depth), through the public ``attention_mask`` / ``position_ids`` arguments.

Logits (``LogitsHead``). For model families whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``
(Llama, Qwen2/3, Mistral: no bias, no soft-capping or scaling), the verifier runs the decoder through the public
``get_decoder()`` and applies the head itself, choosing the matrix-product layout: on CPU, BLAS runs the
verification shape [T, H] x [H, V] (T = 2..16 rows, V = 49,152 for SmolLM2) several times slower than the same
product laid out as [V, H] x [H, T], which streams the head once. Same weights, same arithmetic up to float
summation order; any other model is called whole, as before.
"""

from __future__ import annotations

import copy
import time
import weakref

import torch

from .kv import KVCache
from .tree import ancestor_mask, depths
from .types import DraftTree


# model types whose causal-LM logits are plain lm_head(last_hidden_state)
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_TRANSPOSED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(W) -> (ref to W, W's version, W.T copy)
_TRANSPOSE_MAX_BYTES = 512 << 20  # a transposed copy of a larger head costs more memory than it saves time


class LogitsHead:
    """The decoder and head of a causal LM whose logits are ``hidden @ W.T`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.decoder = model.get_decoder()
        self.weight = model.get_output_embeddings().weight  # [V, H]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "LogitsHead | None":
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or not hasattr(model, "get_decoder"):
            return None
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            return None
        return cls(model)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] last hidden states -> [T, V] logits."""
        w = self.weight
        if w.device.type != "cpu":
            return hidden @ w.T
        if hidden.shape[0] == 1:  # one row: a pre-transposed [H, V] copy is the fast layout
            wt = _transposed(w)
            return hidden @ wt if wt is not None else hidden @ w.T
        return (w @ hidden.T).T  # [V, H] x [H, T], transposed back (a view)


def _transposed(w: torch.Tensor) -> torch.Tensor | None:
    """A contiguous copy of ``w.T``, cached while ``w`` lives and is not modified in place."""
    if w.numel() * w.element_size() > _TRANSPOSE_MAX_BYTES:
        return None
    entry = _TRANSPOSED.get(id(w))
    if entry is not None and entry[0]() is w and entry[1] == w._version:
        return entry[2]
    for key in [k for k, e in _TRANSPOSED.items() if e[0]() is None]:  # drop copies of freed weights
        del _TRANSPOSED[key]
    wt = w.detach().T.contiguous()
    _TRANSPOSED[id(w)] = (weakref.ref(w), w._version, wt)
    return wt


class Verifier:
    def __init__(self, model: torch.nn.Module, want_hidden: bool = False):
        self.model = model
        self.head = LogitsHead.of(model)
        self.want_hidden = want_hidden
        self.kv = KVCache(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.last_hidden: torch.Tensor | None = None  # [1 + N, H] when want_hidden
        self._pending = 0  # positions written by the last score() and not yet committed

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 last_only: bool = False) -> torch.Tensor:
        out = (self.head.decoder if self.head is not None else self.model)(
            input_ids=ids,
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=self.kv.cache,
            use_cache=True,
            output_hidden_states=self.want_hidden,
        )
        if self.want_hidden:
            self.last_hidden = out.hidden_states[-1][0]
        if self.head is not None:
            hidden = out.last_hidden_state[0]  # [T, H]
            return self.head.logits(hidden[-1:] if last_only else hidden)  # [T, V] (or [1, V])
        return out.logits[0]  # [T, V]

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], memo: "PrefillMemo | None" = None) -> torch.Tensor:
        """Run the prompt; returns the [V] logits for the first new token. With a ``memo`` holding this model and
        prompt, the cache is a copy of the memo's and no forward runs."""
        if memo is not None and memo.matches(self.model, prompt_ids, self.want_hidden):
            self.kv, self.last_hidden = copy.deepcopy(memo.kv), memo.hidden
            return memo.logits
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        logits = self._forward(ids, pos, None, last_only=True)[-1]
        if memo is not None:
            memo.store(self.model, prompt_ids, self, logits, time.perf_counter() - t0)
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
        pos = (past + torch.cat([torch.zeros(1, dtype=torch.long), depths(tree.parents)])).to(self.device)[None]
        block = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
        block[:, 0] = True
        block[1:, 1:] = ancestor_mask(tree.parents)
        allowed = torch.cat([torch.ones(1 + n, past, dtype=torch.bool), block], dim=1)  # [1 + N, past + 1 + N]
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return self._forward(ids, pos, mask[None, None].to(self.device))

    def commit(self, accepted_nodes: list[int]) -> None:
        """Keep the root and the accepted path in the cache; drop every other scored node."""
        start = len(self.kv) - self._pending
        self.kv.keep(start, [0] + [a + 1 for a in accepted_nodes])
        self._pending = 0


class PrefillMemo:
    """One prompt forward reused by several requests on the same target and prompt (the long-context bench runs
    several methods over one long context: the prompt is run once and timed once, in ``seconds``).

    Holds a private deep copy of the prefilled cache; every hit gets its own deep copy, so requests never share
    state. Not thread-safe; one memo per (target, prompt) at a time (a new prompt replaces the old entry).
    """

    def __init__(self) -> None:
        self._model_id: int | None = None
        self._prompt: list[int] = []
        self.kv: KVCache | None = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.seconds = 0.0  # the prompt forward's wall time
        self.hits = 0

    def matches(self, model: torch.nn.Module, prompt_ids: list[int], want_hidden: bool) -> bool:
        hit = (self._model_id == id(model) and self.kv is not None and (self.hidden is not None or not want_hidden)
               and self._prompt == list(prompt_ids))
        self.hits += hit
        return hit

    def store(self, model: torch.nn.Module, prompt_ids: list[int], verifier: Verifier, logits: torch.Tensor,
              seconds: float) -> None:
        self._model_id, self._prompt = id(model), list(prompt_ids)
        self.kv, self.logits, self.hidden = copy.deepcopy(verifier.kv), logits, verifier.last_hidden
        self.seconds, self.hits = seconds, 0
