"""``magicdec``: the target drafts for itself from a StreamingLLM KV cache (MagicDec: Chen et al., 2024;
StreamingLLM: Xiao et al., ICLR 2024).

The drafter is the target reading only ``sink`` attention-sink positions (default 4) and the ``window`` most recent
ones, so a draft step is a short-cache forward; verification over the full cache keeps the output exact.

While the whole context fits in sink + window, the drafter declines (an empty draft: a plain step): its draft would
be the target reading every key, which costs a target step per drafted token and cannot pay (MagicDec's speedup
needs a context longer than the draft's KV budget). Once the context outgrows it, the draft cache starts from the
target's cache (``needs`` ``target_kv``: its sink and window slices are copied); without it the drafter runs the
context once itself. Per step: roll back last step's draft entries, feed the unseen committed tokens at their true
positions, evict down to sinks + window, draft gamma tokens. Default window: RAPID's default retrieval length,
max(1024, ceil(context / 24)), so both drafters read contexts of the same size.
"""

from __future__ import annotations

import math

import torch

from ..fastpath import engine_for
from ..kv.streaming import SinkWindowCache
from ..types import DraftTree
from ..errors import RetrospecError
from .base import DecodeContext, adapt_gamma, as_module, chain_room, draft_chain
from .registry import ADAPTIVE, Knob, MethodSpec, gamma_knob, register

DEFAULT_SINK = 4


def default_window(context_tokens: int, min_tokens: int = 1024, fraction: float = 1 / 24) -> int:
    return max(min_tokens, math.ceil(fraction * context_tokens))


class MagicDecDrafter:
    name = "magicdec"
    needs: frozenset[str] = frozenset({"target_kv"})

    def __init__(self, model: torch.nn.Module, gamma: int = 10, sink: int = DEFAULT_SINK, window: int | None = None,
                 adaptive: bool = False, max_gamma: int = 16):
        self.model = model
        self.gamma = gamma
        self.sink = sink
        self.window = window
        self.adaptive = adaptive
        self.max_gamma = max(max_gamma, gamma)
        self.device = next(model.parameters()).device
        # the target's DRAFT engine (fastpath.draft: maybe a bfloat16 copy, or an int8 copy of the head;
        # RETROSPEC_DRAFT_DTYPE=float32 avoids both);
        # verification keeps the target's own engine in its weights' dtype, so the output is exact; no compiled
        # layers: they run over the engine's own cache, not the sink + window one
        self.engine = engine_for(model, draft=True, programs=False)
        self.cache: SinkWindowCache | None = None
        self.kv_budget = sink + (window or 0)  # keys the draft reads: set per request by ``prefill``

    @torch.inference_mode()
    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Feed ``ids`` at true positions start, start + 1, ...; returns the [V] logits after the last one."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        return self.engine.forward(x, pos, None, self.cache.cache, last_only=True)[0][-1]  # [V]

    def prefill(self, ctx: DecodeContext) -> None:
        self.cache = None  # built by the first step whose context outgrows sink + window (``_start``)
        self.kv_budget = self.sink + (self.window or default_window(ctx.prompt_len))

    def _start(self, ctx: DecodeContext) -> None:
        window = self.kv_budget - self.sink
        kv = ctx.target.kv
        # the target's cache holds every committed token but the last (the root of the next step)
        if kv is not None and len(kv) == len(ctx.tokens) - 1 and len(kv) > 0:
            self.cache = SinkWindowCache.from_layers(self.model.config, kv.layer_tensors(), self.sink, window)
        else:  # no shared prefill: run the prompt (but the root) once, then compress
            self.cache = SinkWindowCache(self.model.config, self.sink, window)
            if len(ctx.tokens) > 1:
                self._forward(ctx.tokens[:-1], 0)
                self.cache.mark_committed(len(ctx.tokens) - 1)
                self.cache.evict()

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        gamma = chain_room(ctx, min(self.gamma, budget))
        if gamma <= 0 or len(ctx.tokens) <= self.kv_budget:  # the draft would read every key: the target itself
            return DraftTree.empty()
        if self.cache is None:
            self._start(ctx)
        cache = self.cache
        cache.rollback()
        new = ctx.tokens[cache.seen:]  # committed tokens not yet in the draft cache (ends with the root)
        logits = self._forward(new, cache.seen)
        cache.mark_committed(len(new))
        cache.evict()
        pos = cache.seen
        return draft_chain(logits, gamma, ctx, lambda tok, k: self._forward([tok], pos + k))

    def observe(self, accepted: int, drafted: int) -> None:
        if self.adaptive:
            self.gamma = adapt_gamma(self.gamma, self.max_gamma, accepted, drafted)

    def state_bytes(self) -> int:
        """Bytes of the StreamingLLM cache (sinks + window; draft entries until the next step rolls them back)."""
        return self.cache.nbytes() if self.cache is not None else 0


def _make_magicdec(*, target=None, gamma: int = 10, sink: int = DEFAULT_SINK, window: int | None = None,
                   adaptive: bool = False) -> MagicDecDrafter:
    model = as_module(target)
    if model is None:
        raise RetrospecError("method 'magicdec' needs the target model")
    return MagicDecDrafter(model, gamma=gamma, sink=sink, window=window, adaptive=adaptive)


SPEC = register(MethodSpec(
    "magicdec", _make_magicdec, "the target itself over a StreamingLLM (sink + window) KV cache",
    knobs=(gamma_knob(5), ADAPTIVE, Knob("sink", "int", DEFAULT_SINK, "attention-sink tokens kept", min=0, max=1 << 20),
           Knob("window", "int", None, "recent tokens kept (default: max(1024, context / 24))", min=1,
                max=1 << 24)),
    default_gamma=5, context_gamma=10, context="optional", needs=frozenset({"target_kv"})))
