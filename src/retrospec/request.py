"""One fully resolved generation request: the hand-off from request preparation to the decode loop.

``api.prepare`` and ``long_requests.prepare_long_request`` build one; ``run.Run`` runs it. The dependency runs one
way: api -> long_requests -> request (-> drafters, models, config). A ``Request`` holds loaded models, prompt ids
and validated configs only (no text, templates or files); ``options`` are the factory's checked keyword arguments.
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
        """A fresh drafter: the method options plus ``target``, ``draft`` (``LoadedModel`` or None) and
        ``draft_model`` (the draft's torch module, or None)."""
        models = {"target": self.target, "draft": self.draft, "draft_model": self.draft.model if self.draft else None}
        return spec_of(self.method).build(**self.options | models)
