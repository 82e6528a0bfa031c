"""A small load generator for ``retrospec serve``: N completion requests from T client threads.

    python -m retrospec.serve.loadtest --url http://127.0.0.1:8000 --requests 200 --threads 8 --max-tokens 8

Prints requests/s, completion tokens/s, latency p50/p95/max and the error count (``--json``: one JSON object).
Standard library only (``urllib``); each request is one ``POST /v1/completions`` (``--stream``: with SSE, read to
``[DONE]``) over prompts cycled from a small built-in list or ``--prompt``. ``run_load`` is the same as a function
(the tests use it); it never raises for a failed request, it counts it in ``errors`` with its first message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

PROMPTS = ("def parse_header(line):\n    ", "import os\n\n\ndef walk(top):\n    ",
           "class Stack:\n    def push(self, x):", "    for key, value in items.items():\n",
           "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", "with open(path) as f:\n    ",
           "def quote(s):\n    return ", "if __name__ == '__main__':\n    ")


@dataclass
class LoadReport:
    requests: int
    ok: int
    errors: int
    seconds: float
    requests_per_s: float
    completion_tokens: int
    tokens_per_s: float
    p50_s: float
    p95_s: float
    max_s: float
    statuses: dict[str, int] = field(default_factory=dict)
    first_error: str = ""

    def line(self) -> str:
        return (f"{self.ok}/{self.requests} ok, {self.errors} errors in {self.seconds:.1f} s: "
                f"{self.requests_per_s:.2f} req/s, {self.tokens_per_s:.1f} completion tok/s, latency p50 "
                f"{self.p50_s * 1000:.0f} ms, p95 {self.p95_s * 1000:.0f} ms, max {self.max_s * 1000:.0f} ms"
                + (f"; first error: {self.first_error}" if self.first_error else ""))


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def _one(url: str, body: dict, api_key: str | None, timeout: float) -> tuple[int, int, str]:
    """(HTTP status, completion tokens, error message or '')."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if not body.get("stream"):
                obj = json.loads(resp.read())
                return resp.status, int(obj["usage"]["completion_tokens"]), ""
            tokens, done = 0, False
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        return resp.status, tokens, obj["error"].get("message", "stream error")
                    tokens = obj.get("usage", {}).get("completion_tokens", tokens)
            return resp.status, tokens, "" if done else "stream ended without [DONE]"
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read())["error"]["message"]
        except Exception:
            msg = str(exc)
        return exc.code, 0, msg
    except Exception as exc:  # connection refused / reset, timeout
        return 0, 0, f"{type(exc).__name__}: {exc}"


def run_load(url: str, *, requests: int = 200, threads: int = 8, max_tokens: int = 8, model: str | None = None,
             api_key: str | None = None, stream: bool = False, prompts=PROMPTS, extra: dict | None = None,
             timeout: float = 300.0) -> LoadReport:
    """Send ``requests`` completions from ``threads`` threads; the report counts every request exactly once."""
    endpoint = url.rstrip("/") + ("/completions" if url.rstrip("/").endswith("/v1") else "/v1/completions")

    def one(i: int) -> tuple[int, float, int, str]:
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, **({"model": model} if model else {}), **(extra or {})}
        t = time.perf_counter()
        status, tokens, err = _one(endpoint, body, api_key, timeout)
        return status, time.perf_counter() - t, tokens, err

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = list(pool.map(one, range(requests)))
    seconds = time.perf_counter() - t0
    lat = sorted(r[1] for r in results)
    ok = sum(1 for r in results if r[0] == 200 and not r[3])
    tokens = sum(r[2] for r in results)
    return LoadReport(requests=len(results), ok=ok, errors=len(results) - ok, seconds=seconds,
                      requests_per_s=len(results) / seconds if seconds else 0.0, completion_tokens=tokens,
                      tokens_per_s=tokens / seconds if seconds else 0.0, p50_s=_quantile(lat, 0.5),
                      p95_s=_quantile(lat, 0.95), max_s=lat[-1] if lat else 0.0,
                      statuses=dict(Counter(str(r[0]) for r in results)),
                      first_error=next((r[3] for r in results if r[3]), ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m retrospec.serve.loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root or its /v1 URL")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", help="model id to send (default: none, the server's own)")
    p.add_argument("--api-key")
    p.add_argument("--method", help="the 'method' body field (default: the server's)")
    p.add_argument("--prompt", action="append", help="prompt (repeatable; default: a built-in list of 8)")
    p.add_argument("--stream", action="store_true", help="stream each response (SSE)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.requests < 1 or args.threads < 1 or args.max_tokens < 1:
        print("loadtest: error: --requests, --threads and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    rep = run_load(args.url, requests=args.requests, threads=args.threads, max_tokens=args.max_tokens,
                   model=args.model, api_key=args.api_key, stream=args.stream, prompts=tuple(args.prompt or PROMPTS),
                   extra={"method": args.method} if args.method else None)
    print(json.dumps(asdict(rep)) if args.json else rep.line())
    return 0 if rep.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
