"""One fully resolved generation request: the hand-off from request preparation to the decode loop.

``api.prepare`` (short prompts) and ``long_requests.prepare_long_request`` (a long context) both build a
``Request``; ``api.GenerationStream`` and the bench harnesses run one. This module sits below both preparers so
the dependency runs one way: api -> long_requests -> request (-> drafters, models, config).

Contract: a ``Request`` holds loaded models, prompt token ids and validated configs only; nothing here reads text,
applies templates or touches files. ``drafter()`` builds a fresh drafter from the method's spec (``drafters.registry``) for each run; ``options`` are
the factory's keyword arguments, already checked against the spec by the preparer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import DecodeConfig, SamplingConfig
from .drafters import spec_of
from .models import LoadedModel


@dataclass
class Request:
    target: LoadedModel
    draft: LoadedModel | None
    method: str
    prompt_ids: list[int]
    sampling: SamplingConfig
    decode: DecodeConfig
    options: dict = field(default_factory=dict)
    rule: object = None  # an AcceptanceRule; None = the exact rule for the sampling mode
    info: dict = field(default_factory=dict)  # request-level stats (long context: retrieval_s, retrieved_tokens)
    eos_ids: frozenset[int] | None = None  # None = the target's own; chat adds the template's end-of-turn id
    gating: bool = True  # the decode loop's gate picks each step's draft budget (``gating``); False = always full
    fastpath: str | None = None  # the verifier's engine (``fastpath``): None = measured default, "off" = model as is

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end generation (the last one is kept in the output)."""
        return self.target.eos_ids() if self.eos_ids is None else self.eos_ids

    def drafter(self):
        """Build this request's drafter. Factories get the method options plus ``target`` (a ``LoadedModel``),
        ``draft`` (a ``LoadedModel`` or None) and ``draft_model`` (the draft's torch module, or None)."""
        opts = dict(self.options)
        opts.update(target=self.target, draft=self.draft, draft_model=self.draft.model if self.draft else None)
        return spec_of(self.method).build(**opts)
