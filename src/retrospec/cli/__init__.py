"""``retrospec`` command line: ``generate``, ``bench``, ``profile``, ``serve``, ``models list|path|import-gguf``,
``zoo build|long|stream|info``, ``tasks make``, ``datastore build|info|eval``, ``corpus generate|info``,
``train rag-drafter|longspec|longspec-eval``, ``rag index``. A model name (``retrospec models list``) works
wherever a model directory does. Contract: a user error prints exactly one line ``retrospec: error: ...`` on stderr
and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .common import _dispatch, _Parser, guarded


def build_parser() -> argparse.ArgumentParser:
    from . import (bench_cmd, corpus_cmd, datastore_cmd, generate_cmd, models_cmd, profile_cmd, rag_cmd, serve_cmd,
                   tasks_cmd, train_cmd, zoo_cmd)

    parser = _Parser(prog="retrospec", description="Speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cmd in (generate_cmd, bench_cmd, profile_cmd, serve_cmd, models_cmd, zoo_cmd, tasks_cmd, datastore_cmd,
                corpus_cmd, train_cmd, rag_cmd):
        cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: _dispatch(build_parser().parse_args(argv)))


def entry() -> None:
    sys.exit(main())
