"""The default method: the fastest lossless method a target has, the one choice ``retrospec generate``, the API,
the server and the demo make when no method is named.

Order (fastest first, all lossless): ``longspec`` with the target's bundled LongSpec block
(``models.paired_longspec``), else ``sd`` with its paired draft (``models.paired_draft``), else ``pld`` (prompt
lookup needs nothing). A draft the caller gives decides instead: a LongSpec block means ``longspec``, a draft LM
``sd``. Over a long context it is ``sd``, which drafts with the target itself when no draft is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import RetrospecError

PREFERENCE = ("longspec", "sd", "pld")  # fastest first
CONTEXT_DEFAULT = "sd"


def default_method(target=None, draft=None, *, context: bool = False,
                   usable: Callable[[str], bool] | None = None) -> str:
    """The method a request without one runs (module docstring); ``target``/``draft`` as the caller gave them
    (None: the default target / no draft). ``usable(method)``: what the caller can run, instead of looking for the
    target's pairs (the server, which loaded its draft and block at start)."""
    if context:
        return CONTEXT_DEFAULT
    if draft is not None:
        return "longspec" if _is_block(draft) else "sd"
    for method in PREFERENCE:
        if usable(method) if usable is not None else _has(method, target):
            return method
    return PREFERENCE[-1]


def _has(method: str, target) -> bool:
    """Whether ``target`` has what ``method`` needs by default (a pair that is not built yet counts as none)."""
    from ..models import paired_draft, paired_longspec

    find = {"longspec": paired_longspec, "sd": paired_draft}.get(method)
    try:
        return find is None or find(target) is not None
    except RetrospecError:
        return False


def _is_block(draft) -> bool:
    from ..models import NAMED, lookup
    from ..models.longspec import LongSpecDraft

    if isinstance(draft, LongSpecDraft):
        return True
    if not isinstance(draft, (str, Path)):
        return False
    path = Path(draft).expanduser()
    named = lookup(str(draft)) if not path.exists() else None
    return (path / "longspec.json").is_file() or named is not None and any(m.longspec == named.name for m in NAMED)
