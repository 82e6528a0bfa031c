"""The CLI's contract, shared by every command (and ``python -m retrospec.demo``): quiet, offline libraries; a user
error is one line ``retrospec: error: ...`` on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
import warnings


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print a usage block first)
        where = self.prog.removeprefix("retrospec").strip()  # the subcommand, if any: the name is said once
        raise SystemExit(_fail(f"{where}: {message}" if where else message))


def _fail(message: str) -> int:
    print(f"retrospec: error: {message}", file=sys.stderr)
    return 2


def _dispatch(args) -> int:
    return int(args.func(args) or 0)


def guarded(call) -> int:
    """Run ``call()`` (argument parsing included) under the CLI's contract: quiet, offline libraries; a user error
    is one line on stderr and exit code 2. Shared by ``retrospec`` and ``python -m retrospec.demo``."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    from ..errors import RetrospecError

    try:
        return call()
    except RetrospecError as exc:
        return _fail(str(exc))
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else _fail(str(exc.code))
    except KeyboardInterrupt:
        print("retrospec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
