"""The methods that draft nothing: ``ar`` (plain autoregressive decoding through the engine, every bench's
baseline) and the long-context baselines ``lc`` (the target over the full context) and ``rag`` (the target over
the retrieved chunks). Which prompt the target reads is decided by ``retrospec.long_requests``, not here.
"""

from __future__ import annotations

from .base import NoDraft
from .registry import MethodSpec, register


class _Baseline(NoDraft):
    def __init__(self, name: str):
        self.name = name


def _make_ar() -> NoDraft:
    return NoDraft()


def _make_lc() -> NoDraft:
    return _Baseline("lc")


def _make_rag() -> NoDraft:
    return _Baseline("rag")


AR = register(MethodSpec("ar", _make_ar, "nothing: plain autoregressive decoding (the baseline)"))
LC = register(MethodSpec("lc", _make_lc, "nothing: the target over the full long context", context="required"))
RAG = register(MethodSpec("rag", _make_rag, "nothing: the target over retrieved chunks of the context",
                          context="required", retrieval=True))
