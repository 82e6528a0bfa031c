"""Bench reports: a markdown table, a console table (rich) and a speedup bar chart (matplotlib)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = ("method", "tokens/s", "speedup", "ideal", "tau", "acceptance", "no-draft", "draft state", "target KV",
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
    raise AssertionError("unreachable")


def _row(s: dict) -> list[str]:
    lossless = {True: "yes", False: "NO", None: "n/a"}[s["lossless"]]
    return [s["method"], f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x", f"{s['ideal_speedup']:.2f}x",
            f"{s['mean_accepted_tokens']:.2f}", f"{s['acceptance_rate']:.2f}",
            f"{s['gated_share']:.0%}" if s.get("gating") else "—", format_bytes(s.get("draft_state_bytes")),
            format_bytes(s.get("target_kv_bytes")), lossless]


def _span(rows: list[dict] | None) -> str:
    """``min-max (mean m)`` of the rows' ``prompt_tokens``; empty when the rows do not carry it."""
    counts = [r["prompt_tokens"] for r in rows or () if "prompt_tokens" in r]
    if not counts:
        return ""
    return f"{min(counts)}-{max(counts)} (mean {sum(counts) / len(counts):.0f})"


def render_markdown(result: dict) -> str:
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
        *([f"- target attention: `{c['attention']}` (the loaded model, left as it was)"] if c.get("attention") else []),
        *([f"- our engine (`fastpath`): {_engine_line(c['engine'])}"] if c.get("engine") else []),
        f"- torch {c['torch']}, {c['threads']} threads, {c['machine']}, {c['date']}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in result["summary"]]
    lines += [
        "",
        "tokens/s: decode phase (after the prompt forward), token-weighted over prompts. speedup: tokens/s over "
        "`ar` in this run. ideal: speedup with zero engine overhead (model-forward time only). tau: new tokens per "
        "target forward. acceptance: accepted / drafted tokens. no-draft: share of steps the gate ran without "
        "a draft (— = not gated: ar, hf-* and m@gating=0 rows, or --no-gating). draft state: the most the drafter "
        "held in its own per-request state at the end of a run (longspec: its ring buffer; magicdec: its sink + "
        "window KV cache; sd: the draft's KV cache; pld: its token buffer; — = not measured, hf-* rows). target KV: "
        "the largest target KV cache at the end of a run. lossless: every output token-identical to `ar` "
        "(greedy runs only). hf-* rows run transformers' own generate(); their decode time is wall time minus "
        "a prompt forward of the same prompt.",
        "",
    ]
    return "\n".join(lines)


def print_table(summary: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    keep = [i for i, col in enumerate(COLUMNS) if console.width >= WIDE or col not in MEMORY_COLUMNS]
    table = Table(title="retrospec bench", caption=None if len(keep) == len(COLUMNS) else
                  "memory columns (draft state, target KV): report.md and results.json")
    for i in keep:
        col = COLUMNS[i]
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for s in summary:
        row = _row(s)
        table.add_row(*(row[i] for i in keep))
    console.print(table)


def render_plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["method"] for s in summary]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.6))
    ax.bar([i - 0.2 for i in x], [s["speedup"] for s in summary], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [s["ideal_speedup"] for s in summary], width=0.4, label="ideal (no overhead)",
           alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("speedup over ar")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _engine_line(e: dict) -> str:
    """One line on what our methods ran: the engine's mode, attention, prepacked row counts and head layouts."""
    if e.get("mode") == "off":
        return "off (the target as it is)"
    return (f"{e.get('mode')}, attention `{e.get('attention')}`, oneDNN-prepacked linears for "
            f"{e.get('packed_rows') or 'no'} rows, head layouts {e.get('head')} (plan: {e.get('plan')})")
