"""``python -m tools.gpu ...`` (from the repository root): the GPU runbook's command line, ``tools.gpu.cli``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
