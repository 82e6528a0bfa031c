"""Drafting methods, one file each, behind the ``Drafter`` protocol. Each file declares its method's
``MethodSpec`` (``registry``); ``SPECS`` maps names to specs and ``REGISTRY`` names to checked factories."""

from . import baselines, small_lm, prompt_lookup, magicdec  # noqa: F401  (registration side effect, in table order)
from . import rest, dresd, longspec, rapid  # noqa: F401
from .base import DecodeContext, Drafter, NoDraft, TargetViews
from .default import default_method
from .registry import REGISTRY, SPECS, Knob, MethodSpec, register, spec_of

__all__ = ["REGISTRY", "SPECS", "DecodeContext", "Drafter", "Knob", "MethodSpec", "NoDraft", "TargetViews",
           "default_method", "register", "spec_of"]
