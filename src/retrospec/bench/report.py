"""Bench reports, one module for both kinds of rows: a markdown report, a console table (rich) and a chart
(matplotlib). Prompt rows: one row per label, a speedup bar chart (``speedup.png``). Context rows: per context
length and per task, speedup and accuracy against context length (``long_context.png``). The quantities are
defined in ``bench.summary``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..atomic import write_text_atomic
from ..drafters.registry import CONTEXT_BASELINE

COLUMNS = ("method", "tokens/s", "speedup", "no-overhead", "tau", "acceptance", "no-draft", "draft state", "target KV",
           "lossless")
MEMORY_COLUMNS = ("draft state", "target KV")  # left out of the console table below WIDE columns (report.md has them)
WIDE = 110


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``1.5 KiB``; None (not measured) -> ``—``."""
    if n is None:
        return "—"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def _row(s: dict) -> list[str]:
    lossless = {True: "yes", False: "NO", None: "n/a"}[s["lossless"]]
    return [s["method"], f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x", f"{s['overhead_free_speedup']:.2f}x",
            f"{s['mean_accepted_tokens']:.2f}", f"{s['acceptance_rate']:.2f}",
            f"{s['gated_share']:.0%}" if s.get("gating") else "—", format_bytes(s.get("draft_state_bytes")),
            format_bytes(s.get("target_kv_bytes")), lossless]


def _span(rows: list[dict] | None) -> str:
    """``min-max (mean m)`` of the rows' ``prompt_tokens``; empty when the rows do not carry it."""
    counts = [r["prompt_tokens"] for r in rows or () if "prompt_tokens" in r]
    if not counts:
        return ""
    return f"{min(counts)}-{max(counts)} (mean {sum(counts) / len(counts):.0f})"


def _md_table(cols, rows) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]


def _machine_line(c: dict) -> str:
    where = f", {c['device']}, {c['dtype']}" if c.get("device") else ""  # results from before 2026-11-27: no device
    return f"- torch {c['torch']}, {c['threads']} threads, {c['machine']}{where}, {c['date']}"


def render_markdown(result: dict) -> str:
    if "verify_probes" in result:
        return _context_markdown(result)
    c = result["config"]
    lines = [
        "# retrospec bench",
        "",
        f"- target: `{c['target']}`; draft: `{c['draft']}`",
        f"- {c['prompts']} prompts, {c['max_new_tokens']} new tokens max, temperature {c['temperature']}, "
        f"gamma {c['gamma']}, pld k {c['pld_k']} (max n-gram {c['pld_max_ngram']})"
        + (", chat template (each prompt one user message)" if c.get("chat") else ""),
        *([f"- prompt tokens: {_span(c['prompt_rows'])}"] if _span(c.get("prompt_rows")) else []),
        *([f"- longspec block: `{c['longspec_draft']}`"] if c.get("longspec_draft") else []),
        *([f"- target attention: `{c['attention']}` (the loaded model, left as it was)"] if c.get("attention")
          else []),
        *([f"- our engine (`fastpath`): {_engine_line(c['engine'])}"] if c.get("engine") else []),
        *[f"- {m}: {p['peer']} {p['version']}, `{p['file']}`" for m, p in (c.get("peers") or {}).items()],
        *[f"- note: {n}" for n in c.get("notes") or []],
        _machine_line(c),
        "",
        *_md_table(COLUMNS, map(_row, result["summary"])),
        "",
        "tokens/s: decode phase (after the prompt forward), token-weighted over prompts. speedup: tokens/s over "
        "`ar` in this run. no-overhead: speedup with zero engine overhead (model-forward time only). tau: new tokens "
        "per target forward. acceptance: accepted / drafted tokens. no-draft: share of steps the gate ran without "
        "a draft (— = not gated: ar, hf-* and m@gating=0 rows, or --no-gating). draft state: the most the drafter "
        "held in its own per-request state at the end of a run (longspec: its ring buffer; magicdec: its sink + "
        "window KV cache; sd: the draft's KV cache; pld: its token buffer; — = not measured, hf-* rows). target KV: "
        "the largest target KV cache at the end of a run. lossless: every output token-identical to `ar` "
        "(greedy runs only). hf-* rows run transformers' own generate(); their decode time is wall time minus "
        "a prompt forward of the same prompt. llamacpp-* rows run llama.cpp (llama-cpp-python) on the same token "
        "ids, decode timed from its first new token; vllm-* rows run vLLM's offline engine on the same ids, decode "
        "time = a whole request's minus a one-token request's; a peer's lossless column says whether its tokens "
        "equal `ar`'s.",
        "",
    ]
    return "\n".join(lines)


def _print_table(title: str, columns, left, rows, caption: str | None = None, **column_kw) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", **column_kw.get(col, {}))
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def print_table(summary: list[dict]) -> None:
    if summary and "length" in summary[0]:
        return _context_table(summary)
    from rich.console import Console

    keep = [i for i, col in enumerate(COLUMNS) if Console().width >= WIDE or col not in MEMORY_COLUMNS]
    caption = "memory columns (draft state, target KV): report.md and results.json"
    rows = ([_row(s)[i] for i in keep] for s in summary)
    _print_table("retrospec bench", [COLUMNS[i] for i in keep], ("method",), rows,
                 None if len(keep) == len(COLUMNS) else caption, method={"no_wrap": True})


@contextlib.contextmanager
def _figure(path, *args, dpi: int = 120, **kwargs):
    """A matplotlib figure (Agg backend) saved to ``path`` and closed when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(*args, **kwargs)
    yield ax
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def render_plot(summary: list[dict], path: Path) -> None:
    names = [s["method"] for s in summary]
    x = range(len(names))
    with _figure(path, figsize=(max(5, 1.1 * len(names)), 3.6)) as ax:
        ax.bar([i - 0.2 for i in x], [s["speedup"] for s in summary], width=0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [s["overhead_free_speedup"] for s in summary], width=0.4,
               label="no-overhead bound", alpha=0.6)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("speedup over ar")
        ax.legend(frameon=False)


def _engine_line(e: dict) -> str:
    """One line on what our methods ran: the engine's mode, attention, prepacked row counts and head layouts."""
    if e.get("mode") == "off":
        return "off (the target as it is)"
    return (f"{e.get('mode')}, attention `{e.get('attention')}`, oneDNN-prepacked linears for "
            f"{e.get('packed_rows') or 'no'} rows, head layouts {e.get('head')} (plan: {e.get('plan')})"
            + (", each verified row's attention alone (row-exact)" if e.get("row_exact") else "")
            + (f", decoder layers {_loop(e)}" if e.get("loop") else ""))


def _loop(e: dict) -> str:
    """How the decoder layers ran: compiled ahead of time (with the measured ms of all layers' work around attention
    for one row), the lean loop (and why not compiled), or transformers' modules."""
    c = e.get("compiled") or {}
    if e.get("loop") == "compiled":
        return f"compiled ahead of time ({c.get('compiled_ms')} ms vs {c.get('eager_ms')} ms in the plain loop)"
    return f"in a plain loop (not compiled: {c['why']})" if c.get("why") else f"as {e.get('loop')}"


# --- context rows -----------------------------------------------------------------------------------------------

CONTEXT_COLUMNS = ("length", "method", "tok/s", "speedup", "forward", "tau", "accept", "no-draft", "verify/lc",
                   "accuracy", "same as lc", "prefill s", "retrieval ms", "retrieved", "rule")


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _context_row(s: dict, lossy: str = "**LOSSY** ") -> list[str]:
    return [str(s["length"]), s["method"], f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x",
            f"{s['forward_speedup']:.2f}x" if s["forward_speedup"] else "-", f"{s['mean_accepted_tokens']:.2f}",
            f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] else "-",
            f"{s['gated_share']:.0%}" if s.get("gating") else "-",
            f"{s['verify_ratio']:.2f}" if s["method"] != CONTEXT_BASELINE else "1.00",
            f"{s['accuracy']:.2f}", _f(s["same_as_lc"], ".2f"), _f(s["prefill_full_s"], ".2f"),
            _f(None if s["retrieval_s"] is None else 1000 * s["retrieval_s"], ".0f"),
            _f(s["retrieved_tokens"], ".0f"), ("" if s["lossless"] else lossy) + s["rule"]]


def _table(rows: list[dict], with_task: bool = False) -> list[str]:
    cols = (("task",) if with_task else ()) + CONTEXT_COLUMNS
    return _md_table(cols, (([s["task"]] if with_task else []) + _context_row(s) for s in rows))


def _context_markdown(result: dict) -> str:
    c = result["config"]
    summary = result["summary"]
    lossy = sorted({s["method"] for s in summary if not s["lossless"]})
    lines = [
        "# retrospec long-context bench (RAPID and baselines)",
        "",
        f"- target: `{c['target']}`; drafter for sd / rapid: `{c['draft']}`",
        f"- {c['rows']} rows, tasks {', '.join(c['tasks'])}, lengths {', '.join(map(str, c['lengths']))}; "
        f"{c['max_new_tokens']} new tokens max, temperature {c['temperature']}, gamma {c['gamma']}",
        f"- retrieval: {c['embedder']}, chunks of {c['chunk_tokens']} tokens scored by their best "
        f"{c.get('piece_tokens')}-token piece, floor {c['similarity_floor']}, budget "
        + (f"{c['retrieval_tokens']} tokens" if c["retrieval_tokens"] else
           f"max({c['min_retrieval_tokens']}, {c['max_retrieval_fraction']:.4g} x context)")
        + f"; magicdec sink {c['sink']}, window {c['window'] or 'default (same budget as retrieval)'}; eta {c['eta']}",
        f"- target attention: `{c.get('attention', 'sdpa')}`",
        _machine_line(c),
    ]
    if lossy:
        lines += ["", f"**LOSSY methods in this report: {', '.join(lossy)}** (RAPID with eta > 0: the output "
                      "distribution is not the target's; see acceptance_rapid.py)."]
    lines += ["", "## All tasks", ""] + _table([s for s in summary if s["task"] == "all"])
    lines += ["", "## Per task", ""] + _table([s for s in summary if s["task"] != "all"], with_task=True)
    probes = result.get("verify_probes") or []
    if probes:
        cols = ("cache tokens", "gamma", "attention", "decode ms", "verify ms", "ratio")
        lines += ["", "## Verification cost (gamma draft tokens vs one decode token, same cache, median)", ""]
        lines += _md_table(cols, ([str(p["cache_tokens"]), str(p["gamma"]), a["attention"],
                                   f"{1000 * a['decode_s']:.1f}", f"{1000 * a['verify_s']:.1f}", f"{a['ratio']:.2f}"]
                                  for p in probes for a in (p[k] for k in ("sdpa", "prefix_block") if k in p)))
    lines += [
        "",
        "tok/s: decode phase (after the prompt forward), token-weighted over rows. speedup: tok/s over `lc` at the "
        "same length in this run. forward: tau x t_lc / ((draft + verify seconds) per step), from forward times of "
        "this run. no-draft: share of steps the gate ran without a draft (- = not gated). verify/lc: seconds per "
        "verification forward over seconds per lc decode forward. accuracy: "
        "containment (kv, passkey, facts) or first-line exact match (repo). same as lc: share of outputs "
        "token-identical to lc. prefill s: the long prompt's forward, run once per row and shared. retrieval: "
        "chunk + embed + select, once per row.",
        "",
    ]
    return "\n".join(lines)


def _context_table(summary: list[dict]) -> None:
    _print_table("retrospec long-context bench", CONTEXT_COLUMNS, ("method", "rule"),
                 (_context_row(s, "LOSSY ") for s in summary if s["task"] == "all"))


def _context_plot(summary: list[dict], path: Path) -> None:
    rows = [s for s in summary if s["task"] == "all"]
    with _figure(path, 1, 2, figsize=(10, 3.8)) as (ax1, ax2):
        for m in dict.fromkeys(s["method"] for s in rows):
            pts = sorted((s["length"], s["speedup"], s["accuracy"], s["lossless"]) for s in rows if s["method"] == m)
            label = m if all(p[3] for p in pts) else f"{m} (lossy)"
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        for ax, name in ((ax1, "speedup over lc (decode tok/s)"), (ax2, "accuracy")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(name)
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax2.set_ylim(-0.05, 1.05)
        ax2.legend(frameon=False, fontsize=8)


def write_outputs(result: dict, out_dir: Path) -> None:
    """results.json, report.md and the chart (speedup.png; long_context.png for context rows), atomically per file."""
    context = "verify_probes" in result
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = result if context else {k: result[k] for k in ("config", "runs", "summary")}
    write_text_atomic(out_dir / "results.json", json.dumps(kept, indent=1) + "\n")
    write_text_atomic(out_dir / "report.md", render_markdown(result))
    (_context_plot if context else render_plot)(result["summary"], out_dir / ("long_context.png" if context
                                                                              else "speedup.png"))
