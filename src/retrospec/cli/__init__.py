"""``retrospec`` command line: ``generate``, ``bench``, ``profile``, ``serve``, ``models list|path|import-gguf``,
``zoo build|long|stream|info``, ``tasks make``, ``datastore build|info|eval``, ``corpus generate|info``,
``train rag-drafter|longspec|longspec-eval``, ``rag index``, ``gpu``. A model name (``retrospec models list``)
works wherever a model directory does. Contract: a user error prints exactly one line ``retrospec: error: ...`` on
stderr and exits with code 2, never a traceback.
"""

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


def build_parser() -> argparse.ArgumentParser:
    from . import (bench_cmd, corpus_cmd, datastore_cmd, generate_cmd, models_cmd, profile_cmd, rag_cmd, serve_cmd,
                   tasks_cmd, train_cmd, zoo_cmd)

    parser = _Parser(prog="retrospec", description="Speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cmd in (generate_cmd, bench_cmd, profile_cmd, serve_cmd, models_cmd, zoo_cmd, tasks_cmd, datastore_cmd,
                corpus_cmd, train_cmd, rag_cmd):
        cmd.add_parser(sub)
    # the GPU runbook (issue 21), imported by name: gpu_cmd imports this package (no static import cycle)
    __import__(f"{__name__}.gpu_cmd", fromlist=["add_parser"]).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: _dispatch(build_parser().parse_args(argv)))


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


def entry() -> None:
    sys.exit(main())
