"""Running the app: bind the socket first, then serve it with uvicorn; ``BackgroundServer`` runs one in a thread.

Binding before loading any model makes a port in use (or a bad host) a one-line ``RetrospecError`` at once instead
of a uvicorn log line after the models loaded; uvicorn then serves the already bound socket.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

from ..errors import RetrospecError


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); port 0 picks a free port (read it with ``getsockname()``)."""
    if not 0 <= port <= 65535:
        raise RetrospecError(f"port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RetrospecError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free; a listening one is not
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise RetrospecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def uvicorn_server(app, log_level: str = "info", access_log: bool = True):
    """A uvicorn server for ``app`` that shuts down gracefully: on SIGTERM/SIGINT it stops accepting, the backend
    answers queued requests 503 and gives the running one the grace period (``Limits.grace_s``), and uvicorn's
    own wait is the same period, so every client gets an answer before the process exits."""
    import uvicorn

    backend = getattr(getattr(app, "state", None), "backend", None)
    grace = backend.limits.grace_s if backend is not None else 5.0

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = getattr(backend, "loop", None)
            if backend is not None and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(backend.begin_shutdown)  # not in the signal handler: it takes a lock
            super().handle_exit(sig, frame)

    return GracefulServer(uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                                         timeout_graceful_shutdown=grace))


class BackgroundServer:
    """``with BackgroundServer(app) as srv: ... srv.url ...``: uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(app, log_level=log_level, access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="retrospec-serve")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # as a SIGTERM would: graceful
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
