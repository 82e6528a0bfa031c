"""The bench's one label grammar: ``method`` or ``method@key=value@key=value...``, checked against the method
registry (``drafters.registry``), so one run compares variants of a method side by side.

Keys (each at most once):
- ``gating=0|1``: this label without / with the gate (``gating``); methods that draft only;
- ``gamma=N``: a chain of N (methods with a ``gamma`` knob; longspec drafts a tree unless given one);
- ``tree=WxWx...``: longspec's widths per depth (``x``-separated so commas still separate labels);
- any other knob the method declares in the registry (e.g. ``longspec@lookup=10``, ``pld@max_ngram=4``), checked
  by the knob itself;
- with long-context rows only: ``draft=self|default`` (a draft-LM method drafts with the target itself even when
  --draft is set), ``adaptive=0|1`` (methods with ``adaptive_gamma``) and any ``LongContextOptions`` field
  (``eta``, ``window``, ``chunk_tokens``, ...).
HF peers (``hf-*``) take no keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafters.longspec import parse_tree
from ..drafters.registry import BASELINE, SPECS
from ..errors import RetrospecError
from ..request import LongContextOptions

SHORT_KEYS = "gating=0|1, gamma=N, tree=WxWx... (longspec), or a knob of the method"
LONG_KEYS = "draft=self|default, gamma=N >= 1, adaptive=0|1, gating=0|1, or one of: " + \
    ", ".join(sorted(LongContextOptions.__dataclass_fields__))


@dataclass(frozen=True)
class MethodLabel:
    """A parsed label: the method and what the label sets (None / empty = the run's default)."""

    method: str
    gating: bool | None = None
    gamma: int | None = None
    tree: tuple[int, ...] | None = None
    self_draft: bool = False
    adaptive: bool = False
    overrides: dict = field(default_factory=dict, hash=False)  # LongContextOptions fields
    knobs: dict = field(default_factory=dict, hash=False)  # other registry knobs of the method
    label: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.label:
            object.__setattr__(self, "label", self.method)


def _number(value: str):
    try:
        return float(value) if "." in value or "e" in value.lower() else int(value)
    except ValueError:
        return value


def parse_label(label: str, context: bool = False) -> MethodLabel:
    """A label -> ``MethodLabel`` (see the module docstring); ``context``: the run's rows have a long context."""
    name, *opts = label.split("@")
    spec = SPECS.get(name)
    ours = spec is not None and name != BASELINE
    keys = LONG_KEYS if context else SHORT_KEYS
    fields = set(LongContextOptions.__dataclass_fields__)
    seen: dict[str, object] = {}
    overrides: dict = {}
    knobs: dict = {}
    if context and (spec is None or spec.context == "never"):
        names = ", ".join(m for m, s in SPECS.items() if s.context != "never")
        raise RetrospecError(f"unknown long-context method {name!r}; available: {names}")

    def bad(opt: str, why: str) -> RetrospecError:
        return RetrospecError(f"bad method option {opt!r} in {label!r}: {why}")

    for opt in opts:
        key, eq, value = opt.partition("=")
        if key in seen or key in overrides or key in knobs:
            raise RetrospecError(f"{label!r} sets {key} twice")
        generic = ours and key not in ("gating", "gamma", "tree") and not (context and key in fields)
        knob = spec.knob(key) if generic else None
        if eq and knob is not None:
            value = value == "1" if knob.kind == "bool" and value in ("0", "1") else _number(value)
            knobs[knob.arg or knob.name] = knob.check(value)  # tree (widths) has its own branch
            continue
        if not eq or key not in ("gating", "gamma", "tree") and not (context and (key in ("draft", "adaptive")
                                                                                  or key in fields and value)):
            raise bad(opt, f"options are {keys}")
        if key == "gating":
            if value not in ("0", "1"):
                raise bad(opt, "gating takes 0 or 1")
            if not ours or (context and spec.knob("gamma") is None):
                raise RetrospecError(f"{label!r}: gating applies to our drafting methods, not to {name}")
            seen[key] = value == "1"
        elif key == "gamma":
            if not (value.isdigit() and int(value) >= 1):
                raise bad(opt, "gamma takes an integer >= 1")
            if not ours or spec.knob("gamma") is None:
                chains = ", ".join(m for m, s in SPECS.items() if s.knob("gamma") and s.context != "required")
                raise RetrospecError(f"{label!r}: gamma applies to chain drafters ({chains}), not to {name}"
                                     + (" (use --draft-len)" if ours and spec.knob("draft_len") else ""))
            seen[key] = int(value)
        elif key == "tree":
            if spec is None or spec.knob("tree") is None:
                raise RetrospecError(f"{label!r}: tree applies to longspec only")
            try:
                seen[key] = parse_tree(value.split("x"))  # longspec's own check of the widths
            except RetrospecError:
                raise bad(opt, "tree takes widths >= 1 per depth joined by x, e.g. tree=4x16x16") from None
        elif key == "draft":
            if value not in ("self", "default"):
                raise bad(opt, "draft takes self or default")
            if value == "self" and spec.draft != "lm":
                raise RetrospecError(f"{label!r}: draft=self applies to methods that draft with a draft LM only")
            seen["self_draft"] = value == "self"
        elif key == "adaptive":
            if value not in ("0", "1") or spec.knob("adaptive_gamma") is None:
                raise bad(opt, "adaptive takes 0 or 1, for methods that draft a chain with a draft length")
            seen[key] = value == "1"
        else:
            overrides[key] = _number(value)
    if "gamma" in seen and "tree" in seen:
        raise RetrospecError(f"{label!r}: longspec drafts a chain (gamma) or a tree (tree), not both")
    return MethodLabel(name, overrides=overrides, knobs=knobs, label=label, **seen)
