"""The HTTP layer: an OpenAI-compatible FastAPI app over one ``Backend`` (models, datastores, generation worker).

Routes: ``GET /health`` (never needs a key), ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` = server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /metrics`` (Prometheus text).

Contract:
- ``create_app(target, draft, ...)`` loads everything once (``RetrospecError`` on a bad path, a vocabulary
  mismatch, a method the server cannot run) and returns the app.
- Every failure is JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (including a
  ``RetrospecError`` from ``prepare``), 401 for a missing or wrong bearer key, 404 for an unknown model or route,
  503 when the queue is full, 500 for a bug (logged; the server keeps serving). A stream that fails after its first
  byte ends with one ``data: {"error": ...}`` event.
- Responses, and a stream's last chunk (the one with ``finish_reason``: "stop" or "length"), carry ``usage`` and
  ``retrospec`` (the request's ``SpecStats.to_dict()``).
- A client that disconnects cancels its generation: a stream at its next chunk, a plain request within half a
  second (its wait polls for the disconnect), a queued request before it starts.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .backend import Backend, Job, shutting_down
from .openapi import finish_openapi, route_doc
from .protocol import Limits, ProtocolError, error_body, load_json, param_of, parse, shape, usage

log = logging.getLogger("retrospec.serve")
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


def create_app(target=None, draft=None, *, method: str | None = None, datastores=(), api_key: str | None = None,
               model_name: str | None = None, max_queue: int = 256, longspec_draft=None, device=None,
               dtype=None, limits: Limits | None = None) -> FastAPI:
    """Load the models and datastores and build the app. ``target``/``draft``/``longspec_draft``: a directory, a
    name or a loaded object (default: the zoo, and a named target's paired draft and bundled LongSpec block);
    ``device``/``dtype``: where and how a target and draft given by path or name load (``load_model``);
    ``limits``: what one request may ask (``protocol.Limits``: body size, max_tokens, seconds, grace period)."""
    backend = Backend(target, draft, method=method, datastores=datastores, model_name=model_name,
                      max_queue=max_queue, longspec_draft=longspec_draft, device=device, dtype=dtype, limits=limits)
    return build_app(backend, api_key=api_key)


def build_app(backend: Backend, *, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        backend.loop = asyncio.get_running_loop()
        yield
        backend.close()

    app = FastAPI(title="retrospec", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.backend = backend
    app.add_middleware(_AuthAndCount, backend=backend, api_key=api_key)
    app.add_middleware(_BodyLimit, limit=backend.limits.max_body_bytes)

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_request, exc: ProtocolError):
        return ErrorResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        msg = (f"unknown route: {request.method} {request.url.path}" if exc.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405
               else str(exc.detail))
        return ErrorResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_request, exc: Exception):  # outside the generation routes' own guard; uvicorn logs it too
        return _failure("fail", exc)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.caps.model, "queue_depth": backend.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.caps.model, "object": "model", "created": 0,
                                            "owned_by": "retrospec", "retrospec": backend.describe()}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(backend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", **route_doc(backend.caps, "completions", bool(api_key)))
    async def completions(request: Request):
        return await _generate(backend, request, "completions")

    @app.post("/v1/chat/completions", **route_doc(backend.caps, "chat", bool(api_key)))
    async def chat_completions(request: Request):
        return await _generate(backend, request, "chat")

    finish_openapi(app, bool(api_key))
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("retrospec")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0"


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 before it is read whole (at once
    when ``Content-Length`` says so, else as soon as the bytes received pass the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(scope, receive, send)
        seen = [0]

        async def counted():  # a body sent without Content-Length (chunked): counted as it arrives
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.limit:
                    raise self._error()  # a ProtocolError: the app's handler answers it (413)
            return message

        await self.app(scope, counted, send)

    def _error(self) -> ProtocolError:
        return ProtocolError(f"the request body is larger than this server's limit of {self.limit} bytes",
                             status=413, code="request_too_large")

    async def _refuse(self, scope, receive, send):
        await ErrorResponse(self._error().body(), status_code=413, headers={"Connection": "close"})(
            scope, receive, send)


class _AuthAndCount:
    """ASGI middleware: the bearer-key check (every route but /health) and the request counter by route/status."""

    def __init__(self, app, backend: Backend, api_key: str | None):
        self.app, self.backend, self.api_key = app, backend, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            app = self.app
            if self.api_key and path != "/health" and not self._authorized(scope):
                app = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                              code="invalid_api_key"), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})
            await app(scope, receive, send_counted)
        finally:
            self.backend.metrics.count_request(path if path in ROUTES else "other", status[0])

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


async def _next_event(job: Job, request: Request):
    """The job's next event. Meanwhile, and at least every ``DISCONNECT_POLL_S`` however fast events come, checks
    whether the client left (then cancels the job and raises ClientGone)."""
    loop = asyncio.get_running_loop()
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, job.poll_at - loop.time()))
            if loop.time() >= job.poll_at:
                job.poll_at = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone
            if done:
                return getter.result()
    finally:
        if not getter.done():
            getter.cancel()


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote what the client sent, lone surrogates included, which UTF-8
    cannot encode (a plain ``JSONResponse`` would fail while rendering the 400)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _failure(kind: str, exc: Exception) -> JSONResponse:
    if isinstance(exc, ProtocolError):  # refused by the server (shutting down)
        return ErrorResponse(exc.body(), status_code=exc.status)
    if kind == "error":  # a RetrospecError from prepare / the drafter: the user's to fix
        return ErrorResponse(error_body(str(exc), param=param_of(str(exc))), status_code=400)
    return ErrorResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                        status_code=500)


def _result(backend: Backend, job: Job, route: str, finish: str | None, out, **kw) -> dict:
    """The response (``out``: an ``Outcome``), or a stream chunk (``out`` None)."""
    rid = ("cmpl-" if route == "completions" else "chatcmpl-") + job.id
    if out is not None:
        stats = out.stats.to_dict() | ({"time_limited": True} if out.time_limited else {})
        kw |= {"usage": usage(out.prompt_tokens, len(out.token_ids)), "retrospec": stats}
    return shape(route, rid, job.created, backend.caps.model, finish, **kw)


async def _generate(backend: Backend, request: Request, route: str) -> Response:
    params = parse(load_json(await request.body()), route, backend.caps)
    job = backend.submit(params)
    streaming = False  # once a StreamingResponse owns the job, its generator cancels it when it ends
    try:
        kind, value = await _next_event(job, request)
        if kind == "start" and params.stream:
            streaming = True
            return StreamingResponse(_sse(backend, job, route), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        while kind in ("start", "text"):
            kind, value = await _next_event(job, request)
        if kind in ("error", "fail"):
            return _failure(kind, value)
        if job.shutdown:  # ended by the server's shutdown before it finished
            return _failure("error", shutting_down())
        if value is None or value.cancelled:  # cancelled (before it started, or while it ran)
            return Response(status_code=499)
        return JSONResponse(_result(backend, job, route, value.finish_reason, value, text=value.text))
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:  # a bug in the handler: 500, logged, the server keeps going
        log.exception("request %s failed", job.id)
        return _failure("fail", exc)
    finally:
        if not streaming:
            job.cancel()  # a no-op for a finished job; stops one whose handler was cancelled (shutdown)


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(backend: Backend, job: Job, route: str):
    chat = route == "chat"
    try:
        if chat:
            yield _sse_line(_result(backend, job, route, None, None, delta={"role": "assistant", "content": ""}))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield _sse_line(_result(backend, job, route, None, None,
                                        **({"delta": {"content": value}} if chat else {"text": value})))
            elif kind == "done":
                if job.shutdown:  # the server is shutting down: a last event says so
                    yield _sse_line(shutting_down().body())
                    break
                if value is None or value.cancelled:
                    return
                yield _sse_line(_result(backend, job, route, value.finish_reason, value,
                                        **({"delta": {}} if chat else {"text": ""})))
                break
            else:
                yield _sse_line(json.loads(_failure(kind, value).body))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op once the job is done; stops the decode loop when the client went away
