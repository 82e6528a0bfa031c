"""``retrospec bench``: every method on every prompt, side by side, in one process and one run.

Methods run interleaved per prompt (prompt 0: ar, sd, pld, hf-...; prompt 1: ...) after one untimed warm-up each,
so slow drift of the machine affects all methods alike.

Summary per method (token-weighted over prompts):
- tokens_per_s = sum(new tokens) / sum(decode seconds) (decode phase: after the prompt forward);
- speedup = tokens_per_s / ar's tokens_per_s from the same run;
- ideal_speedup = ar's seconds per token / (seconds inside target + draft forwards per token): the speedup with
  zero engine overhead, so speedup / ideal_speedup is the share of decode time spent in model forwards (our
  verifier's forwards are timed as ``verify_s``; when the engine runs its private fast copies (``fastpath``),
  drafting time counts whole as draft forwards);
- mean_accepted_tokens (tau) = new tokens / target forward calls; acceptance_rate = accepted / drafted;
- lossless = every output token-identical to ar's (greedy only; null when sampling);
- gated_share = steps the gate ran without a draft / target forwards (``gating``; labels ``m@gating=0|1``);
- draft_state_bytes = the most the drafter held in its own per-request state at the end of a run, over prompts
  (``Drafter.state_bytes``: longspec's ring buffer, magicdec's window cache, sd's draft KV cache; 0 for drafters
  that hold none, null for the hf-* rows); target_kv_bytes = the largest target KV cache at the end of a run.

Method labels (``parse_label``): ``m`` or ``m@opt@opt...`` with options ``gating=0|1``, ``gamma=N`` (a chain of N:
sd, pld, magicdec, and longspec, which drafts a tree by default) and ``tree=4x16x16`` (longspec's widths per
depth; ``x``-separated so commas still separate methods). ``longspec`` gets its block, loaded once, in
``method_options[label]["block"]``. Every method of ours verifies through the engine's fast copy of the target
(``fastpath``: prefix + block attention, measured matmul paths); the caller's model is left as it was.

With ``chat`` each prompt row's text becomes one user message under the target's chat template
(``chat.build_chat_prompt``), and the template's end-of-turn id joins the EOS ids. Every method, ours and the HF
peers, gets the same prompt ids and the same EOS ids, so lossless comparisons stay exact.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..chat import build_chat_prompt
from ..config import DecodeConfig, SamplingConfig
from ..drafters.longspec import parse_tree
from ..drafters.registry import SPECS, methods as registry_methods
from ..errors import RetrospecError
from ..fastpath import engine_for
from ..gating import resolve as resolve_gating
from ..models import LoadedModel
from ..request import Request
from ..run import Run
from ..types import SpecStats
from .hf_peers import HF_METHODS, ForwardProbe, full_vocab_draft, run_hf


@dataclass
class BenchConfig:
    methods: list[str]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int | None = None
    pld_k: int = SPECS["pld"].default_gamma
    pld_ngram: int = 3
    warmup: bool = True
    method_options: dict[str, dict] = field(default_factory=dict)  # extra factory options per method label
    chat: bool = False  # each prompt = one user message under the target's chat template
    gating: bool | None = None  # our methods' default (None = ``gating.resolve``); ``m@gating=0|1`` overrides it
    longspec_draft: str | None = None  # where longspec's block came from (reported; the block is in method_options)


@dataclass(frozen=True)
class MethodLabel:
    """A parsed bench label: the method and the options the label sets (None = the run's default)."""

    method: str
    gating: bool | None = None
    gamma: int | None = None
    tree: tuple[int, ...] | None = None


LABEL_OPTIONS = "gating=0|1, gamma=N, tree=WxWx... (longspec)"


def parse_label(label: str) -> MethodLabel:
    """A bench method label -> ``MethodLabel``: ``'rest@gating=0'`` -> gating False; ``'longspec@gamma=4'`` -> a
    chain of 4; ``'longspec@tree=4x8x8'`` -> tree (4, 8, 8); ``'sd'`` -> the run's defaults. Options join with
    ``@`` (``sd@gamma=3@gating=0``); each at most once. Lets one run compare variants of a method."""
    name, *opts = label.split("@")
    seen: dict[str, object] = {}
    spec = SPECS.get(name)
    ours = name not in HF_METHODS and name != "ar"
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in ("gating", "gamma", "tree"):
            raise RetrospecError(f"bad method option {opt!r} in {label!r}: options are {LABEL_OPTIONS}")
        if key in seen:
            raise RetrospecError(f"{label!r} sets {key} twice")
        if key == "gating":
            if value not in ("0", "1"):
                raise RetrospecError(f"bad method option {opt!r} in {label!r}: gating takes 0 or 1")
            if not ours:
                raise RetrospecError(f"{label!r}: gating applies to our drafting methods, not to {name}")
            seen[key] = value == "1"
        elif key == "gamma":
            if not (value.isdigit() and int(value) >= 1):
                raise RetrospecError(f"bad method option {opt!r} in {label!r}: gamma takes an integer >= 1")
            if not ours or spec is None or spec.knob("gamma") is None:
                chains = ", ".join(m for m, s in SPECS.items() if s.knob("gamma") and s.context != "required")
                raise RetrospecError(f"{label!r}: gamma applies to chain drafters ({chains}), not to {name}"
                                     + (" (use --draft-len)" if spec is not None and spec.knob("draft_len") else ""))
            seen[key] = int(value)
        else:
            if spec is None or spec.knob("tree") is None:
                raise RetrospecError(f"{label!r}: tree applies to longspec only")
            try:
                seen[key] = parse_tree(value.split("x"))  # longspec's own check of the widths
            except RetrospecError:
                raise RetrospecError(f"bad method option {opt!r} in {label!r}: tree takes widths >= 1 per depth "
                                     "joined by x, e.g. tree=4x16x16") from None
    if "gamma" in seen and "tree" in seen:
        raise RetrospecError(f"{label!r}: longspec drafts a chain (gamma) or a tree (tree), not both")
    return MethodLabel(name, **seen)


def validate_methods(methods: list[str], has_draft: bool) -> list[str]:
    known = set(SPECS) | set(HF_METHODS)
    short = set(registry_methods(context=False)) | set(HF_METHODS)
    for label in methods:
        m = parse_label(label).method
        if m not in known:
            raise RetrospecError(f"unknown method {m!r}; available: {', '.join(sorted(short))}")
        if m not in short:
            raise RetrospecError(f"method '{m}' needs long-context rows: a --prompts file whose rows have a "
                                 "'context' field (retrospec tasks make)")
        if (m in SPECS and SPECS[m].draft == "lm" or m.startswith("hf-assisted")) and not has_draft:
            raise RetrospecError(f"method '{m}' needs a draft model (--draft DIR)")
    return (["ar"] if "ar" not in methods else []) + list(dict.fromkeys(methods))


def label_options(label: MethodLabel, cfg: BenchConfig) -> dict:
    """Factory options of one label: the chain length (or longspec's tree) from the label, else the run's."""
    spec = SPECS[label.method]
    if spec.knob("gamma") is None:
        return {}
    if spec.knob("tree") is not None:  # a tree unless a chain length is given (by the label, else by --gamma)
        gamma = label.gamma if label.gamma is not None else (cfg.gamma if label.tree is None else None)
        return {"gamma": gamma, "tree": label.tree}
    if spec.knob("max_ngram") is not None:  # pld: --pld-k / --pld-ngram
        return {"gamma": label.gamma or cfg.pld_k, "max_ngram": cfg.pld_ngram}
    return {"gamma": label.gamma or cfg.gamma or spec.default_gamma}


def _run_ours(method: str, target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int],
              cfg: BenchConfig, max_new: int, eos_ids: frozenset[int]) -> tuple[list[int], SpecStats, float]:
    label = method
    parsed = parse_label(label)
    method, gating = parsed.method, parsed.gating
    options = label_options(parsed, cfg)
    options.update(cfg.method_options.get(label, {}))
    req = Request(target, draft if SPECS[method].draft == "lm" else None, method, prompt_ids, cfg.sampling,
                  DecodeConfig(max_new_tokens=max_new), options, eos_ids=eos_ids,
                  gating=resolve_gating(cfg.gating if gating is None else gating, cfg.sampling))
    stats = SpecStats(method=label)
    engine_on = engine_for(target.model).mode != "off"
    # the engine runs private copies of the models (fastpath): hooks on the caller's modules would see nothing
    probes = [] if engine_on else [ForwardProbe(target.model)] + ([ForwardProbe(draft.model)] if draft else [])
    for p in probes:
        p.__enter__()
    try:
        out = Run(req, stats, text=False).run()
    finally:
        for p in probes:
            p.__exit__()
    if engine_on:  # forward time = verification forwards + drafting (stats.draft_s, Python included)
        forward_s = stats.verify_s + stats.draft_s
    else:
        # the first target forward is the prefill (all prompt tokens but the last), not decoding
        prefill_fwd = probes[0].durations[0] if len(prompt_ids) > 1 and probes[0].durations else 0.0
        forward_s = sum(p.seconds for p in probes) - prefill_fwd
    if SPECS[method].draft == "block" and not engine_on:  # the block is not a model the probes see
        forward_s += stats.draft_s
    return out, stats, forward_s


def encode_prompts(target: LoadedModel, prompts: list[dict], chat: bool) -> tuple[list[list[int]], frozenset[int]]:
    """Prompt ids of every row and the EOS ids of the run (the target's, plus the end-of-turn id with ``chat``)."""
    tok = target.tokenizer
    if not chat:
        return [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts], target.eos_ids()
    built = [build_chat_prompt(tok, [{"role": "user", "content": p["prompt"]}], name=f"target {target.path}")
             for p in prompts]
    return [b.prompt_ids for b in built], target.eos_ids().union(*(b.end_of_turn_ids for b in built))


def run_bench(target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: BenchConfig,
              progress: bool = True) -> dict:
    tok = target.tokenizer
    encoded, eos = encode_prompts(target, prompts, cfg.chat)
    if any(not ids for ids in encoded):
        raise RetrospecError("a prompt encodes to zero tokens")
    limit = target.max_positions or 1 << 30
    for i, ids in enumerate(encoded):
        if len(ids) >= limit:
            raise RetrospecError(f"prompt {i} has {len(ids)} tokens; the target supports {limit} positions")
    pad = getattr(tok, "pad_token_id", None)
    torch.manual_seed(0)

    def run_one(method: str, ids: list[int], max_new: int):
        if method in HF_METHODS:
            hf_draft = full_vocab_draft(draft, target.vocab_size) if draft is not None else None
            return run_hf(method, target.model, hf_draft, ids, sampling=cfg.sampling,
                          max_new_tokens=max_new, eos_ids=eos, pad_id=pad,
                          gamma=cfg.gamma or SPECS["sd"].default_gamma,
                          pld_k=cfg.pld_k, pld_ngram=cfg.pld_ngram)
        return _run_ours(method, target, draft, ids, cfg, max_new, eos)

    if cfg.warmup:
        for m in cfg.methods:
            run_one(m, encoded[0], min(16, cfg.max_new_tokens))
    runs = []
    bar = tqdm(total=len(encoded) * len(cfg.methods), desc="bench", unit="run", disable=not progress,
               dynamic_ncols=True)
    for i, ids in enumerate(encoded):
        for m in cfg.methods:
            bar.set_postfix_str(m)
            out, stats, forward_s = run_one(m, ids, cfg.max_new_tokens)
            runs.append({"method": m, "prompt_index": i, "token_ids": out,
                         "stats": stats.to_dict() | {"forward_s": forward_s}})
            bar.update()
    bar.close()
    return {"config": _describe(target, draft, prompts, cfg) | {"eos_ids": sorted(eos)}, "runs": runs, "summary": summarize(runs, cfg)}


def summarize(runs: list[dict], cfg: BenchConfig) -> list[dict]:
    by_method: dict[str, list[dict]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    ar_runs = {r["prompt_index"]: r for r in by_method.get("ar", [])}

    def agg(rs, key):
        return sum(r["stats"][key] for r in rs)

    ar_tokens, ar_decode = agg(by_method["ar"], "new_tokens"), agg(by_method["ar"], "decode_s")
    ar_tps = ar_tokens / ar_decode if ar_decode else 0.0
    summary = []
    for m, rs in by_method.items():
        new, dec = agg(rs, "new_tokens"), agg(rs, "decode_s")
        calls, drafted, accepted = agg(rs, "target_calls"), agg(rs, "drafted_tokens"), agg(rs, "accepted_tokens")
        fwd = agg(rs, "forward_s")
        tps = new / dec if dec else 0.0
        lossless = None
        if cfg.sampling.greedy:
            lossless = all(r["token_ids"] == ar_runs[r["prompt_index"]]["token_ids"] for r in rs)
        summary.append({
            "method": m,
            "tokens_per_s": tps,
            "speedup": tps / ar_tps if ar_tps else 0.0,
            "ideal_speedup": (ar_decode / ar_tokens) / (fwd / new) if new and fwd > 0 and ar_tokens else 0.0,
            "mean_accepted_tokens": new / calls if calls else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "lossless": lossless,
            "gating": any(r["stats"].get("gating") for r in rs),
            "gated_share": sum(r["stats"].get("gated_steps", 0) for r in rs) / calls if calls else 0.0,
            "draft_state_bytes": _max_of(rs, "draft_state_bytes"),
            "target_kv_bytes": _max_of(rs, "target_kv_bytes"),
            "new_tokens": new,
            "decode_s": dec,
        })
    return summary


def _max_of(runs: list[dict], key: str) -> int | None:
    """The largest ``stats[key]`` over runs; None when no run measured it (hf-* rows)."""
    values = [r["stats"].get(key) for r in runs if r["stats"].get(key) is not None]
    return max(values) if values else None


def _option_value(v):
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, torch.nn.Module):  # a loaded model (longspec's block): its class, not its repr
        return type(v).__name__
    return str(v)


def _describe(target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: BenchConfig) -> dict:
    return {
        "target": target.path,
        "draft": draft.path if draft else None,
        "prompts": len(prompts),
        "chat": cfg.chat,
        "methods": cfg.methods,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.sampling.temperature,
        "top_p": cfg.sampling.top_p,
        "top_k": cfg.sampling.top_k,
        "seed": cfg.sampling.seed,
        "gamma": cfg.gamma or SPECS["sd"].default_gamma,
        "pld_k": cfg.pld_k,
        "pld_max_ngram": cfg.pld_ngram,
        "gating": cfg.gating,
        "longspec_draft": cfg.longspec_draft,
        "method_options": {m: {k: _option_value(v) for k, v in o.items()} for m, o in cfg.method_options.items()},
        "attention": getattr(target.model.config, "_attn_implementation", None),
        "engine": engine_for(target.model).describe(),
        "prompt_rows": [{k: p[k] for k in ("source", "prompt_tokens") if k in p} for p in prompts]
        if any("source" in p or "prompt_tokens" in p for p in prompts) else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def write_outputs(result: dict, out_dir: Path) -> None:
    from .report import render_markdown, render_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps({"config": result["config"], "runs": result["runs"], "summary": result["summary"]},
                              indent=1) + "\n")
    tmp.replace(out_dir / "results.json")
    (out_dir / "report.md").write_text(render_markdown(result))
    render_plot(result["summary"], out_dir / "speedup.png")
