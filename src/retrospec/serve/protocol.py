"""The OpenAI wire format: request bodies -> validated generation parameters, results -> response objects.

Contract:
- ``parse(body, route, caps)`` checks one JSON body of ``/v1/completions`` (``route="completions"``) or
  ``/v1/chat/completions`` (``"chat"``) against what this server serves (``Capabilities``) and returns ``Params``
  (prompt or messages, and keyword arguments for ``retrospec.api.prepare``). Anything wrong raises ``ProtocolError``
  (HTTP status, one-line message, offending ``param``): unknown fields, wrong types, OpenAI features not implemented
  (``n > 1``, ``logprobs``, ``tools``, penalties, ...), unserved methods, knobs that do not apply to the method.
  Types and ranges come from the tables the API checks with (``config.FIELDS``, the registry's knobs), and the
  server's ``Limits`` (``max_tokens``); ``schema`` builds the OpenAPI description from the same tables.
- Defaults: ``max_tokens`` 16 for completions (as OpenAI), 128 for chat, at most the server's ``Limits.max_tokens``;
  ``temperature`` 0 (greedy; OpenAI's is 1). An integer-valued JSON number (``4.0``) is an integer.
  Absent knobs are not passed on, so ``prepare``'s defaults apply. Method knobs and their JSON types come from
  ``drafters.registry``; ``gating`` applies to all methods. Stop strings are applied by ``run.Run`` (OpenAI
  semantics: the stop sequence itself is not returned).
- ``shape`` builds responses and stream chunks; ``error_body`` the ``{"error": {"message", "type", "param",
  "code"}}`` object of every failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..config import FIELDS as CHECKED, Limits, check_stop
from ..drafters.registry import SPECS, all_knobs
from ..errors import RetrospecError

SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens")
KNOBS = all_knobs(context=False)  # every method knob a short-prompt request can carry (``drafters.registry``)
ALL_KNOBS = ("method", "gating", *KNOBS)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


BOOL, STR = (lambda v: isinstance(v, bool), "true or false"), (lambda v: isinstance(v, str), "a string")
JSON_KIND = {  # knob kind -> (check of the JSON value, what it must be)
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a number"),
    "bool": BOOL,
    "str": STR,
    "path": (STR[0], "a string (a datastore this server loaded)"),
    "widths": (STR[0], 'a string of widths per depth, e.g. "4,16,16"'),
}
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 128}
NEUTRAL = {  # standard fields accepted only at these (neutral) values
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None,), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}), "store": (None, False), "modalities": (None, ["text"])}
LACKS = {"n": "n > 1 (one choice per request)", "best_of": "best_of > 1", "suffix": "suffix (insertion)",
         "response_format": "response_format other than text", "modalities": "modalities other than text"}
HARMLESS = ("model", "user", "stream", "stream_options", "metadata", "service_tier")
CHAT_ONLY = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
             "modalities", "top_logprobs", "messages", "max_completion_tokens"}
COMPLETIONS_ONLY = {"prompt", "best_of", "echo", "suffix"}
FIELDS = {route: {*SAMPLING, *ALL_KNOBS, *NEUTRAL, *HARMLESS, *CHAT_ONLY, *COMPLETIONS_ONLY} - drop
          for route, drop in (("completions", CHAT_ONLY), ("chat", COMPLETIONS_ONLY))}


class ProtocolError(Exception):
    """A request the server refuses: ``status`` (400, 401, 404, 503), a one-line message, the offending field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Capabilities:
    """What one server can run: its model name, methods, default method, datastores by kind, and its limits."""

    model: str
    methods: tuple[str, ...]
    default_method: str
    stores: dict[str, dict[str, object]] = field(default_factory=dict)  # kind -> {label: opened store}
    why_not: dict[str, str] = field(default_factory=dict)  # method -> why this server cannot run it
    limits: Limits = field(default_factory=Limits)
    special_texts: tuple[str, ...] = ()  # what the target's tokenizer parses as special tokens
    vocab_size: int = 0  # token ids of a prompt must be below this (0: unchecked here)


@dataclass
class Params:
    """One validated request: what ``prepare`` gets (``kwargs``: method, sampling, knobs) and how to answer."""

    route: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    stream: bool
    max_tokens: int
    kwargs: dict
    limit_param: str = "max_tokens"  # the field that gave max_tokens (chat may say max_completion_tokens)


def _neutral(value, allowed) -> bool:
    return any(value is None if a is None else value == a and isinstance(value, bool) == isinstance(a, bool)
               for a in allowed)


def load_json(raw: bytes):
    """The request body as JSON: malformed JSON, NaN / Infinity (not JSON) and nesting deeper than Python's
    parser goes are each a 400, never an exception."""
    def no_constant(name):
        raise ProtocolError(f"the request body holds {name}, which is not JSON (numbers must be finite)")

    try:
        return json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and bytes that are not UTF-8
        raise ProtocolError(f"the request body is not valid JSON ({type(exc).__name__})") from None


def _check(body: dict, name: str, ok, want: str) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise ProtocolError(f"'{name}' must be {want}, got {body[name]!r}", param=name)


def _json_ints(body: dict) -> dict:
    """JSON has one number type: an integer-valued number (``4.0``) is the integer 4 for integer fields (JSON
    Schema agrees); any other float stays a float and is refused by the integer check."""
    ints = {"max_tokens", "max_completion_tokens", "top_k", "seed", "n", "best_of", "top_logprobs",
            *(name for name, knob in KNOBS.items() if knob.kind == "int")}
    return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v for k, v in body.items()}


def parse(body, route: str, caps: Capabilities) -> Params:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    body = _json_ints(body)
    unknown = sorted(set(body) - FIELDS[route])
    if unknown:
        raise ProtocolError(f"unknown field '{unknown[0]}' (retrospec knobs: {', '.join(ALL_KNOBS)}, top_k)",
                            param=unknown[0])
    for name, allowed in NEUTRAL.items():
        if name in body and not _neutral(body[name], allowed):
            raise ProtocolError(f"{LACKS.get(name, name)} is not supported by this server", param=name)
    model = body.get("model")
    if model is not None and model != caps.model:
        raise ProtocolError(f"model {model!r} is not served here; this server serves {caps.model!r}", param="model",
                            status=404, code="model_not_found")
    obj = (lambda v: isinstance(v, dict), "an object")
    for name, kind in (("stream", BOOL), ("stream_options", obj), ("user", STR), ("metadata", obj)):
        _check(body, name, *kind)
    kwargs = _sampling(body, route, caps.limits)
    kwargs.update(_method(body, caps))
    prompt, messages = (_prompt(body, caps), None) if route == "completions" else (None, _messages(body))
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return Params(route, prompt, messages, bool(body.get("stream") or False), kwargs["max_new_tokens"], kwargs,
                  limit)


def _sampling(body: dict, route: str, limits: Limits) -> dict:
    out: dict = {}
    limit = "max_tokens"
    if route == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise ProtocolError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
        limit = "max_completion_tokens"
    for name, field_name in ((limit, "max_new_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("seed", "seed")):
        if body.get(name) is not None:
            try:
                out[field_name] = CHECKED[field_name].check(body[name], name)
            except RetrospecError as exc:
                raise ProtocolError(str(exc), param=name) from None
    n = out.setdefault("max_new_tokens", min(DEFAULT_MAX_TOKENS[route], limits.max_tokens))
    if n > limits.max_tokens:
        raise ProtocolError(f"'{limit}' must be <= {limits.max_tokens} on this server, got {n}", param=limit)
    if body.get("stop") is not None:
        try:
            out["stop"] = list(check_stop(body["stop"], "'stop'"))
        except RetrospecError as exc:
            raise ProtocolError(str(exc), param="stop") from None
    return out


def _method(body: dict, caps: Capabilities) -> dict:
    _check(body, "method", *STR)
    method = body.get("method") or caps.default_method
    if method not in caps.methods:
        why = caps.why_not.get(method)
        raise ProtocolError(f"method {method!r} is not served here" + (f" ({why})" if why else "")
                            + f"; served: {', '.join(caps.methods)}", param="method")
    out: dict = {"method": method}
    _check(body, "gating", *BOOL)
    for name, knob in KNOBS.items():
        _check(body, name, *JSON_KIND[knob.kind])
    spec = SPECS[method]
    for name in (k for k in ALL_KNOBS if k != "method" and body.get(k) is not None):
        if name != "gating" and spec.knob(name) is None:
            knobs = ", ".join((*spec.knob_names, "gating"))
            raise ProtocolError(f"'{name}' does not apply to method {method!r} (its knobs: {knobs})", param=name)
        out[name] = body[name]
    try:
        spec.check({k: v for k, v in out.items() if k not in ("method", "gating", "datastore")})  # types, ranges
    except RetrospecError as exc:
        raise ProtocolError(str(exc), param=param_of(str(exc))) from None
    if spec.store:
        out["datastore"] = _store(caps, spec.store, out.get("datastore"))
    if "tree" in out and "gamma" in out:
        raise ProtocolError("longspec drafts a chain (gamma) or a tree (tree), not both", param="tree")
    return out


def _store(caps: Capabilities, kind: str, name: str | None):
    stores = caps.stores.get(kind, {})
    if name is None:
        return next(iter(stores.values()))  # a served rest/dresd method has one store of its kind
    if name not in stores:
        raise ProtocolError(f"datastore {name!r} is not loaded; {kind} stores served: {', '.join(stores)}",
                            param="datastore")
    return stores[name]


def _prompt(body: dict, caps: Capabilities):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        spelled = [t for t in caps.special_texts if t in p] if caps.limits.reject_special_tokens else []
        if spelled:
            raise ProtocolError(f"the prompt spells the special token {spelled[0]!r}, which this server refuses "
                                "in prompts (send chat messages, or token ids)", param="prompt")
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        bad = next((t for t in p if not 0 <= t < (caps.vocab_size or 1 << 62)), None)
        if bad is not None:
            raise ProtocolError(f"prompt token id {bad} is outside the vocabulary [0, {caps.vocab_size})",
                                param="prompt")
        return list(p)
    if p is None:
        raise ProtocolError("'prompt' is required", param="prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise ProtocolError("batched prompts are not supported; send one prompt per request", param="prompt")
    raise ProtocolError("'prompt' must be a string or a list of token ids", param="prompt")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ProtocolError(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ProtocolError(f"messages[{i}] has non-text content parts; only text is supported",
                                    param="messages")
            content = "".join(c["text"] for c in content)
        if m.get("tool_calls") or role == "tool":
            raise ProtocolError(f"messages[{i}]: tool calls are not supported", param="messages")
        out.append({"role": role, "content": content})
    return out  # roles and contents are checked by retrospec.chat (a RetrospecError -> 400)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def shape(route: str, rid: str, created: int, model: str, finish: str | None, *, text: str | None = None,
          delta: dict | None = None, **extra) -> dict:
    """A response or stream chunk: a completion carries ``text``; chat a message (``text``) or, in a chunk,
    ``delta``; ``extra`` (``usage``, ``retrospec``) goes at the top level."""
    if route == "completions":
        obj, choice = "text_completion", {"text": text}
    elif delta is None:
        obj, choice = "chat.completion", {"message": {"role": "assistant", "content": text}}
    else:
        obj, choice = "chat.completion.chunk", {"delta": delta}
    return {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}], **extra}


def param_of(message: str) -> str | None:
    """The request field a ``RetrospecError`` from ``prepare`` is about, when its message names one."""
    names = {"max_new_tokens": "max_tokens", "max_tokens": "max_tokens",
             "max_completion_tokens": "max_completion_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "gating": "gating", **{k: k for k in KNOBS}, "stop strings": "stop", "prompt": "prompt",
             "messages": "messages", "the prompt": "prompt", "the messages": "messages"}
    for key, param in names.items():
        if message.startswith(key):
            return param
    return "messages" if "chat template" in message else None
