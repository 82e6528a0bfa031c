"""Validated knobs for sampling and decoding, and the one table of their types and ranges.

``FIELDS`` declares every request-level field (name, JSON type, range): ``SamplingConfig`` and ``DecodeConfig``
check their values against it, the API checks its keyword arguments with it, and the server's validator and its
OpenAPI schema are built from it, so the three entry points accept exactly the same values.

Invariant: every field is checked on construction (type first: a string, a bool where a number is due, NaN or an
infinity is a ``RetrospecError``, never a ``TypeError``), so code past this point can trust it.
``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1`` disable those filters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RetrospecError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


@dataclass(frozen=True)
class Field:
    """One request field: ``kind`` "int" | "number"; ``lo``/``hi`` inclusive bounds unless ``lo_open``."""

    name: str
    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    help: str = ""
    want: str = ""  # how an error states the range, when the bounds say it badly (a 64-bit integer)

    def check(self, value, name: str | None = None):
        """``value`` as a Python int / float after the type and range check (``RetrospecError`` otherwise)."""
        name = name or self.name
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind == "number" else int):
            want = "an integer" if self.kind == "int" else "a number"
            raise RetrospecError(f"{name} must be {want}, got {value!r}")
        if self.kind == "number" and not math.isfinite(value):
            raise RetrospecError(f"{name} must be a finite number, got {value!r}")
        if self.want and not (self.lo <= value <= self.hi):
            raise RetrospecError(f"{name} must be {self.want}, got {value!r}")
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            want = self.range_text() if self.lo_open else f">= {self.lo:g}"
            raise RetrospecError(f"{name} must be {want}, got {value!r}")
        if self.hi is not None and value > self.hi:
            raise RetrospecError(f"{name} must be {self.range_text() if self.lo_open else f'<= {self.hi:g}'}, "
                                 f"got {value!r}")
        return float(value) if self.kind == "number" else int(value)

    def range_text(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"<= {self.hi:g}" if self.hi is not None else "any value"

    def json_schema(self) -> dict:
        """This field as a JSON Schema (OpenAPI 3.1) property."""
        out: dict = {"type": "integer" if self.kind == "int" else "number", "description": self.help}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


FIELDS = {f.name: f for f in (
    Field("temperature", "number", 0.0, 2.0, help="sampling temperature; 0 = greedy"),
    Field("top_p", "number", 0.0, 1.0, lo_open=True, help="nucleus sampling mass; 1 = off"),
    Field("top_k", "int", 0, 1 << 20, help="sample among the k most likely tokens; 0 = off"),
    Field("seed", "int", -(1 << 63), (1 << 64) - 1, help="seed of the sampler (same seed, same output)",
          want="a 64-bit integer"),
    Field("max_new_tokens", "int", 1, None, help="tokens to generate at most"),
)}


def check_stop(stop, name: str = "stop") -> tuple[str, ...]:
    """Stop strings: one string or a list/tuple of strings, each non-empty text UTF-8 can encode (no lone
    surrogates), at most ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_CHARS`` characters; duplicates dropped."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise RetrospecError(f"{name} must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise RetrospecError(f"{name}: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise RetrospecError("stop strings must be non-empty")
        if len(s) > MAX_STOP_CHARS:
            raise RetrospecError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {len(s)}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RetrospecError(f"stop strings must be text UTF-8 can encode ({exc.reason} at position "
                                 f"{exc.start})") from None
    return tuple(dict.fromkeys(stops))


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p"):
            object.__setattr__(self, name, FIELDS[name].check(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", FIELDS["seed"].check(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_new_tokens", FIELDS["max_new_tokens"].check(self.max_new_tokens))
        object.__setattr__(self, "stop_strings", check_stop(self.stop_strings, "stop strings"))


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (``retrospec serve`` flags of the same names).

    ``max_body_bytes``: a larger body is refused (413) before it is read whole; ``max_tokens``: the most new tokens
    one request may ask for (more: 400; a request must also fit the target's positions); ``max_seconds``: a
    generation still running after this long ends there (``finish_reason`` "length", ``retrospec.time_limited``);
    ``reject_special_tokens``: a raw completion prompt that spells a special token (``<|im_end|>``) is refused
    instead of parsed (chat messages never parse them); ``grace_s``: on SIGTERM, how long running requests may
    take to finish."""

    max_body_bytes: int = 4 << 20
    max_tokens: int = 4096
    max_seconds: float = 120.0
    reject_special_tokens: bool = False
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        for name, low in (("max_body_bytes", 1024), ("max_tokens", 1), ("max_seconds", 0.001), ("grace_s", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low \
                    or value == float("inf"):
                raise RetrospecError(f"{name} must be a finite number >= {low:g}, got {value!r}")
