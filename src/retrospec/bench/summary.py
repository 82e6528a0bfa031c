"""Every quantity the bench reports, defined once, and the summary rows built from them.

A group of runs (one label; with long-context rows, one label at one context length, and per task) is compared with
the baseline's runs of the same group (``ar`` for prompt rows, ``lc`` for rows with a context), token-weighted:

- tokens_per_s = new tokens / decode seconds (decode phase: after the prompt forward);
- speedup = tokens_per_s / the baseline's tokens_per_s, measured in the same run;
- mean_accepted_tokens (tau) = new tokens / target forward calls (verification forwards; the prefill is not one);
- acceptance_rate = accepted draft tokens / drafted tokens;
- gated_share = steps the gate ran without a draft / target forward calls (``gating``);
- overhead_free_speedup (prompt rows) = the baseline's decode seconds per token / the label's model-forward seconds
  per token (``forward_s``: verification forwards + drafting): the speedup with zero engine overhead, so
  speedup / overhead_free_speedup is the share of decode time spent in model forwards;
- forward_speedup (context rows) = tau x t_base / t_step: the baseline's seconds per decode forward (one token over
  the full cache) against the label's (draft + verify) seconds per step, per token: the speedup that per-step
  forward costs predict;
- verify_ratio (context rows) = seconds per verification forward / t_base (gamma + 1 tokens scored vs one);
- lossless (prompt rows, greedy) = every output token-identical to the baseline's; (context rows) the acceptance
  rule's flag (RAPID with eta > 0 is LOSSY); same_as_lc = share of rows token-identical to lc's;
- accuracy (context rows) = share of rows scored correct by ``tasks.score``;
- draft_state_bytes / target_kv_bytes = the most a drafter held in its own per-request state / the largest target
  KV cache at the end of a run (null for the hf-* rows, which do not report them).
"""

from __future__ import annotations

from ..drafters.registry import BASELINE, CONTEXT_BASELINE


def _sum(rs: list[dict], key: str) -> float:
    return sum(r["stats"][key] for r in rs)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _max_of(runs: list[dict], key: str) -> int | None:
    """The largest ``stats[key]`` over runs; None when no run measured it (hf-* rows)."""
    return max((v for r in runs if (v := r["stats"].get(key)) is not None), default=None)


def common(rs: list[dict], base: list[dict]) -> dict:
    """The quantities both kinds of rows report (see the module docstring)."""
    new, dec = _sum(rs, "new_tokens"), _sum(rs, "decode_s")
    calls, drafted, accepted = _sum(rs, "target_calls"), _sum(rs, "drafted_tokens"), _sum(rs, "accepted_tokens")
    b_new, b_dec = _sum(base, "new_tokens"), _sum(base, "decode_s")
    tps, b_tps = new / dec if dec else 0.0, b_new / b_dec if b_dec else 0.0
    return {"tokens_per_s": tps, "speedup": tps / b_tps if b_tps else 0.0,
            "mean_accepted_tokens": new / calls if calls else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "gating": any(r["stats"].get("gating") for r in rs),
            "gated_share": sum(r["stats"].get("gated_steps", 0) for r in rs) / calls if calls else 0.0,
            "new_tokens": new, "decode_s": dec}


def summarize_prompts(runs: list[dict], greedy: bool) -> list[dict]:
    """One row per label for prompt rows (baseline ``ar``)."""
    by_label: dict[str, list[dict]] = {}
    for r in runs:
        by_label.setdefault(r["method"], []).append(r)
    base = by_label[BASELINE]
    ar_by_prompt = {r["prompt_index"]: r for r in base}
    b_new, b_dec = _sum(base, "new_tokens"), _sum(base, "decode_s")
    out = []
    for m, rs in by_label.items():
        new, fwd = _sum(rs, "new_tokens"), _sum(rs, "forward_s")
        row = {"method": m} | common(rs, base)
        row["overhead_free_speedup"] = (b_dec / b_new) / (fwd / new) if new and fwd > 0 and b_new else 0.0
        row["lossless"] = (all(r["token_ids"] == ar_by_prompt[r["prompt_index"]]["token_ids"] for r in rs)
                           if greedy else None)
        row["draft_state_bytes"] = _max_of(rs, "draft_state_bytes")
        row["target_kv_bytes"] = _max_of(rs, "target_kv_bytes")
        out.append(row)
    return out


def summarize_rows(runs: list[dict]) -> list[dict]:
    """One row per (length, label) and per (length, task, label) for context rows (baseline ``lc``)."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["length"], "all", r["method"]), []).append(r)
        groups.setdefault((r["length"], r["task"], r["method"]), []).append(r)
    lc_by_row = {r["row"]: r for r in runs if r["method"] == CONTEXT_BASELINE}
    for (length, task, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        base = groups.get((length, task, CONTEXT_BASELINE), [])
        row = {"length": length, "task": task, "method": method, "rows": len(rs)} | common(rs, base)
        steps, drafted = _sum(rs, "target_calls"), _sum(rs, "drafted_tokens")
        b_steps = _sum(base, "target_calls")
        t_base = _sum(base, "verify_s") / b_steps if b_steps else 0.0
        t_step = (_sum(rs, "verify_s") + _sum(rs, "draft_s")) / steps if steps else 0.0
        t_verify = _sum(rs, "verify_s") / steps if steps else 0.0
        with_retrieval = [r for r in rs if r["stats"]["retrieved_tokens"]]
        row |= {
            "forward_speedup": row["mean_accepted_tokens"] * t_base / t_step if t_step else 0.0,
            "verify_ratio": t_verify / t_base if t_base else 0.0,
            "t_lc_decode_s": t_base, "t_verify_s": t_verify,
            "t_draft_per_token_s": _sum(rs, "draft_s") / drafted if drafted else 0.0,
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "same_as_lc": sum(r["token_ids"] == lc_by_row[r["row"]]["token_ids"] for r in rs) / len(rs)
            if all(r["row"] in lc_by_row for r in rs) else None,
            "prefill_s": sum(r["stats"]["prefill_s"] for r in rs) / len(rs),
            "prefill_full_s": _mean([r["prefill_full_s"] for r in rs]),
            "retrieval_s": _mean([r["stats"]["retrieval_s"] for r in with_retrieval]),
            "retrieved_tokens": _mean([r["stats"]["retrieved_tokens"] for r in with_retrieval]),
            "context_tokens": _mean([r["context_tokens"] for r in rs]),
            "rule": rs[0]["stats"]["rule"], "lossless": all(r["stats"]["lossless"] for r in rs),
        }
        out.append(row)
    return out
