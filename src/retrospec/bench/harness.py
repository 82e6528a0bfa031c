"""``retrospec bench``: every method on every prompt, side by side, in one process and one run.

Methods run interleaved per prompt (prompt 0: ar, sd, pld, hf-...; prompt 1: ...) after one untimed warm-up each,
so slow drift of the machine affects all methods alike.

Summary per method (token-weighted over prompts):
- tokens_per_s = sum(new tokens) / sum(decode seconds) (decode phase: after the prompt forward);
- speedup = tokens_per_s / ar's tokens_per_s from the same run;
- ideal_speedup = ar's seconds per token / (seconds inside target + draft forwards per token): the speedup with
  zero engine overhead, so speedup / ideal_speedup is the share of decode time spent in model forwards (our
  verifier's forwards are timed as ``verify_s``, decoder and LM head together; see ``verify.LogitsHead``);
- mean_accepted_tokens (tau) = new tokens / target forward calls; acceptance_rate = accepted / drafted;
- lossless = every output token-identical to ar's (greedy only; null when sampling);
- gated_share = steps the gate ran without a draft / target forwards (``gating``; labels ``m@gating=0|1``).

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
from ..decode import speculative_generate
from ..drafters import REGISTRY
from ..errors import RetrospecError
from ..gating import resolve as resolve_gating
from ..models import LoadedModel
from ..request import DEFAULT_GAMMA, Request
from ..types import SpecStats
from ..verify import LogitsHead
from .hf_peers import HF_METHODS, ForwardProbe, full_vocab_draft, run_hf


@dataclass
class BenchConfig:
    methods: list[str]
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int | None = None
    pld_k: int = DEFAULT_GAMMA["pld"]
    pld_ngram: int = 3
    warmup: bool = True
    method_options: dict[str, dict] = field(default_factory=dict)  # extra factory options per method name
    chat: bool = False  # each prompt = one user message under the target's chat template
    gating: bool | None = None  # our methods' default (None = ``gating.resolve``); ``m@gating=0|1`` overrides it


def parse_label(label: str) -> tuple[str, bool | None]:
    """A bench method label -> (method, gating): ``'rest@gating=0'`` -> ``('rest', False)``; ``'sd'`` ->
    ``('sd', None)``, None meaning the run's default. Lets one run compare a method with and without gating."""
    name, sep, opt = label.partition("@")
    if not sep:
        return name, None
    if opt not in ("gating=0", "gating=1"):
        raise RetrospecError(f"bad method option {opt!r} in {label!r}: the only option here is gating=0|1")
    if name in HF_METHODS or name == "ar":
        raise RetrospecError(f"{label!r}: gating applies to our drafting methods, not to {name}")
    return name, opt == "gating=1"


def validate_methods(methods: list[str], has_draft: bool) -> list[str]:
    known = set(REGISTRY) | set(HF_METHODS)
    for label in methods:
        m, _ = parse_label(label)
        if m not in known:
            raise RetrospecError(f"unknown method {m!r}; available: {', '.join(sorted(known))}")
        if (m == "sd" or m.startswith("hf-assisted")) and not has_draft:
            raise RetrospecError(f"method '{m}' needs a draft model (--draft DIR)")
    return (["ar"] if "ar" not in methods else []) + list(dict.fromkeys(methods))


def _run_ours(method: str, target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int],
              cfg: BenchConfig, max_new: int, eos_ids: frozenset[int]) -> tuple[list[int], SpecStats, float]:
    label = method
    method, gating = parse_label(label)
    gamma = cfg.gamma or DEFAULT_GAMMA.get(method, 5)
    options = {"gamma": gamma if method != "pld" else cfg.pld_k, "max_ngram": cfg.pld_ngram}
    options.update(cfg.method_options.get(label, {}))
    req = Request(target, draft, method, prompt_ids, cfg.sampling, DecodeConfig(max_new_tokens=max_new), options,
                  eos_ids=eos_ids, gating=resolve_gating(cfg.gating if gating is None else gating, cfg.sampling))
    stats = SpecStats(method=label)
    probes = [ForwardProbe(target.model)] + ([ForwardProbe(draft.model)] if draft is not None else [])
    for p in probes:
        p.__enter__()
    try:
        out: list[int] = []
        for chunk in speculative_generate(target.model, req.drafter(), prompt_ids, sampling=cfg.sampling,
                                          max_new_tokens=max_new, eos_ids=req.stop_ids(), stats=stats,
                                          gating=req.gating):
            out.extend(chunk)
    finally:
        for p in probes:
            p.__exit__()
    if LogitsHead.of(target.model) is not None:
        # the verifier runs the decoder and the head itself (verify.LogitsHead): its forwards are stats.verify_s
        # (decoding only); the probes see only drafters that call a whole model (a draft LM, or the target itself)
        forward_s = stats.verify_s + sum(p.seconds for p in probes)
    else:
        # the first target forward is the prefill (all prompt tokens but the last), not decoding
        prefill_fwd = probes[0].durations[0] if len(prompt_ids) > 1 and probes[0].durations else 0.0
        forward_s = sum(p.seconds for p in probes) - prefill_fwd
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
                          max_new_tokens=max_new, eos_ids=eos, pad_id=pad, gamma=cfg.gamma or DEFAULT_GAMMA["sd"],
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
            "new_tokens": new,
            "decode_s": dec,
        })
    return summary


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
        "gamma": cfg.gamma or DEFAULT_GAMMA["sd"],
        "pld_k": cfg.pld_k,
        "pld_max_ngram": cfg.pld_ngram,
        "gating": cfg.gating,
        "method_options": {m: {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                               for k, v in o.items()} for m, o in cfg.method_options.items()},
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
