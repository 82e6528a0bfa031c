"""``sd``: a small draft LM proposes a chain of gamma tokens (Leviathan et al., 2023; Chen et al., 2023).

The draft samples each token from its processed q (the target's temperature / top-k / top-p) and returns q with
the chain for ``RejectionSampling``; at temperature 0 it proposes argmax tokens without q.

Invariant: ``self.cached`` lists exactly the tokens in the draft's own KV cache; each ``propose`` crops it to the
longest prefix still committed, so rejected draft tokens are forgotten without other bookkeeping.

Reduced draft vocabulary (optional, ``models.vocab.VocabMap``): draft row i stands for target id ``vocab_map[i]``;
its logits are scattered into the target's vocabulary with -inf elsewhere, so q = 0 off the subset and both
acceptance rules stay exact. Adaptive gamma: see ``base.adapt_gamma``.
"""

from __future__ import annotations

import torch

from ..errors import RetrospecError
from ..fastpath import engine_for
from ..kv import KVCache
from ..models.vocab import VocabMap
from ..types import DraftTree
from .base import DecodeContext, adapt_gamma, chain_room, draft_chain
from .registry import ADAPTIVE, MethodSpec, gamma_knob, register


class SmallLMDrafter:
    name = "sd"
    needs: frozenset[str] = frozenset()

    def __init__(self, model: torch.nn.Module, gamma: int = 5, adaptive: bool = False, max_gamma: int = 16,
                 probs_when_greedy: bool = False, prefill_prompt: bool = False,
                 vocab_map: torch.Tensor | None = None, target_vocab: int | None = None):
        self.model = model
        self.gamma = gamma
        self.probs_when_greedy = probs_when_greedy  # greedy drafts still carry q = softmax(logits) (RAPID, eta > 0)
        self.prefill_prompt = prefill_prompt  # run the draft over its prompt in prefill(), not in the first propose()
        self.adaptive = adaptive
        self.max_gamma = max(max_gamma, gamma)
        self.device = next(model.parameters()).device
        # the draft runs on the engine's fast copy in the draft path measured fastest (fastpath.draft: possibly
        # bfloat16; q is whatever that copy computes, so the rules stay exact); the caller's model is untouched
        self.engine = engine_for(model, draft=True)
        self.kv = KVCache(model)
        self.cached: list[int] = []
        self.vmap: VocabMap | None = None  # a reduced draft vocabulary (models.vocab)
        if vocab_map is not None:
            if target_vocab is None:
                raise RetrospecError("a draft vocabulary map needs the target's vocabulary size")
            self.vmap = VocabMap(vocab_map.cpu(), target_vocab).to(self.device)

    def prefill(self, ctx: DecodeContext) -> None:
        self.kv = KVCache(self.model)
        self.cached = []
        if self.prefill_prompt and len(self.sequence(ctx)) > 1:
            self._step(self.sequence(ctx)[:-1])

    @torch.inference_mode()
    def _step(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` after the cached tokens; returns the [V] logits after the last one."""
        start = len(self.cached)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self.vmap is not None:
            x = self.vmap.to_draft[x]  # [1, n] draft rows
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        logits = self.engine.forward(x, pos, None, self.kv.cache, last_only=True)[0][-1]  # [Vd]
        self.cached.extend(ids)
        return logits if self.vmap is None else self.vmap.scatter(logits)  # [V]: q = 0 off the draft's vocabulary

    def sequence(self, ctx: DecodeContext) -> list[int]:
        """The token sequence this drafter continues: every committed token (RAPID overrides it)."""
        return ctx.tokens

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        gamma = chain_room(ctx, min(self.gamma, budget))
        if gamma <= 0:
            return DraftTree.empty()
        seq = self.sequence(ctx)
        # roll the cache back to the longest prefix of committed tokens it still holds
        keep = min(len(self.cached), len(seq) - 1)
        while keep > 0 and self.cached[keep - 1] != seq[keep - 1]:
            keep -= 1
        self.kv.crop(keep)
        del self.cached[keep:]
        logits = self._step(seq[keep:])
        return draft_chain(logits, gamma, ctx, lambda tok, _: self._step([tok]), keep_q=self.probs_when_greedy)

    def state_bytes(self) -> int:
        """Bytes of the draft model's KV cache (the cached positions)."""
        return self.kv.nbytes()

    def observe(self, accepted: int, drafted: int) -> None:
        if self.adaptive:
            self.gamma = adapt_gamma(self.gamma, self.max_gamma, accepted, drafted)


def _make_sd(*, draft_model=None, draft=None, target=None, gamma: int = 5, adaptive: bool = False,
             prefill_prompt: bool = False) -> SmallLMDrafter:
    if draft_model is None:
        raise RetrospecError("method 'sd' needs a draft model (--draft DIR / draft=...)")
    return SmallLMDrafter(draft_model, gamma=gamma, adaptive=adaptive, prefill_prompt=prefill_prompt,
                          **vocab_map_options(draft, target))


def load_draft_lm(spec: MethodSpec, target, draft, options: dict, *, context: bool, load: dict):
    """The draft LM of ``sd`` and ``rapid`` (``MethodSpec.resolve``): ``draft`` (a directory, a name or a model;
    one given by path or name loads beside the target), else over a long context the target itself
    (self-speculation), else the named target's paired draft (``zoo`` -> ``zoo-draft``). Its vocabulary must be
    the target's."""
    from ..models import check_same_vocab, load_model, paired_draft, placement

    if draft is None and not context:
        draft = paired_draft(target)
        if draft is None:
            raise RetrospecError(f"method '{spec.name}' needs a draft model (--draft DIR / draft=...)")
    drf = target if draft is None else load_model(draft, role="draft", **(placement(target) | load))
    check_same_vocab(target, drf)
    return drf, options


SPEC = register(MethodSpec("sd", _make_sd, "a small draft LM, chain, with q", knobs=(gamma_knob(5), ADAPTIVE),
                           default_gamma=5, context_gamma=10, draft="lm", context="optional", load=load_draft_lm))


def vocab_map_options(draft, target) -> dict:
    """``vocab_map``/``target_vocab`` keyword arguments for a draft ``LoadedModel`` with a reduced vocabulary."""
    vmap = getattr(draft, "vocab_map", None)
    if vmap is None:
        return {}
    v = getattr(target, "vocab_size", None) or getattr(draft, "target_vocab_size")
    return {"vocab_map": vmap, "target_vocab": int(v)}
