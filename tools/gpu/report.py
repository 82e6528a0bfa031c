"""``python -m tools.gpu report DIR|FILE...``: the steps' JSON files as ``tools/gpu/README.md``-ready markdown.

Every section says where its figures come from (device, torch, transformers) and a dry run's sections are headed
"DRY RUN (CPU, tiny models): not GPU figures", so a rehearsal can never be pasted as a measurement. Projections
(cost model x tau) are labelled as projections: speedup = tau * t(1 token) / t(k tokens) at the same context, with k
the method's tokens per target forward (rounded up to a measured size) and the drafting cost left out (retrieval
drafters: ~0; a draft model adds its own forwards).
"""

from __future__ import annotations

import json
from pathlib import Path

from retrospec.errors import RetrospecError
from . import STEPS


def load(paths: list[str]) -> dict[str, dict]:
    """{step: result} from files and directories (``<step>.json`` inside); a later path wins."""
    found: dict[str, dict] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise RetrospecError(f"{p} does not exist")
        for f in sorted(p.rglob("*.json")) if p.is_dir() else [p]:
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
    return ([f"### {title}", ""] + ["**DRY RUN (CPU, tiny models): not GPU figures.**", ""] * r["dry_run"]
            + [f"{where}; torch {env['torch']}, transformers {env['transformers']}; {r['seconds']:.0f} s.", ""])


def footer(r: dict) -> list[str]:
    return ([""] + ["Failed parts: " + "; ".join(f"`{k}`: {v}" for k, v in r["errors"].items()), ""] * bool(r["errors"])
            + ["Notes: " + "; ".join(r["notes"]), ""] * bool(r["notes"]))


def model_section(r: dict) -> tuple[str, list[str]]:
    rows = [[d, x["prompt"], x["tokens"], x["max_abs_diff"], x["rel_l2"], x["argmax_agreement"]]
            for d in ("float32", "bfloat16") if d in r["figures"] for x in r["figures"][d]["rows"]]
    return "Real model across: logits against the CPU's", table(
        ["dtype", "prompt", "tokens", "max abs diff (last pos.)", "rel. L2", "argmax agreement"], rows) + [
        f"\nlogits match (fp32): {_f(r['figures'].get('logits_match'))}"]


def tests_section(r: dict) -> tuple[str, list[str]]:
    f, py = r["figures"], r["figures"].get("pytest") or {}
    lines = table(["method", "identical to the oracle"], list(map(list, (f.get("identity_fp32") or {}).items())))
    lines += ["", f"pytest -k 'cuda or triton': exit {py.get('returncode')}, {py.get('summary')}"]
    if f.get("skipped"):
        lines += ["", "skipped: " + "; ".join(f"{k}: {v}" for k, v in f["skipped"].items())]
    return "Tests on the device: greedy identity with the oracle (fp32, zoo pair)", lines


def bench_section(r: dict) -> tuple[str, list[str]]:
    f, lines = r["figures"], []
    for cell, got in f.get("cells", {}).items():
        low = cell.endswith("bfloat16")  # bf16 rounding differs by shape: divergence from ar is expected
        lines += [f"**{cell}** ({got['prompts']} prompts)" + (" (identical to ar: informational in bfloat16)"
                                                              if low else ""), ""]
        if got.get("engine"):  # the target's verification path: mode, attention, hybrid_min_length on CUDA
            lines += ["engine: " + ", ".join(f"{k} {v}" for k, v in got["engine"].items()), ""]
        lines += table(["method", "tokens/s", "speedup", "τ", "acceptance", "tokens/forward",
                        "same as ar" if low else "lossless"],
                       [[s[k] for k in ("method", "tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate",
                                        "tokens_per_forward", "lossless")] for s in got["summary"]]) + [""]
    if f.get("skipped"):
        lines += ["skipped: " + "; ".join(f"{k}: {v}" for k, v in f["skipped"].items()), ""]
    if f.get("profile"):
        from retrospec.bench.profile import render_table

        try:
            lines += ["Verification profile on the device (`retrospec profile`):", "", "```",
                      render_table(f["profile"]), "```"]
        except Exception:  # a profile dict from another version: keep the JSON figures, skip the table
            lines += ["(profile recorded in bench.json)"]
    return (f"CUDA bench: target {f.get('target')}, draft {f.get('draft')}, greedy, {f.get('max_new_tokens')} new "
            "tokens"), lines


def kernels_section(r: dict) -> tuple[str, list[str]]:
    f = r["figures"]
    rows = [[x["shape"], x["length"], x["decode_ms"], x["masked_ms"], x["hybrid_ms"], x.get("triton_ms"),
             x["masked_over_hybrid"], x.get("masked_over_triton"), max(x["max_diff"], x.get("triton_max_diff", 0))]
            for x in f.get("rows", [])]
    return (f"Kernels: tree verification attention (tree {f.get('tree')}, q = {f.get('q')}, {f.get('dtype')}), ms "
            "per call"), table(["shape", "L", "decode", "masked SDPA", "hybrid (PyTorch)", "hybrid (Triton)",
                                "masked / hybrid", "masked / Triton", "max diff"], rows)


def costmodel_section(r: dict, bench: dict | None) -> tuple[str, list[str]]:
    f, lines = r["figures"], []
    for name, m in f.get("models", {}).items():
        lines += [f"**{name}** ({m['params_b']:.2f} B parameters)", ""]
        lines += table(["context"] + [f"T={t}" for t in f["tokens"]],
                       [[ctx] + [row.get(str(t)) for t in f["tokens"]] for ctx, row in m["ms"].items()]) + [""]
    return f"Real-size cost model: random weights, {f.get('dtype')}, ms per forward", lines + (
        projections(f, bench) if bench else [])


def projections(cost: dict, bench: dict) -> list[str]:
    cells = bench["figures"].get("cells", {})
    pick = next((c for c in ("code/bfloat16", "chat/bfloat16", "code/float32", "chat/float32") if c in cells), None)
    if pick is None:
        return []
    rows = []
    for name, m in cost.get("models", {}).items():
        for ctx, ms in m["ms"].items():
            for s in cells[pick]["summary"]:
                # k rounded up to a measured token count
                key = next((str(t) for t in sorted(map(int, ms)) if t >= s["tokens_per_forward"] - 1e-9), None)
                if key is not None and s["method"] != "ar" and not s["method"].startswith("hf-"):
                    rows.append([name, ctx, s["method"], s["mean_accepted_tokens"], s["tokens_per_forward"],
                                 s["mean_accepted_tokens"] * ms["1"] / ms[key]])
    return [f"**PROJECTION** (not a measurement): speedup = τ × t(1) / t(k) with τ and k from the real model's "
            f"`{pick}` bench cell{' (DRY RUN)' if bench['dry_run'] else ''}; drafting cost not included.", ""] + table(
        ["model", "context", "method", "τ", "tokens/forward", "projected speedup"], rows) + [""]


def train_section(r: dict) -> tuple[str, list[str]]:
    f = r["figures"]
    c, variants = f.get("corpus") or {}, f.get("longspec") or {}
    lines = table(["corpus output tokens", "tokens/s", "shards", "dtype"],
                  [[c.get("output_tokens"), c.get("tokens_per_s"), c.get("shards"), c.get("dtype")]])
    if variants:
        lines += ["", "LongSpec variants trained at equal tokens (held-out agreement at the end):", ""]
        lines += table(["variant", "features", "ttt", "steps", "tokens seen", "tokens/s", "agreement"],
                       [[k, ",".join(map(str, v.get("features") or [])) or "—", v.get("ttt"), v.get("steps"),
                         v.get("tokens_seen"), _f(v.get("tokens_per_s")), _f((v.get("curve") or [{}])[-1].get("all"))]
                        for k, v in variants.items()])
    if f.get("eval"):
        lines += ["", "LongSpec block, method longspec (greedy):", ""]
        lines += table(["block", "τ", "acceptance", "speedup", "lossless"],
                       [[k] + [v[x] for x in ("mean_accepted_tokens", "acceptance_rate", "speedup", "lossless")]
                        for k, v in f["eval"].items()])
    if f.get("returned"):
        lines += ["", f"returned (int8, {f.get('returned_variant')}): "
                  + ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in f["returned"].items())]
    return "Training at scale: corpus of the target's outputs, LongSpec variants retrained", lines


def render(results: dict[str, dict]) -> str:
    sections = {"model": model_section, "tests": tests_section, "bench": bench_section, "kernels": kernels_section,
                "costmodel": lambda r: costmodel_section(r, results.get("bench")), "train": train_section}
    out = ["## GPU results", ""]
    for step, section in sections.items():
        if step in results:
            title, lines = section(results[step])
            out += header(results[step], title) + lines + footer(results[step])
    if "stage" in results and "model" not in results:
        s = results["stage"]["figures"]
        out += [f"GGUF parts staged: {s.get('present')}; missing: {s.get('missing')}", ""]
    return "\n".join(out).rstrip() + "\n"
