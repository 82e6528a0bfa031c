"""Long-context bench reports: markdown tables, a console table, and speedup / accuracy against context length."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("length", "method", "tok/s", "speedup", "ideal", "tau", "accept", "no-draft", "verify/lc", "accuracy",
           "same as lc",
           "prefill s", "retrieval ms", "retrieved", "rule")


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _row(s: dict) -> list[str]:
    rule = s["rule"] if s["lossless"] else f"**LOSSY** {s['rule']}"
    return [str(s["length"]), s["method"], f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x",
            f"{s['ideal_speedup']:.2f}x" if s["ideal_speedup"] else "-", f"{s['mean_accepted_tokens']:.2f}",
            f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] else "-",
            f"{s['gated_share']:.0%}" if s.get("gating") else "-",
            f"{s['verify_ratio']:.2f}" if s["method"] != "lc" else "1.00",
            f"{s['accuracy']:.2f}", _f(s["same_as_lc"], ".2f"), _f(s["prefill_full_s"], ".2f"),
            _f(None if s["retrieval_s"] is None else 1000 * s["retrieval_s"], ".0f"),
            _f(s["retrieved_tokens"], ".0f"), rule]


def _table(rows: list[dict], with_task: bool = False) -> list[str]:
    cols = (("task",) if with_task else ()) + COLUMNS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(([s["task"]] if with_task else []) + _row(s)) + " |" for s in rows]


def render_markdown(result: dict) -> str:
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
        f"- torch {c['torch']}, {c['threads']} threads, {c['machine']}, {c['date']}",
    ]
    if lossy:
        lines += ["", f"**LOSSY methods in this report: {', '.join(lossy)}** (RAPID with eta > 0: the output "
                      "distribution is not the target's; see acceptance_rapid.py)."]
    lines += ["", "## All tasks", ""] + _table([s for s in summary if s["task"] == "all"])
    lines += ["", "## Per task", ""] + _table([s for s in summary if s["task"] != "all"], with_task=True)
    probes = result.get("verify_probes") or []
    if probes:
        lines += ["", "## Verification cost (gamma draft tokens vs one decode token, same cache, median)", "",
                  "| cache tokens | gamma | attention | decode ms | verify ms | ratio |", "|---|---|---|---|---|---|"]
        for p in probes:
            for key in ("sdpa", "prefix_block"):
                if key in p:
                    a = p[key]
                    lines.append(f"| {p['cache_tokens']} | {p['gamma']} | {a['attention']} | "
                                 f"{1000 * a['decode_s']:.1f} | {1000 * a['verify_s']:.1f} | {a['ratio']:.2f} |")
    lines += [
        "",
        "tok/s: decode phase (after the prompt forward), token-weighted over rows. speedup: tok/s over `lc` at the "
        "same length in this run. ideal: tau x t_lc / ((draft + verify seconds) per step), from forward times of "
        "this run. no-draft: share of steps the gate ran without a draft (- = not gated). verify/lc: seconds per "
        "verification forward over seconds per lc decode forward. accuracy: "
        "containment (kv, passkey, facts) or first-line exact match (repo). same as lc: share of outputs "
        "token-identical to lc. prefill s: the long prompt's forward, run once per row and shared. retrieval: "
        "chunk + embed + select, once per row.",
        "",
    ]
    return "\n".join(lines)


def print_table(summary: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="retrospec long-context bench")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "rule") else "right")
    for s in summary:
        if s["task"] == "all":
            table.add_row(*(_row(s)[:-1] + [s["rule"] if s["lossless"] else f"LOSSY {s['rule']}"]))
    Console().print(table)


def render_plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summary if s["task"] == "all"]
    methods = list(dict.fromkeys(s["method"] for s in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in methods:
        pts = sorted((s["length"], s["speedup"], s["accuracy"], s["lossless"]) for s in rows if s["method"] == m)
        xs = [p[0] for p in pts]
        label = m if all(p[3] for p in pts) else f"{m} (lossy)"
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=label)
        ax2.plot(xs, [p[2] for p in pts], marker="o", label=label)
    for ax, name in ((ax1, "speedup over lc (decode tok/s)"), (ax2, "accuracy")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(name)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.set_ylim(-0.05, 1.05)
    ax2.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out_dir / "results.json")
    (out_dir / "report.md").write_text(render_markdown(result))
    render_plot(result["summary"], out_dir / "long_context.png")
