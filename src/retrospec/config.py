"""Validated knobs for sampling and decoding.

Invariant: every field is checked on construction, so code past this point can trust it. ``temperature == 0``
means greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those filters.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RetrospecError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise RetrospecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise RetrospecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise RetrospecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise RetrospecError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise RetrospecError("stop strings must be non-empty")
