"""Drafting methods, one file each, behind the ``Drafter`` protocol; ``REGISTRY`` maps method names to factories."""

from . import magicdec, prompt_lookup, rapid, small_lm  # noqa: F401  (registration side effect)
from . import dresd, rest  # noqa: F401  (retrieval drafters: REST, DReSD)
from . import longspec  # noqa: F401  (LongSpec: one-block draft over the target's KV cache)
from .base import REGISTRY, DecodeContext, Drafter, NoDraft, register

__all__ = ["REGISTRY", "DecodeContext", "Drafter", "NoDraft", "register"]
