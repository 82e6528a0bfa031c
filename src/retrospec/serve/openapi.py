"""The server's OpenAPI description, built from the tables the validator checks with.

``GET /openapi.json`` declares every body field of ``/v1/completions`` and ``/v1/chat/completions`` with OpenAI's
names, and the types and ranges the server accepts: sampling fields from ``config.FIELDS``, method knobs from the
registry (``drafters.registry``), ``max_tokens`` from the server's ``Limits``, ``method`` and ``model`` from what
this server serves, fields accepted only at a neutral value (``n``, ``logprobs``, ...) as those values. A body the
schema allows may still be refused when fields disagree with each other (a knob of another method, a prompt longer
than the context); a body it forbids is always refused with a 4xx JSON error.
"""

from __future__ import annotations

from ..chat import ROLES
from ..config import FIELDS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from ..drafters.registry import SPECS
from .protocol import (COMPLETIONS_ONLY, CHAT_ONLY, KNOBS, NEUTRAL, Capabilities, DEFAULT_MAX_TOKENS, FIELDS as
                       ROUTE_FIELDS)

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERRORS = {"400": "a request the server refuses", "401": "no or a wrong API key", "404": "a model not served here",
          "413": "a body over the server's limit", "503": "the queue is full or the server is shutting down"}
KNOB_TYPES = {"int": "integer", "float": "number", "bool": "boolean"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _field(name: str, src: str | None = None, **override) -> dict:
    return _nullable(FIELDS[src or name].json_schema() | override)


def _knob(knob) -> dict:
    out: dict = {"type": KNOB_TYPES.get(knob.kind, "string"), "description": knob.help}
    if knob.kind in ("int", "float"):
        if knob.min is not None:
            out["minimum"] = knob.min
        if knob.max is not None:
            out["maximum"] = knob.max
    return _nullable(out)


def _neutral(allowed: tuple) -> dict:
    return {"enum": list(allowed)}


def body_schema(caps: Capabilities, route: str) -> dict:
    """The JSON Schema of one route's request body."""
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    obj = _nullable({"type": "object"})
    props: dict = {
        "model": _nullable({"type": "string", "enum": [caps.model]}),
        "max_tokens": _field("max_tokens", "max_new_tokens", maximum=caps.limits.max_tokens,
                             description=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS[route]})"),
        **{name: _field(name) for name in ("temperature", "top_p", "top_k", "seed")},
        "stop": _nullable({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}]}),
        "stream": _nullable({"type": "boolean"}), "stream_options": obj, "metadata": obj,
        "user": _nullable({"type": "string"}), "service_tier": _nullable({"type": "string"}),
        "method": _nullable({"type": "string", "enum": list(caps.methods),
                             "description": f"decoding method (default {caps.default_method})"}),
        "gating": _nullable({"type": "boolean", "description": "the draft-length gate (default: on when greedy)"}),
        **{name: _knob(knob) for name, knob in KNOBS.items()
           if any(SPECS[m].knob(name) is not None for m in caps.methods)},
        **{name: _neutral(allowed) for name, allowed in NEUTRAL.items()},
    }
    vocab = {"maximum": caps.vocab_size - 1} if caps.vocab_size else {}
    if route == "completions":
        props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "minItems": 1,
                                      "items": {"type": "integer", "minimum": 0, **vocab}}]}
        required = ["prompt"]
    else:
        text_part = {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
        message = {"type": "object", "required": ["role", "content"],
                   "properties": {"role": {"enum": [*ROLES, "developer"]},
                                  "content": {"anyOf": [{"type": "string", "minLength": 1},
                                                        {"type": "array", "minItems": 1, "items": text_part}]},
                                  "name": {"type": "string"}}}
        props["messages"] = {"type": "array", "minItems": 1, "items": message}
        props["max_completion_tokens"] = props["max_tokens"]
        required = ["messages"]
    drop = CHAT_ONLY if route == "completions" else COMPLETIONS_ONLY
    props = {k: v for k, v in props.items() if k in ROUTE_FIELDS[route] and (k not in drop or k in required)}
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}


def route_doc(caps: Capabilities, route: str, auth: bool) -> dict:
    """``app.post(...)`` keyword arguments that document one generation route."""
    json_error = {"content": {"application/json": {"schema": ERROR}}}
    responses = {"200": {"description": "the completion (JSON), or server-sent events when stream is true",
                         "content": {"application/json": {"schema": {"type": "object"}},
                                     "text/event-stream": {"schema": {"type": "string"}}}},
                 **{code: {"description": what, **json_error} for code, what in ERRORS.items()
                    if auth or code != "401"}}
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(caps, route)}}}}
    if auth:
        extra["security"] = [{"bearer": []}]
    return {"openapi_extra": extra, "responses": responses,
            "summary": "OpenAI-compatible " + ("completion" if route == "completions" else "chat completion")}


def finish_openapi(app, auth: bool) -> None:
    """Add the bearer-key scheme to the generated document (when the server has a key)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            if auth:
                doc.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
