"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Contract: ``Metrics`` is updated from the event loop (``count_request``) and from the generation worker
(``record_generation``) under one lock; ``render()`` returns the whole text. Every family has ``# HELP`` and
``# TYPE`` lines; counters end in ``_total``. Per-method families carry a ``method`` label; the derived gauges
follow the library's definitions (``retrospec.types``):

- ``retrospec_mean_accepted_tokens{method}`` = generated tokens / target calls over all requests of the method (τ);
  ``retrospec_acceptance_rate{method}`` = accepted / drafted tokens over all requests; the ``retrospec_last_*``
  gauges hold the same two figures for the method's latest request. The counters they come from are exported
  too, so any window can be derived with ``rate()``.
- ``retrospec_position_{drafted,accepted}_total{method,position}``: steps that drafted / accepted depth
  ``position`` (1-based); their ratio is the per-position acceptance.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from dataclasses import dataclass, field

from ..types import SpecStats

PREFIX = "retrospec_"
SUMMED = ("prompt_tokens", "new_tokens", "drafted_tokens", "accepted_tokens", "target_calls", "gated_steps")


@dataclass
class MethodTotals:
    requests: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_calls: int = 0
    gated_steps: int = 0
    generation_s: float = 0.0
    last_tau: float = 0.0
    last_acceptance: float = 0.0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._methods: dict[str, MethodTotals] = {}
        self._queue = 0

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self._requests[(route, int(status))] += 1

    def set_queue(self, n: int) -> None:
        with self._lock:
            self._queue = n

    def record_generation(self, stats: SpecStats, seconds: float, cancelled: bool = False) -> None:
        """One finished (or cancelled) generation and its ``SpecStats``."""
        with self._lock:
            m = self._methods.setdefault(stats.method, MethodTotals())
            m.requests += 1
            m.cancelled += int(cancelled)
            for name in SUMMED:
                setattr(m, name, getattr(m, name) + getattr(stats, name))
            m.generation_s += seconds
            m.last_tau, m.last_acceptance = stats.mean_accepted_tokens, stats.acceptance_rate
            for mine, theirs in ((m.pos_drafted, stats.per_position_drafted),
                                 (m.pos_accepted, stats.per_position_accepted)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v

    def render(self) -> str:
        with self._lock:
            requests, methods, queue = dict(self._requests), copy.deepcopy(self._methods), self._queue
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples) -> None:
            out.append(f"# HELP {PREFIX}{name} {help_}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            out.extend(f"{PREFIX}{name}{_labels(**labels)} {_num(v)}" for labels, v in samples)

        family("requests_total", "counter", "HTTP requests by route and status code.",
               [({"route": r, "status": str(s)}, n) for (r, s), n in sorted(requests.items())])
        family("queue_depth", "gauge", "Generations waiting or running (one runs at a time).", [({}, queue)])
        per = sorted(methods.items())
        for name, attr, help_ in (
                ("generations_total", "requests", "Generations run, by method."),
                ("generations_cancelled_total", "cancelled", "Generations stopped early because the client left."),
                ("prompt_tokens_total", "prompt_tokens", "Prompt tokens processed."),
                ("generated_tokens_total", "new_tokens", "Tokens generated (committed)."),
                ("drafted_tokens_total", "drafted_tokens", "Draft tokens proposed to the target."),
                ("accepted_tokens_total", "accepted_tokens", "Draft tokens accepted by the target."),
                ("target_calls_total", "target_calls", "Target verification forward calls."),
                ("gated_steps_total", "gated_steps", "Steps the gate ran without a draft although room was left."),
                ("generation_seconds_total", "generation_s", "Seconds spent generating (prefill included).")):
            family(name, "counter", help_, [({"method": k}, getattr(m, attr)) for k, m in per])
        family("mean_accepted_tokens", "gauge", "Mean accepted tokens (tau): generated tokens / target calls.",
               [({"method": k}, m.new_tokens / m.target_calls if m.target_calls else 0.0) for k, m in per])
        family("acceptance_rate", "gauge", "Accepted / drafted tokens over all requests.",
               [({"method": k}, m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else 0.0) for k, m in per])
        family("last_mean_accepted_tokens", "gauge", "Tau of the method's latest request.",
               [({"method": k}, m.last_tau) for k, m in per])
        family("last_acceptance_rate", "gauge", "Acceptance rate of the method's latest request.",
               [({"method": k}, m.last_acceptance) for k, m in per])
        family("position_drafted_total", "counter", "Steps that drafted depth `position` (1-based).",
               [({"method": k, "position": str(i + 1)}, v) for k, m in per for i, v in enumerate(m.pos_drafted)])
        family("position_accepted_total", "counter", "Steps that accepted depth `position` (1-based).",
               [({"method": k, "position": str(i + 1)}, v) for k, m in per for i, v in enumerate(m.pos_accepted)])
        return "\n".join(out) + "\n"
