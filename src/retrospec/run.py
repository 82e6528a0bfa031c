"""The one way a prepared ``Request`` runs: the API (``api.GenerationStream``), every bench and the server use it.

``Run(request)`` builds the drafter, runs the decode loop with the request's rule, gate, EOS ids and engine, fills
``stats``, optionally reuses a prompt forward (``memo``), and applies stop strings (``text.TextStream``). Invariants:
- Iterating yields ``(token ids, text delta)`` per verification step; ``token_ids`` is everything committed and kept
  (with stop strings, up to the token that completed one), ``text`` the final text.
- However iteration ends (closing or breaking out of it included), the decode loop stops and ``text`` and
  ``stopped`` are final.
- The caller's models leave as they came in: the engine verifies on a private copy, and the config's attention
  implementation and the train/eval mode are restored around the run (``_kept_as_is``); the run itself is in eval
  mode (no dropout).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .decode import speculative_generate
from .request import Request
from .text import TextStream
from .types import SpecStats
from .verify import PrefillMemo


@contextmanager
def _kept_as_is(model):
    """Run the block with ``model`` (None: nothing) in eval mode; restore its train/eval mode and per-model engine
    settings (the config's attention implementation) after it."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    training = getattr(model, "training", False)
    try:
        if training:
            model.eval()
        yield
    finally:
        if training:
            model.train()
        if config is not None and attn is not None and config._attn_implementation != attn:
            config._attn_implementation = attn


class Run:
    """One run of a prepared request (see the module docstring)."""

    def __init__(self, request: Request, stats: SpecStats | None = None, *, memo: PrefillMemo | None = None,
                 text: bool = True, max_new_tokens: int | None = None):
        self.request = request
        self.stats = stats if stats is not None else SpecStats(method=request.method, **request.info)
        self.memo = memo
        self.max_new_tokens = max_new_tokens or request.decode.max_new_tokens
        tok = request.target.tokenizer
        self.stream = TextStream(tok, request.decode.stop_strings) if text and tok is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self.last_delta = ""  # the text ``finish`` released after the last step

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stream is not None and self.stream.stopped

    def finish_reason(self) -> str:
        """OpenAI's finish reason: "stop" (EOS, end of turn, stop string) or "length"."""
        ids = self.token_ids
        if self.stopped or ids and ids[-1] in self.request.stop_ids():
            return "stop"
        return "length" if len(ids) >= self.max_new_tokens else "stop"

    def __iter__(self) -> Iterator[tuple[list[int], str]]:
        req, stream = self.request, self.stream
        per_token = stream is not None and bool(stream.stops)  # find the token that completes a stop string
        with _kept_as_is(req.target.model), _kept_as_is(req.draft.model if req.draft is not None else None):
            steps = speculative_generate(req.target.model, req.drafter(), req.prompt_ids, sampling=req.sampling,
                                         max_new_tokens=self.max_new_tokens, eos_ids=req.stop_ids(),
                                         stats=self.stats, rule=req.rule, prefill_memo=self.memo,
                                         gating=req.gating, fastpath=req.fastpath)
            try:
                for chunk in steps:
                    delta = ""
                    if per_token:
                        kept = []
                        for t in chunk:
                            kept.append(t)
                            delta += stream.push([t])
                            if stream.stopped:
                                break
                        chunk = kept
                    elif stream is not None:
                        delta = stream.push(chunk)
                    self.token_ids.extend(chunk)
                    yield chunk, delta
                    if self.stopped:
                        break
            finally:
                steps.close()
                if stream is not None:
                    full = stream.tok.decode(self.token_ids, skip_special_tokens=True)
                    self.last_delta = stream.finish(full)
                    self.text = stream.sent

    def run(self) -> list[int]:
        """Run to the end; returns the token ids."""
        for _ in self:
            pass
        return self.token_ids
