"""Serving many clients: one greedy completion workload through the OpenAI API at 1, 4, 16 concurrent clients.

    python -m retrospec.bench.serving --out runs/serving [--concurrency 1,4,16] [--rows retrospec,vllm,...]

The same requests go to ``retrospec serve`` and to vLLM's OpenAI server (``vllm serve``, from the peer's virtualenv:
``make peers-vllm``, or any interpreter named by ``$RETROSPEC_VLLM_PYTHON``), one server at a time, each in a
process of its own. Rows (``--rows``, default all):

- ``retrospec``: ``retrospec serve`` with its default method (the target's fastest lossless one);
- ``retrospec-ar``: the same server with ``--method ar`` (plain decoding);
- ``vllm``: vLLM, plain decoding; ``vllm-ngram``: with its n-gram proposer; ``vllm-retrospec``: with our prompt
  lookup as its ``custom_class`` proposer (``integrations.vllm_proposer``). vLLM runs the target's checkpoint
  directory in float32 (or bfloat16) with prefix caching off, as in the bench's ``vllm-*`` rows.

Per row: the server starts on a free loopback port (its log in ``OUT/logs/ROW.log``) and is ready when
``/v1/models`` answers; a server that exits first or does not answer within ``--ready-timeout`` gives the row a note
(its exit code and last log line), never a traceback, and a row whose server is not installed is skipped with a note.
Then ``--warmup`` requests, then at each concurrency c, ``max(--min-requests, --per-client × c)`` requests from c
client threads (``serve.loadtest.run_load``): raw text completions of the held-out code prompts (the bench's
``heldout`` preset, a different prompt for each request of a level), ``temperature`` 0, ``max_tokens`` 64
(``--max-tokens``). Then SIGTERM (and the server's process group is killed if anything of it lingers).

Reported per row and concurrency (``OUT/report.md``, ``OUT/results.json``): requests/s, completion tokens/s (the
servers' ``usage.completion_tokens`` over the level's wall time), latency p50/p95, errors; and one sentence from the
numbers: the first concurrency at which vLLM's best row passes retrospec serve's best row in completion tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

from ..errors import RetrospecError
from ..serve.loadtest import run_load
from . import vllm_peer

ROWS = ("retrospec", "retrospec-ar", "vllm", "vllm-ngram", "vllm-retrospec")
RETROSPEC, VLLM = "retrospec serve", "vLLM"
PORT = "{port}"  # in a row's argv: replaced by the free port the server gets


@dataclass
class ServerRow:
    """One server to measure: its command (``{port}`` filled in at start) and extra environment; or why it is
    skipped (``note``)."""

    name: str
    server: str  # RETROSPEC or VLLM: which side of the comparison
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""  # non-empty: skipped, and why


@dataclass
class RowResult:
    row: str
    server: str
    command: str = ""
    note: str = ""  # why the row has no (or fewer) levels
    version: str = ""
    startup_s: float = 0.0  # start to the first /v1/models answer
    warmup_s: float = 0.0
    levels: list[dict] = field(default_factory=list)  # {"concurrency": c, **LoadReport}


# ---- rows ------------------------------------------------------------------------------------------------------------
def _retrospec_row(name: str, target: str, dtype: str, threads: int) -> ServerRow:
    script = Path(sys.executable).with_name("retrospec")  # the console script beside this interpreter
    argv = [str(script)] if script.is_file() else [sys.executable, "-c", "from retrospec.cli import entry; entry()"]
    argv += ["serve", "--target", target, "--dtype", dtype, "--threads", str(threads), "--host", "127.0.0.1",
             "--port", PORT, "--log-level", "warning"]
    return ServerRow(name, RETROSPEC, argv + (["--method", "ar"] if name == "retrospec-ar" else []))


def _checkpoint(target: str) -> Path:
    """The target's checkpoint directory: the directory given, or a named model's (converted once if needed)."""
    if Path(target).is_dir():
        return Path(target).resolve()
    from ..models.named import resolve_name

    return resolve_name(target)


def _vllm_rows(names: list[str], target: str, dtype: str, threads: int, k: int, max_ngram: int,
               max_model_len: int) -> list[ServerRow]:
    python = vllm_peer.peer_python()
    why = None if python else f"vLLM is not installed (make peers-vllm, or ${vllm_peer.PYTHON_ENV})"
    if why is None and dtype not in vllm_peer.FORMATS:
        why = f"vLLM's CPU build has no format matching {dtype}"
    model = None
    if why is None:
        try:
            model = _checkpoint(target)
        except RetrospecError as exc:
            why = str(exc)
        if model is not None and not (model / "config.json").is_file():
            why = f"vLLM needs the target's checkpoint directory (no config.json in {model.name})"
    if why is not None:
        return [ServerRow(n, VLLM, note=f"skipped: {why}") for n in names]
    env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}  # as the bench's worker (vllm_worker.py)
    rows = []
    for n in names:
        spec = vllm_peer.speculative({"vllm": "vllm-ar"}.get(n, n), k, max_ngram)
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
                Path(target).name, "--host", "127.0.0.1", "--port", PORT, "--dtype", vllm_peer.FORMATS[dtype],
                "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--gpu-memory-utilization",
                "0.3", "--seed", "0", "--disable-uvicorn-access-log"]
        if spec["speculative_config"]:
            argv += ["--speculative-config", json.dumps(spec["speculative_config"])]
        rows.append(ServerRow(n, VLLM, argv, env | spec["env"]))
    return rows


def build_rows(names, *, target: str = "smollm2-135m", dtype: str = "float32", threads: int = 2, k: int = 5,
               max_ngram: int = 3, max_model_len: int = 2048) -> list[ServerRow]:
    """The rows asked for, in ``ROWS`` order; a vLLM row that cannot run comes back with a ``note`` (skipped)."""
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise RetrospecError(f"unknown row(s) {', '.join(unknown)}; available: {', '.join(ROWS)}")
    wanted = [n for n in ROWS if n in names]
    ours = [_retrospec_row(n, target, dtype, threads) for n in wanted if not n.startswith("vllm")]
    peer = [n for n in wanted if n.startswith("vllm")]
    return ours + (_vllm_rows(peer, target, dtype, threads, k, max_ngram, max_model_len) if peer else [])


# ---- one server ------------------------------------------------------------------------------------------------------
class ServerFailed(Exception):
    """The server exited or did not get ready: the row's note."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """A row's server process (a session of its own, so that stopping it reaches every process it started)."""

    def __init__(self, row: ServerRow, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [a.replace(PORT, str(self.port)) for a in row.argv]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=os.environ | row.env, start_new_session=True)

    def last_log_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    def wait_ready(self, timeout_s: float) -> str:
        """The served model id, once ``/v1/models`` answers; ``ServerFailed`` if the process exits or time is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerFailed(f"the server exited with code {code} before answering /v1/models "
                                   f"({self.last_log_line()})")
            try:
                models = _get_json(self.url + "/v1/models")
                return models["data"][0]["id"]
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise ServerFailed(f"the server did not answer /v1/models within {timeout_s:g} s "
                                   f"(last log line: {self.last_log_line()})")
            time.sleep(0.25)

    def version(self) -> str:
        try:
            return str(_get_json(self.url + "/version").get("version", ""))
        except Exception:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to the process group if the server (or a process it started) is still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the group outlives its leader while an engine process shuts down
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()


# ---- the run ---------------------------------------------------------------------------------------------------------
def requests_at(concurrency: int, per_client: int, min_requests: int) -> int:
    return max(min_requests, per_client * concurrency)


def _say(msg: str) -> None:
    print(f"serving: {msg}", file=sys.stderr, flush=True)


def measure_row(row: ServerRow, prompts: list[str], concurrency: list[int], out: Path, *, max_tokens: int = 64,
                per_client: int = 2, min_requests: int = 4, warmup: int = 2, ready_timeout: float = 600.0,
                request_timeout: float = 600.0) -> RowResult:
    """Start the row's server, warm it up, run the load at each concurrency, stop it. Never raises for the server."""
    res = RowResult(row.name, row.server, note=row.note)
    if row.note:
        return res
    t0 = time.perf_counter()
    try:
        server = Server(row, out / "logs" / f"{row.name}.log")
    except OSError as exc:
        res.note = f"failed: the server could not be started ({exc})"
        _say(f"{row.name}: {res.note}")
        return res
    res.command = shlex.join(server.argv)
    try:
        model = server.wait_ready(ready_timeout)
        res.startup_s = time.perf_counter() - t0
        res.version = server.version()
        _say(f"{row.name}: ready in {res.startup_s:.1f} s")
        load = dict(max_tokens=max_tokens, model=model, prompts=prompts, timeout=request_timeout)
        if warmup > 0:
            t1 = time.perf_counter()
            rep = run_load(server.url, requests=warmup, threads=min(2, warmup), **load)
            res.warmup_s = time.perf_counter() - t1
            if rep.ok == 0:
                raise ServerFailed(f"every warm-up request failed ({rep.first_error})")
        for c in concurrency:
            rep = run_load(server.url, requests=requests_at(c, per_client, min_requests), threads=c, **load)
            res.levels.append({"concurrency": c, **asdict(rep)})
            _say(f"{row.name} at {c} clients: {rep.line()}")
            if server.proc.poll() is not None:
                raise ServerFailed(f"the server exited with code {server.proc.returncode} during the load "
                                   f"({server.last_log_line()})")
    except ServerFailed as exc:
        res.note = f"failed: {exc}"
        _say(f"{row.name}: {res.note}")
    finally:
        server.stop()
    return res


def verdict(results: list[RowResult]) -> str:
    """One sentence: the first concurrency at which vLLM's best row passes retrospec serve's best row in completion
    tokens/s (levels where both sides answered at least one request)."""
    def best(side: str, c: int):
        got = [(lv["tokens_per_s"], r.row) for r in results if r.server == side for lv in r.levels
               if lv["concurrency"] == c and lv["ok"] > 0]
        return max(got) if got else None

    levels = sorted({lv["concurrency"] for r in results for lv in r.levels})
    both = [(c, best(RETROSPEC, c), best(VLLM, c)) for c in levels]
    both = [(c, o, p) for c, o, p in both if o and p]
    if not both:
        side = "retrospec serve" if not any(best(RETROSPEC, c) for c in levels) else "vLLM"
        return f"No comparison: no {side} row was measured."
    for i, (c, (o_tps, o_row), (p_tps, p_row)) in enumerate(both):
        if p_tps > o_tps:
            since = "already at" if i == 0 else "at"
            clients = "1 client" if c == 1 else f"{c} concurrent clients"
            before = ""
            if i > 0:
                c0, (o0, o0_row), (p0, p0_row) = both[i - 1]
                before = f" (at {c0}: {p0_row} {p0:.1f} against {o0_row} {o0:.1f})"
            return (f"vLLM overtakes retrospec serve in completion tokens/s {since} {clients}: {p_row} "
                    f"{p_tps:.1f} tok/s against {o_row} {o_tps:.1f} tok/s{before}.")
    c, (o_tps, o_row), (p_tps, p_row) = both[-1]
    return (f"vLLM does not overtake retrospec serve within {c} concurrent clients: at {c}, {p_row} "
            f"{p_tps:.1f} tok/s against {o_row} {o_tps:.1f} tok/s.")


def table(results: list[RowResult]) -> str:
    lines = ["| row | server | clients | requests | req/s | completion tok/s | p50 latency s | p95 latency s "
             "| errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for lv in r.levels:
            lines.append(f"| `{r.row}` | {r.server} | {lv['concurrency']} | {lv['requests']} | "
                         f"{lv['requests_per_s']:.2f} | {lv['tokens_per_s']:.1f} | {lv['p50_s']:.2f} | "
                         f"{lv['p95_s']:.2f} | {lv['errors']} |")
    return "\n".join(lines)


def report_md(doc: dict, results: list[RowResult]) -> str:
    cfg, machine = doc["config"], doc["machine"]
    setup = (f"{machine['cpu']}, {machine['cores']} cores. Target `{cfg.get('target', '?')}` "
             f"({cfg.get('dtype', '?')}), {cfg.get('preset', 'given')} prompts as raw text completions, temperature 0, "
             f"max_tokens {cfg['max_tokens']}; at c clients, max({cfg['min_requests']}, {cfg['per_client']}×c) "
             f"requests after {cfg['warmup']} warm-up requests")
    if "k" in cfg:
        setup += f"; vLLM's proposers: {cfg['k']} speculative tokens, n-grams of 1 to {cfg.get('max_ngram', '?')}"
    lines = [f"# Serving many clients ({doc['date']})", "", f"`{doc['command']}`", "", setup + ".", "",
             table(results), "", doc["verdict"]]
    notes = [f"- `{r.row}`: {r.note}" for r in results if r.note]
    if notes:
        lines += ["", "Notes:", *notes]
    ready = [f"- `{r.row}`: ready in {r.startup_s:.0f} s{f', version {r.version}' if r.version else ''}; "
             f"`{r.command}`" for r in results if r.command]
    if ready:
        lines += ["", "Servers:", *ready]
    return "\n".join(lines) + "\n"


def run(rows: list[ServerRow], prompts, out: Path, *, concurrency: list[int], max_tokens: int = 64,
        per_client: int = 2, min_requests: int = 4, warmup: int = 2, ready_timeout: float = 600.0,
        command: str = "", config: dict | None = None) -> dict:
    """Measure every row in turn, write ``report.md`` and ``results.json`` in ``out``, return the results document.
    ``prompts``: prompt strings, or a callable that gives them (called only if some row runs)."""
    out.mkdir(parents=True, exist_ok=True)
    if callable(prompts):
        prompts = prompts() if any(not r.note for r in rows) else []
    load = dict(max_tokens=max_tokens, per_client=per_client, min_requests=min_requests, warmup=warmup)
    results = []
    for row in rows:
        if row.note:
            _say(f"{row.name}: {row.note}")
        results.append(measure_row(row, list(prompts), concurrency, out, ready_timeout=ready_timeout, **load))
    doc = {"date": date.today().isoformat(), "command": command,
           "machine": {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "platform": platform.platform()},
           "config": {**(config or {}), "concurrency": concurrency, "prompts": len(prompts), **load},
           "rows": [asdict(r) for r in results], "verdict": verdict(results)}
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "report.md").write_text(report_md(doc, results))
    return doc


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m retrospec.bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for report.md, results.json and the servers' logs")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="client counts (default 1,4,16)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to run (default all: {','.join(ROWS)})")
    p.add_argument("--target", default="smollm2-135m", help="model name or checkpoint directory")
    p.add_argument("--dtype", default="float32", help="weight format (vLLM rows: float32 or bfloat16)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-client", type=int, default=2, help="requests per client at each level (default 2)")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests a level (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests after the server is ready (default 2)")
    p.add_argument("--k", type=int, default=5, help="vLLM proposers' num_speculative_tokens (default 5)")
    p.add_argument("--max-ngram", type=int, default=3, help="vLLM proposers' longest n-gram (default 3)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of each server")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len (default 2048)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /v1/models (default 600: vLLM compiles at first start)")
    args = p.parse_args(argv)
    if min(args.max_tokens, args.per_client, args.min_requests, args.k, args.max_ngram, args.threads) < 1:
        p.error("--max-tokens, --per-client, --min-requests, --k, --max-ngram and --threads must be >= 1")
    try:
        rows = build_rows([n.strip() for n in args.rows.split(",") if n.strip()], target=args.target,
                          dtype=args.dtype, threads=args.threads, k=args.k, max_ngram=args.max_ngram,
                          max_model_len=args.max_model_len)
    except RetrospecError as exc:
        print(f"serving: error: {exc}", file=sys.stderr)
        return 2
    n = max(requests_at(c, args.per_client, args.min_requests) for c in args.concurrency)

    def prompts() -> list[str]:  # a different prompt for each request of a level
        from ..tasks import preset

        return [row["prompt"] for row in preset("heldout", n)]

    command = "python -m retrospec.bench.serving " + shlex.join(sys.argv[1:] if argv is None else argv)
    config = {"target": args.target, "dtype": args.dtype, "preset": "heldout", "k": args.k,
              "max_ngram": args.max_ngram, "threads": args.threads}
    doc = run(rows, prompts, Path(args.out), concurrency=args.concurrency, command=command, config=config,
              max_tokens=args.max_tokens, per_client=args.per_client, min_requests=args.min_requests,
              warmup=args.warmup, ready_timeout=args.ready_timeout)
    print(report_md(doc, [RowResult(**r) for r in doc["rows"]]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
