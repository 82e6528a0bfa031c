"""The methods that draft nothing: ``ar`` (plain autoregressive decoding through the engine, every bench's
baseline) and the long-context baselines ``lc`` (the target over the full context) and ``rag`` (the target over
the retrieved chunks). Which prompt the target reads is decided by ``retrospec.request``, not here.
"""

from __future__ import annotations

from .base import NoDraft
from .registry import MethodSpec, register

register(MethodSpec("ar", lambda: NoDraft(), "nothing: plain autoregressive decoding (the baseline)"))
register(MethodSpec("lc", lambda: NoDraft("lc"), "nothing: the target over the full long context", context="required"))
register(MethodSpec("rag", lambda: NoDraft("rag"), "nothing: the target over retrieved chunks of the context",
                    context="required", retrieval=True))
