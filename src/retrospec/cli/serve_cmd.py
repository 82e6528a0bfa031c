"""``retrospec serve``: an OpenAI-compatible server (see ``retrospec.serve``) for one target.

The socket is bound before the models load, so a port in use is a one-line error at once; a bad target, draft or
datastore is one too (exit 2, like every user error of the CLI). SIGTERM stops it gracefully (``serve.server``) and
the command exits 0.
"""

from __future__ import annotations

import os
import signal
import sys

from ..errors import RetrospecError
from ..config import Limits


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a target over an OpenAI-compatible HTTP API (completions, chat, SSE)")
    p.add_argument("--target", help="target model directory or name (default: zoo)")
    p.add_argument("--draft", help="draft model for sd (default: the named target's paired draft, if any)")
    p.add_argument("--longspec-draft", metavar="DIR|NAME",
                   help="LongSpec draft block of method longspec (default: the named target's bundled block, if any; "
                        "without one, longspec is not served)")
    p.add_argument("--method", default=None,
                   help="default method of requests that name none (default: the target's fastest lossless method "
                        "the server can run: longspec with its block, else sd with its draft, else pld; a request "
                        "picks another with the 'method' body field)")
    p.add_argument("--datastore", action="append", default=[], metavar="DIR",
                   help="retrieval store for rest (suffix) / dresd (dense), loaded at start; repeat to give both")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("RETROSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$RETROSPEC_API_KEY, else no key)")
    p.add_argument("--model-name", help="the model id clients send (default: the target's name or directory name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting or running before new ones get 503 (default: 256)")
    p.add_argument("--max-tokens", type=int, default=Limits.max_tokens,
                   help=f"the most new tokens one request may ask for; more is refused with 400 (default: "
                        f"{Limits.max_tokens}; a request must also fit the model's context)")
    p.add_argument("--max-seconds", type=float, default=Limits.max_seconds,
                   help=f"a generation running longer ends there with finish_reason 'length' (default: "
                        f"{Limits.max_seconds:g})")
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help=f"larger request bodies are refused with 413 before they are read (default: "
                        f"{Limits.max_body_bytes})")
    p.add_argument("--reject-special-tokens", action="store_true",
                   help="refuse raw completion prompts that spell a special token such as <|im_end|> (by default "
                        "they are parsed as that token; chat messages never are)")
    p.add_argument("--grace", type=float, default=Limits.grace_s,
                   help=f"seconds a running request may take to finish after SIGTERM (default: {Limits.grace_s:g})")
    p.add_argument("--threads", type=int, default=0, help="torch threads for generation (0 = torch's default)")
    from .generate_cmd import add_device_args

    add_device_args(p)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serve.app import create_app
    from ..serve.server import bind, uvicorn_server
    from .generate_cmd import device_kwargs

    if args.threads < 0:
        raise RetrospecError(f"--threads must be >= 0, got {args.threads}")
    if args.max_queue < 1:
        raise RetrospecError(f"--max-queue must be >= 1, got {args.max_queue}")
    try:
        limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, max_seconds=args.max_seconds,
                        reject_special_tokens=args.reject_special_tokens, grace_s=args.grace)
    except RetrospecError as exc:
        raise RetrospecError(f"--{str(exc).replace('_', '-').replace('grace-s', 'grace')}") from None
    sock = bind(args.host, args.port)
    try:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        app = create_app(args.target, args.draft, method=args.method, datastores=args.datastore,
                         api_key=args.api_key or None, model_name=args.model_name, max_queue=args.max_queue,
                         longspec_draft=args.longspec_draft, limits=limits, **device_kwargs(args))
        caps = app.state.backend.caps
        host, port = sock.getsockname()[:2]
        print(f"retrospec: serving {caps.model!r} (methods: {', '.join(caps.methods)}; default {caps.default_method}) "
              f"at http://{host}:{port}/v1" + (" (API key required)" if args.api_key else ""), file=sys.stderr)
        signal.signal(signal.SIGTERM, _stopped)  # the handler uvicorn restores and re-raises after a graceful stop
        uvicorn_server(app, log_level=args.log_level).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _stopped(_sig, _frame) -> None:
    """SIGTERM after uvicorn's graceful shutdown: the server stopped as asked, so the command exits 0."""
