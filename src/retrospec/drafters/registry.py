"""The method registry: one ``MethodSpec`` per decoding method, declared next to its drafter (one file each).

A spec holds what the layers above need: factory, needs (draft LM or LongSpec block, datastore kind, long context,
target KV / hidden-state views), knobs, default draft length, losslessness. The API's keyword checks, the CLI's
flags, the server and the bench's labels all derive from ``SPECS``.

Invariants:
- ``SPECS`` holds every method name a user can pass; ``REGISTRY`` (name -> ``spec.build``) is derived from it.
- A knob a method does not declare is refused everywhere with a ``RetrospecError`` naming its knobs (``check``;
  ``build`` likewise). Factories take their options as keyword arguments only (no ``**_``), plus whichever of the
  request's models (``target``, ``draft``, ``draft_model``) their signature names.
- This module imports nothing above ``errors``: specs are plain data.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

from ..errors import RetrospecError

BASELINE = "ar"  # plain decoding through the engine: what every prompt row's speedup is measured against
CONTEXT_BASELINE = "lc"  # the target over the whole long context: the baseline of long-context rows
MAX_DRAFT = 64  # the most tokens one draft may hold (a chain's length, a tree's depth): one step's work stays bounded
MODEL_ARGS = ("target", "draft", "draft_model")  # what a request hands a factory besides the method's options

# checked kinds -> (accepted types, what the error asks for); bool is accepted only by "bool"
_KINDS = {"int": (int, "an integer"), "bool": (bool, "true or false"), "str": (str, "a string"),
          "float": ((int, float), "a number")}


@dataclass(frozen=True)
class Knob:
    """One user-facing option of a method. ``kind``: int | float | bool | str | "path" (a datastore: a directory
    or an opened store) | "widths" (comma-separated ints, parsed by ``parse``)."""

    name: str
    kind: str
    default: object = None  # None = the drafter decides (e.g. from the sampling mode)
    help: str = ""
    min: float | None = None
    max: float | None = None  # a bound that keeps one request's work finite (e.g. a draft length)
    arg: str | None = None  # the factory's parameter name when it differs from ``name``
    parse: Callable | None = None  # text or a sequence -> value; raises RetrospecError

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value):
        """The validated value (None stays None = the default)."""
        if value is None:
            return None
        if self.parse is not None:
            return self.parse(value)
        types, want = _KINDS.get(self.kind, (None, ""))
        if types is not None and (not isinstance(value, types) or isinstance(value, bool) != (self.kind == "bool")):
            raise RetrospecError(f"{self.name} must be {want}, got {value!r}")
        if self.kind == "float" and not math.isfinite(value):
            raise RetrospecError(f"{self.name} must be a finite number, got {value!r}")
        if self.min is not None and value < self.min:
            raise RetrospecError(f"{self.name} must be >= {self.min:g}, got {value}")
        if self.max is not None and value > self.max:
            raise RetrospecError(f"{self.name} must be <= {self.max:g}, got {value}")
        return float(value) if self.kind == "float" else value


def gamma_knob(default: int | None) -> Knob:
    return Knob("gamma", "int", default, "draft length (tokens drafted per step)", min=1, max=MAX_DRAFT)


ADAPTIVE = Knob("adaptive_gamma", "bool", False, "grow gamma on full acceptance, shrink on rejection",
                arg="adaptive")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    factory: Callable
    summary: str
    knobs: tuple[Knob, ...] = ()
    default_gamma: int | None = None  # draft length when none is given (a short prompt)
    context_gamma: int | None = None  # ... over a long context
    draft: str = "none"  # "none" | "lm": a draft LM (required without a context; the target itself with one)
    #                      | "block": a LongSpec draft block (default: the named target's bundled one)
    store: str | None = None  # datastore kind it drafts from: "suffix" | "dense"
    context: str = "never"  # "never" | "optional" | "required": whether it reads a long context
    retrieval: bool = False  # with a context, retrieves chunks of it (rag: for the target; rapid: for the draft)
    needs: frozenset[str] = frozenset()  # views the decode loop hands the drafter ("target_kv", "hidden_states")
    lossless: bool = True
    lossy_when: str = ""  # the knob setting that makes it lossy (rapid: "eta > 0")
    load: Callable | None = None  # resolves its resources (a draft LM, a LongSpec block): see ``resolve``

    def knob(self, name: str) -> Knob | None:
        return next((k for k in self.knobs if k.name == name), None)

    @property
    def knob_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def check(self, options: dict, extra: tuple[str, ...] = (), context: bool = False) -> dict:
        """Validated user options -> the factory's keyword arguments, with the default gamma (``context``: over a
        long context) when none is given. A name that is no knob of this method is refused unless it is in ``extra``
        (passed through unchecked) or None (another method's knob left unset)."""
        out = {}
        for name, value in options.items():
            knob = self.knob(name)
            if knob is None:
                if name in extra:
                    out[name] = value
                elif value is not None or name not in all_knobs():
                    raise RetrospecError(f"'{name}' does not apply to method {self.name!r} "
                                         f"(its options: {', '.join(self.knob_names) or 'none'})")
                continue
            value = knob.check(value)
            if value is not None:
                out[knob.arg or knob.name] = value
        gamma = self.context_gamma if context else self.default_gamma
        if self.knob("gamma") is not None and "gamma" not in out and gamma is not None:
            out["gamma"] = gamma
        return out

    def resolve(self, target, draft, options: dict, *, context: bool = False, load: dict | None = None):
        """(the request's draft model or None, the factory options with the method's resources loaded), by the
        spec's ``load`` hook, declared next to the factory: ``load(spec, target, draft, options, context=...,
        load=...)`` with ``target`` a ``LoadedModel``, ``draft`` what the caller gave (None: the method's default,
        e.g. the named target's paired draft or bundled block) and ``load`` the device/dtype keywords for a model
        given by path or name. Without a hook the method has no draft; one given over a long context is refused."""
        if self.load is not None:
            return self.load(self, target, draft, dict(options), context=context, load=load or {})
        if draft is not None and context:
            users = [m for m, s in SPECS.items() if s.load is not None and s.context != "never"]
            raise RetrospecError(f"method '{self.name}' takes no draft model (--draft applies to "
                                 f"{' and '.join(users)})")
        return None, dict(options)

    def build(self, **options):
        """A fresh drafter; of the request's models, only those the factory takes are passed on. Knob values are
        checked here too, so a factory called directly refuses what the API would (``REGISTRY["pld"](gamma=0)``)."""
        params = inspect.signature(self.factory).parameters
        unknown = sorted(set(options) - set(params) - set(MODEL_ARGS))
        if unknown:
            raise RetrospecError(f"'{unknown[0]}' does not apply to method {self.name!r} "
                                 f"(its options: {', '.join(self.knob_names) or 'none'})")
        knobs = {k.arg or k.name: k for k in self.knobs}
        return self.factory(**{k: knobs[k].check(v) if k in knobs else v for k, v in options.items() if k in params})


SPECS: dict[str, MethodSpec] = {}
REGISTRY: dict[str, Callable] = {}  # name -> spec.build (a factory that checks its options)


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in SPECS:
        raise ValueError(f"method {spec.name!r} is declared twice")
    SPECS[spec.name] = spec
    REGISTRY[spec.name] = spec.build
    return spec


def spec_of(method) -> MethodSpec:
    """The spec of a method name; an unknown name is a ``RetrospecError`` listing the methods."""
    spec = SPECS.get(method) if isinstance(method, str) else None
    if spec is None:
        raise RetrospecError(f"unknown method {method!r}; available: {', '.join(sorted(SPECS))}")
    return spec


def methods(context: bool | None = None) -> tuple[str, ...]:
    """Method names in declaration order: all, short-prompt ones (``context=False``) or long-context ones (True)."""
    if context is None:
        return tuple(SPECS)
    return tuple(m for m, s in SPECS.items() if (s.context != "never" if context else s.context != "required"))


def all_knobs(context: bool | None = None) -> dict[str, Knob]:
    """Every knob name of the given methods -> its declaration (the first; shared names are declared alike)."""
    out: dict[str, Knob] = {}
    for m in methods(context):
        for k in SPECS[m].knobs:
            out.setdefault(k.name, k)
    return out

