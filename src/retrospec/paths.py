"""Where retrospec keeps what it writes outside a project (bottom rank: imports nothing from retrospec).

``cache_home()`` is ``$RETROSPEC_HOME``, else ``$XDG_CACHE_HOME/retrospec``, else ``~/.cache/retrospec``, read at
call time so a changed environment takes effect at once. Converted models live in ``models/``, the engine's
measured plans in ``fastpath/``, saved profiles in ``profiles/``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    if os.environ.get("RETROSPEC_HOME"):
        return Path(os.environ["RETROSPEC_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "retrospec"
