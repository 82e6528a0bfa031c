"""``retrospec gpu report DIR|FILE...``: the steps' JSON files as ``docs/gpu.md``-ready markdown.

Every section says where its figures come from (device, torch, transformers) and a dry run's sections are headed
"DRY RUN (CPU, tiny models): not GPU figures", so a rehearsal can never be pasted as a measurement. Projections
(cost model x tau) are labelled as projections: speedup = tau * t(1 token) / t(k tokens) at the same context, with k
the method's tokens per target forward (rounded up to a measured size) and the drafting cost left out (retrieval
drafters: ~0; a draft model adds its own forwards).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RetrospecError
from . import STEPS


def load(paths: list[str]) -> dict[str, dict]:
    """{step: result} from files and directories (``<step>.json`` inside); a later path wins."""
    found: dict[str, dict] = {}
    for p in map(Path, paths):
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        if not p.exists():
            raise RetrospecError(f"{p} does not exist")
        for f in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("step") in STEPS:
                found[data["step"]] = data
    if not found:
        raise RetrospecError(f"no step results (<step>.json) in {', '.join(paths)}")
    return found


def _f(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 10 ** -digits or v == 0 else f"{v:.1e}"
    return str(v)


def table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(_f(c) for c in r) + " |" for r in rows]


def header(r: dict, title: str) -> list[str]:
    env = r["env"]
    where = env.get("gpu") or f"CPU ({env.get('cpu_threads')} threads)"
    lines = [f"### {title}", ""]
    if r["dry_run"]:
        lines += ["**DRY RUN (CPU, tiny models): not GPU figures.**", ""]
    lines += [f"{where}; torch {env['torch']}, transformers {env['transformers']}; {r['seconds']:.0f} s.", ""]
    return lines


def footer(r: dict) -> list[str]:
    out = [""]
    if r["errors"]:
        out += ["Failed parts: " + "; ".join(f"`{k}`: {v}" for k, v in r["errors"].items()), ""]
    if r["notes"]:
        out += ["Notes: " + "; ".join(r["notes"]), ""]
    return out


def model_section(r: dict) -> list[str]:
    rows = [[d, x["prompt"], x["tokens"], x["max_abs_diff"], x["rel_l2"], x["argmax_agreement"]]
            for d in ("float32", "bfloat16") if d in r["figures"] for x in r["figures"][d]["rows"]]
    return (header(r, "Real model across: logits against the CPU's") + table(
        ["dtype", "prompt", "tokens", "max abs diff (last pos.)", "rel. L2", "argmax agreement"], rows)
        + [f"\nlogits match (fp32): {_f(r['figures'].get('logits_match'))}"] + footer(r))


def tests_section(r: dict) -> list[str]:
    ident = r["figures"].get("identity_fp32") or {}
    py = r["figures"].get("pytest") or {}
    lines = header(r, "Tests on the device: greedy identity with the oracle (fp32, zoo pair)")
    lines += table(["method", "identical to the oracle"], [[m, ok] for m, ok in ident.items()])
    lines += ["", f"pytest -k 'cuda or triton': exit {py.get('returncode')}, {py.get('summary')}"]
    if r["figures"].get("skipped"):
        lines += ["", "skipped: " + "; ".join(f"{k}: {v}" for k, v in r["figures"]["skipped"].items())]
    return lines + footer(r)


def bench_section(r: dict) -> list[str]:
    f = r["figures"]
    lines = header(r, f"CUDA bench: target {f.get('target')}, draft {f.get('draft')}, greedy, "
                      f"{f.get('max_new_tokens')} new tokens")
    for cell, got in f.get("cells", {}).items():
        lines += [f"**{cell}** ({got['prompts']} prompts)", ""]
        lines += table(["method", "tokens/s", "speedup", "τ", "acceptance", "tokens/forward", "lossless"],
                       [[s["method"], s["tokens_per_s"], s["speedup"], s["mean_accepted_tokens"],
                         s["acceptance_rate"], s["tokens_per_forward"], s["lossless"]] for s in got["summary"]])
        lines.append("")
    if f.get("skipped"):
        lines += ["skipped: " + "; ".join(f"{k}: {v}" for k, v in f["skipped"].items()), ""]
    prof = f.get("profile")
    if prof:
        from ..bench.profile import render_table

        try:
            lines += ["Verification profile on the device (`retrospec profile`):", "", "```", render_table(prof),
                      "```"]
        except Exception:  # a profile dict from another version: keep the JSON figures, skip the table
            lines += ["(profile recorded in bench.json)"]
    return lines + footer(r)


def kernels_section(r: dict) -> list[str]:
    f = r["figures"]
    lines = header(r, f"Kernels: tree verification attention (tree {f.get('tree')}, q = {f.get('q')}, "
                      f"{f.get('dtype')}), ms per call")
    rows = [[x["shape"], x["length"], x["decode_ms"], x["masked_ms"], x["hybrid_ms"], x.get("triton_ms"),
             x["masked_over_hybrid"], x.get("masked_over_triton"), max(x["max_diff"], x.get("triton_max_diff", 0))]
            for x in f.get("rows", [])]
    return lines + table(["shape", "L", "decode", "masked SDPA", "hybrid (PyTorch)", "hybrid (Triton)",
                          "masked / hybrid", "masked / Triton", "max diff"], rows) + footer(r)


def _ceil_key(ms: dict, k: float) -> str | None:
    sizes = sorted(int(t) for t in ms)
    for t in sizes:
        if t >= k - 1e-9:
            return str(t)
    return None


def costmodel_section(r: dict, bench: dict | None) -> list[str]:
    f = r["figures"]
    lines = header(r, f"Real-size cost model: random weights, {f.get('dtype')}, ms per forward")
    for name, m in f.get("models", {}).items():
        tokens = f["tokens"]
        lines += [f"**{name}** ({m['params_b']:.2f} B parameters)", ""]
        lines += table(["context"] + [f"T={t}" for t in tokens],
                       [[ctx] + [row.get(str(t)) for t in tokens] for ctx, row in m["ms"].items()]) + [""]
    if bench:
        lines += projections(f, bench)
    return lines + footer(r)


def projections(cost: dict, bench: dict) -> list[str]:
    cells = bench["figures"].get("cells", {})
    pick = next((c for c in ("code/bfloat16", "chat/bfloat16", "code/float32", "chat/float32") if c in cells), None)
    if pick is None:
        return []
    lines = [f"**PROJECTION** (not a measurement): speedup = τ × t(1) / t(k) with τ and k from the real model's "
             f"`{pick}` bench cell{' (DRY RUN)' if bench['dry_run'] else ''}; drafting cost not included.", ""]
    rows = []
    for name, m in cost.get("models", {}).items():
        for ctx, ms in m["ms"].items():
            for s in cells[pick]["summary"]:
                if s["method"].startswith("hf-") or s["method"] == "ar":
                    continue
                key = _ceil_key(ms, s["tokens_per_forward"])
                if key is None:
                    continue
                rows.append([name, ctx, s["method"], s["mean_accepted_tokens"], s["tokens_per_forward"],
                             s["mean_accepted_tokens"] * ms["1"] / ms[key]])
    return lines + table(["model", "context", "method", "τ", "tokens/forward", "projected speedup"], rows) + [""]


def train_section(r: dict) -> list[str]:
    f = r["figures"]
    c, ls = f.get("corpus") or {}, f.get("longspec") or {}
    lines = header(r, "Training at scale: corpus of the target's outputs, LongSpec retrained")
    lines += table(["corpus output tokens", "tokens/s", "shards", "dtype", "LongSpec steps", "tokens seen",
                    "loss first → last"],
                   [[c.get("output_tokens"), c.get("tokens_per_s"), c.get("shards"), c.get("dtype"), ls.get("steps"),
                     ls.get("tokens_seen"), f"{_f(ls.get('loss_first'))} → {_f(ls.get('loss_last'))}"]])
    if f.get("eval"):
        lines += ["", "LongSpec block, method longspec (greedy):", ""]
        lines += table(["block", "τ", "acceptance", "speedup", "lossless"],
                       [[k, v["mean_accepted_tokens"], v["acceptance_rate"], v["speedup"], v["lossless"]]
                        for k, v in f["eval"].items()])
    if f.get("returned"):
        lines += ["", "returned (int8): " + ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in f["returned"].items())]
    return lines + footer(r)


def render(results: dict[str, dict]) -> str:
    out = ["## GPU results", ""]
    sections = {"model": model_section, "tests": tests_section, "bench": bench_section, "kernels": kernels_section,
                "train": train_section}
    for step in ("model", "tests", "bench", "kernels", "costmodel", "train"):
        if step not in results:
            continue
        r = results[step]
        out += costmodel_section(r, results.get("bench")) if step == "costmodel" else sections[step](r)
    if "stage" in results and "model" not in results:
        s = results["stage"]["figures"]
        out += [f"GGUF parts staged: {s.get('present')}; missing: {s.get('missing')}", ""]
    return "\n".join(out).rstrip() + "\n"
