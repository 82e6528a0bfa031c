"""Drafting methods, one file each, behind the ``Drafter`` protocol; ``REGISTRY`` maps method names to factories."""

from . import prompt_lookup, small_lm  # noqa: F401  (registration side effect)
from .base import REGISTRY, DecodeContext, Drafter, NoDraft, register

__all__ = ["REGISTRY", "DecodeContext", "Drafter", "NoDraft", "register"]
