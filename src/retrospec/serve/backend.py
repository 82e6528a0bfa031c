"""The server's backend: models and datastores loaded once, and one generation worker thread.

Concurrency model: generation is torch code that holds the model, so requests run **one at a time, in arrival
order, on a single worker thread**; the asyncio event loop never runs torch and stays free to accept, validate and
stream. Interleaving decodes on one model would not raise throughput (each forward already uses torch's cores) but
would mix KV caches and gate timings; ``python -m retrospec.serve.loadtest`` shows throughput at the single-stream
rate whatever the client concurrency (README, Serving). Beyond ``max_queue`` waiting requests, 503.

Contract of a ``Job`` (one request):
- ``Backend.submit(params)`` queues it; the worker runs ``api.prepare`` and the decode loop, so tokenizers and
  models are only ever used from the worker thread.
- Events reach the event loop through an ``asyncio.Queue``: ``("start", prompt_tokens)``, then ``("text", delta)``
  per step that produced final text, then ``("done", Outcome)``; or ``("error", RetrospecError)`` (HTTP 400) /
  ``("fail", Exception)`` (a bug: HTTP 500, logged). The worker never dies with a request.
- ``job.cancel()`` (client disconnect) is checked before the job starts and between verification steps; the
  cancelled generation is counted in the metrics and the worker moves on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..api import prepare
from ..drafters import default_method
from ..drafters.registry import SPECS, methods as all_methods
from ..errors import RetrospecError
from ..models import (DEFAULT_TARGET, LoadedModel, check_same_vocab, default_target, load_model, lookup, paired_draft,
                      load_options, paired_longspec, placement)
from ..types import SpecStats
from .metrics import Metrics
from ..run import Run
from ..text import special_texts
from .protocol import Capabilities, Limits, Params, ProtocolError

log = logging.getLogger("retrospec.serve")


@dataclass
class Outcome:
    text: str  # final text (stop string cut off)
    token_ids: list[int]
    stats: SpecStats
    finish_reason: str  # "stop" (EOS, end of turn, stop string) or "length"
    prompt_tokens: int
    cancelled: bool = False
    time_limited: bool = False  # ended by the server's ``max_seconds`` (finish_reason "length")


class Job:
    def __init__(self, params: Params, loop: asyncio.AbstractEventLoop):
        self.params, self.loop = params, loop
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.poll_at = 0.0  # event-loop time of the next client-disconnect check (``app._next_event``)
        self.started = False  # the worker took it
        self.shutdown = False  # ended (or refused) because the server is shutting down

    def cancel(self, *, shutdown: bool = False) -> None:
        self.shutdown = self.shutdown or shutdown
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancel()


class Backend:
    """Loaded target, optional draft, datastores, metrics and the worker (see the module docstring)."""

    def __init__(self, target=None, draft=None, *, method: str | None = None, datastores=(), model_name: str | None = None,
                 max_queue: int = 256, longspec_draft=None, device=None, dtype=None, limits: Limits | None = None):
        self._load = load_options(device, dtype)  # for a target and draft given by path or name
        self.limits = limits or Limits()
        self._names = {"target": public_name(target, "target"), "draft": public_name(draft, "draft")}
        self.target = load_model(default_target() if target is None else target, role="target", **self._load)
        if self.target.tokenizer is None:
            raise RetrospecError(f"target {self.target.path} has no tokenizer; the server needs one for text")
        self.draft = self._load_draft(target, draft)
        self.longspec_src, self.longspec_block, self._no_longspec = self._load_longspec(target, longspec_draft)
        self.stores = self._open_stores(datastores)
        self.caps = self._capabilities(method, target, model_name or served_name(target, self.target))
        if max_queue < 1:
            raise RetrospecError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrospec-generate")
        self._lock = threading.Lock()
        self._pending: set[Job] = set()
        self.closing = False  # SIGTERM received: no new requests; the running one has until the grace period ends

    # ---- loading -------------------------------------------------------------------------------------------------
    def _load_draft(self, target, draft) -> LoadedModel | None:
        if draft is None and (target is None or isinstance(target, str)):
            draft = paired_draft(target)  # a named target's paired draft (zoo -> zoo-draft), else None
        if draft is None:
            return None
        drf = load_model(draft, role="draft", **(placement(self.target) | self._load))  # beside the target
        check_same_vocab(self.target, drf)
        return drf

    def _load_longspec(self, target, src) -> tuple[str | None, object, str | None]:
        """(source, block, why not): the given block (a bad one fails the start), else the target's bundled one."""
        from ..drafters.longspec import load_block

        hint = "start the server with --longspec-draft DIR|NAME"
        given = src is not None
        if not given:
            try:
                src = paired_longspec(target)  # None for a directory or a loaded model
            except RetrospecError as exc:  # a bundled block that is not built yet
                return None, None, f"no LongSpec draft block ({exc}); {hint}"
            if src is None:
                return None, None, f"no LongSpec draft block for this target: {hint}"
        name = str(src) if isinstance(src, (str, Path)) else type(src).__name__
        try:
            return name, load_block(src, self.target), None
        except RetrospecError as exc:
            if given:  # a block asked for explicitly fails the start
                raise
            return None, None, f"the bundled LongSpec block cannot be used ({exc}); {hint}"

    def _open_stores(self, datastores) -> dict[str, dict[str, object]]:
        from ..retrieval import open_store

        by_kind: dict[str, dict[str, object]] = {}
        for src in datastores:
            store = open_store(src, target=self.target)
            if by_kind.get(store.kind):
                raise RetrospecError(f"two {store.kind} datastores given ({next(iter(by_kind[store.kind]))}, "
                                     f"{src}); give one per kind")
            by_kind[store.kind] = {Path(str(src)).name: store}
        return by_kind

    def _capabilities(self, method: str | None, target, name: str) -> Capabilities:
        why = {m: "it needs a long context, which the server does not take" for m in all_methods()
               if m not in all_methods(context=False)}
        for m, spec in SPECS.items():
            if spec.draft == "lm" and self.draft is None and m not in why:
                why[m] = "no draft model: start the server with --draft"
            if {"block": self._no_longspec}.get(spec.draft):  # the draft kind this server could not load
                why[m] = self._no_longspec
            if spec.store and spec.store not in self.stores:
                why[m] = f"no {spec.store} datastore: start the server with --datastore DIR"
        methods = tuple(m for m in all_methods(context=False) if m not in why)
        if method is None:  # the target's fastest lossless method that this server can run
            method = default_method(target, usable=methods.__contains__)
        if method not in SPECS:
            raise RetrospecError(f"unknown method {method!r}; available: {', '.join(sorted(SPECS))}")
        if method not in methods:
            raise RetrospecError(f"method '{method}' cannot be served: {why[method]}")
        tok, embed = self.target.tokenizer, self.target.model.get_input_embeddings()
        return Capabilities(name, methods, method, self.stores, why, self.limits, special_texts(tok),
                            int(embed.weight.shape[0]))

    # ---- requests ------------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, params: Params) -> Job:
        job = Job(params, asyncio.get_running_loop())
        with self._lock:
            if self.closing:
                raise shutting_down()
            if len(self._pending) >= self.max_queue:
                raise ProtocolError(f"the server is busy ({len(self._pending)} requests queued); retry later",
                                    status=503, type="server_error")
            self._pending.add(job)
            self.metrics.set_queue(len(self._pending))
        self._executor.submit(self._run, job)
        return job

    def _run(self, job: Job) -> None:
        try:
            if job.cancelled:
                job.emit("done", None)
                return
            job.started = True
            self._generate(job)
        except RetrospecError as exc:
            job.emit("error", exc)
        except Exception as exc:  # a bug: log it with its traceback, answer 500, keep serving
            log.exception("generation %s failed", job.id)
            job.emit("fail", exc)
        finally:
            with self._lock:
                self._pending.discard(job)
                self.metrics.set_queue(len(self._pending))

    def _generate(self, job: Job) -> None:
        p = job.params
        kwargs = dict(p.kwargs)
        draft = {"lm": self.draft, "block": self.longspec_block}.get(SPECS[kwargs["method"]].draft)
        try:
            req = prepare(p.prompt, messages=p.messages, target=self.target, draft=draft, **kwargs)
        except RetrospecError as exc:
            if p.messages is not None and "no chat template" in str(exc):
                raise RetrospecError(f"model {self.caps.model!r} has no chat template, so it cannot chat; send a raw "
                                     "completion to /v1/completions instead") from None
            raise
        room = self.target.max_positions
        if room and len(req.prompt_ids) + kwargs["max_new_tokens"] > room:
            raise RetrospecError(f"{p.limit_param} ({kwargs['max_new_tokens']}) and the prompt ({len(req.prompt_ids)} tokens) "
                                 f"exceed the model's context of {room} tokens; ask for at most "
                                 f"{max(0, room - len(req.prompt_ids))}")
        job.emit("start", len(req.prompt_ids))
        t0 = time.perf_counter()
        run = Run(req)
        steps = iter(run)
        timed_out = False
        try:
            for _, delta in steps:
                if job.cancelled:
                    break
                if delta:
                    job.emit("text", delta)
                if time.perf_counter() - t0 > self.limits.max_seconds:
                    timed_out = True
                    break
        finally:
            steps.close()  # stops the decode loop (and finishes the text) whether it ran out, stopped or was cancelled
            self.metrics.record_generation(run.stats, time.perf_counter() - t0, cancelled=job.cancelled)
        if run.last_delta:
            job.emit("text", run.last_delta)
        finish = "length" if timed_out else run.finish_reason()
        job.emit("done", Outcome(run.text, list(run.token_ids), run.stats, finish, len(req.prompt_ids),
                                 job.cancelled, timed_out))

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests, answer queued ones 503 now, and give the running one until
        ``running_deadline(grace)``, then end it (503, or a final stream event); the rest of the grace period is
        for sending the answers and the process's own exit."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            waiting = [j for j in self._pending if not j.started]
        for job in waiting:
            job.cancel(shutdown=True)
            job.emit("error", shutting_down())
        timer = threading.Timer(running_deadline(self.limits.grace_s), self._end_running)
        timer.daemon = True
        timer.start()

    def _end_running(self) -> None:
        with self._lock:
            running = list(self._pending)
        for job in running:
            job.cancel(shutdown=True)

    def close(self) -> None:
        """Cancel whatever is queued or running and let the worker go (server shutdown)."""
        with self._lock:
            self.closing = True
            for job in self._pending:
                job.cancel(shutdown=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        """What ``/v1/models`` reports about this server besides the model id: names, never filesystem paths."""
        return {"target": self._names["target"] or self.caps.model,
                "draft": (self._names["draft"] or public_name(self.draft.path, "draft")) if self.draft else None,
                "longspec_draft": public_name(self.longspec_src, "block") if self.longspec_src else None,
                "methods": list(self.caps.methods), "default_method": self.caps.default_method,
                "knobs": {m: [*SPECS[m].knob_names, "gating"] for m in self.caps.methods},  # from the registry
                "unavailable": dict(sorted(self.caps.why_not.items())),  # method -> why this server cannot run it
                "datastores": {kind: list(s) for kind, s in self.stores.items()},
                "limits": {"max_tokens": self.limits.max_tokens, "max_seconds": self.limits.max_seconds,
                           "max_body_bytes": self.limits.max_body_bytes,
                           "reject_special_tokens": self.limits.reject_special_tokens}}


def running_deadline(grace_s: float) -> float:
    """Seconds after SIGTERM at which a running request is ended: the grace period less two seconds (at most half
    of it) left for answering, closing connections and exiting."""
    return max(grace_s / 2, grace_s - 2.0)


def shutting_down() -> ProtocolError:
    return ProtocolError("the server is shutting down; retry on another instance or later", status=503,
                         type="server_error", code="shutting_down")


def public_name(src, what: str) -> str | None:
    """How ``/v1/models`` names a model or block: a model name as given, else the last part of its path (never
    the path itself), else the class of an in-memory object."""
    if src is None:
        return None
    if isinstance(src, (str, Path)):
        text = str(src)
        if isinstance(src, str) and lookup(src) is not None and not Path(src).expanduser().exists():
            return src
        return Path(text.rstrip("/\\")).name or what
    return getattr(src, "__class__", type(src)).__name__


def served_name(src, loaded: LoadedModel) -> str:
    """The model id clients use: a model name as given (``zoo``), else the checkpoint directory's name."""
    if src is None:
        return DEFAULT_TARGET
    if isinstance(src, str) and lookup(src) is not None and not Path(src).expanduser().exists():
        return src
    return Path(loaded.path).name or str(loaded.path)
