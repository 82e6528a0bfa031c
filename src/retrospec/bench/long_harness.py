"""Long-context bench: lc, rag, sd, magicdec and rapid on the same (context, query) rows, in one process and run.

Rows come from ``retrospec tasks make`` (fields ``context``, ``prompt`` = the query, ``answers``, ``task``,
``length``). Per row, every method runs in turn (interleaved, so drift of the machine hits all alike):

- retrieval runs once per row (rag and rapid share it) and is timed (``retrieval_s``);
- the long prompt's prefill runs once per row and prompt (``verify.PrefillMemo``) and is timed separately
  (``prefill_full_s``; ``prefill_short_s`` for rag's retrieved prompt); each method's own ``prefill_s`` then holds
  only what it adds (a copy of the cache, the drafter's own prompt);
- ``lc`` is the baseline and always runs.

Method specs are names with optional ``@key=value`` overrides, e.g. ``rapid``, ``rapid@eta=1``,
``rapid@draft=self`` (self-speculation when --draft is set), ``sd@draft=self``, ``magicdec@window=512``,
``rapid@adaptive=1``. Keys: ``draft`` (``self`` or ``default``), ``gamma``, ``adaptive`` (1: the draft length
grows by 2 after a fully accepted chain and shrinks by 1 after a rejection, from ``gamma``), ``gating`` (0|1: this
method without / with the gate, see ``gating``; default: the run's, on unless --no-gating) and every
``LongContextOptions`` field.

Summary per (context length, method), token-weighted over rows:
- tokens_per_s = new tokens / decode seconds; speedup = tokens_per_s / lc's in the same length group;
- tau = new tokens / target forwards; acceptance = accepted / drafted;
- ideal_speedup = tau * t_lc / t_step, where t_lc = lc's seconds per decode forward (one token over the full cache)
  and t_step = (draft + verify seconds) / verification steps of the method, all measured in this run; measured /
  ideal is the share of the decode loop spent in model forwards;
- verify_ratio = the method's seconds per verification forward / t_lc (gamma + 1 tokens scored vs one);
- accuracy = share of rows scored correct by ``long_tasks.score``; same_as_lc = share of rows whose output is
  token-identical to lc's (a lossless method over the full context must reach 1.0 when greedy);
- rule / lossless: the acceptance rule; RAPID with eta > 0 is LOSSY and flagged as such.

``verify_cost`` is the dedicated probe for the attention-cost goal: median time of one verification forward of
gamma draft tokens vs one decode token at a given cache length, rolled back after each call.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..config import DecodeConfig, SamplingConfig
from ..drafters.registry import SPECS, methods as registry_methods
from ..errors import RetrospecError
from ..gating import resolve as resolve_gating
from ..long_requests import LongContextOptions, plan, retrieve
from ..models import LoadedModel
from ..request import Request
from ..run import Run
from ..types import DraftTree, SpecStats
from ..verify import PrefillMemo, Verifier
from .long_tasks import score


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    self_draft: bool = False
    gamma: int | None = None
    adaptive: bool = False
    overrides: dict = field(default_factory=dict)  # LongContextOptions fields
    gating: bool | None = None  # None = the run's default (LongBenchConfig.gating)


def parse_method(spec: str) -> MethodSpec:
    name, *parts = spec.split("@")
    long_methods = registry_methods(context=True)
    if name not in long_methods:
        raise RetrospecError(f"unknown long-context method {name!r}; available: {', '.join(long_methods)}")
    fields = set(LongContextOptions.__dataclass_fields__)
    self_draft, gamma, adaptive, over, gating = False, None, False, {}, None
    for part in parts:
        key, _, value = part.partition("=")
        if key == "draft" and value in ("self", "default"):
            self_draft = value == "self"
        elif key == "gamma" and value.isdigit() and int(value) > 0:
            gamma = int(value)
        elif key == "adaptive" and value in ("0", "1"):
            adaptive = value == "1"
        elif key == "gating" and value in ("0", "1"):
            gating = value == "1"
        elif key in fields and value:
            try:
                over[key] = float(value) if "." in value or "e" in value.lower() else int(value)
            except ValueError:
                over[key] = value
        else:
            raise RetrospecError(f"bad method option {part!r} in {spec!r} (draft=self|default, gamma=N >= 1, "
                                 f"adaptive=0|1, gating=0|1, or one of: {', '.join(sorted(fields))})")
    drafting = [m for m in long_methods if SPECS[m].knob("gamma")]
    if self_draft and SPECS[name].draft != "lm":
        users = " and ".join(m for m in long_methods if SPECS[m].draft == "lm")
        raise RetrospecError(f"{spec!r}: draft=self applies to {users} only")
    if (adaptive or gamma or gating is not None) and name not in drafting:
        raise RetrospecError(f"{spec!r}: gamma, adaptive and gating apply to methods that draft "
                             f"({', '.join(drafting)})")
    return MethodSpec(spec, name, self_draft, gamma, adaptive, over, gating)


@dataclass
class LongBenchConfig:
    methods: list[MethodSpec]
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int | None = None
    options: LongContextOptions = field(default_factory=LongContextOptions)
    warmup: bool = True
    verify_probe_gamma: int = 10
    gating: bool | None = None  # drafting methods' default (None = ``gating.resolve``); @gating=0|1 overrides it


def with_baseline(methods: list[MethodSpec]) -> list[MethodSpec]:
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise RetrospecError("each method spec may appear once")
    return ([parse_method("lc")] if "lc" not in labels else []) + methods


@torch.inference_mode()
def verify_cost(target: torch.nn.Module, prompt_ids: list[int], gamma: int = 10, reps: int = 15,
                memo: PrefillMemo | None = None) -> dict:
    """Median seconds of one verification forward of ``gamma`` chain tokens vs one decode token after
    ``prompt_ids`` (cache rolled back after each call, so every call sees the same cache length), with the target
    as it is (transformers' ``sdpa``) and through the engine's fast copy (``fastpath``: ``attention.prefix_block``
    and the measured matmul paths). The caller's model is not changed."""
    root = prompt_ids[-1]
    chain = DraftTree.chain(prompt_ids[-gamma - 1:-1] if len(prompt_ids) > gamma else [root] * gamma)
    out = {"cache_tokens": len(prompt_ids), "gamma": gamma}
    for key, how in (("sdpa", "off"), ("prefix_block", None)):
        ver = Verifier(target, fastpath=how)
        if how is None and ver.engine.mode == "off":
            continue
        ver.prefill(prompt_ids[:-1], memo)  # the decode loop's invariant: the cache holds all but the root
        times: dict[int, list[float]] = {0: [], gamma: []}
        for _ in range(reps):
            for n, tree in ((0, DraftTree.empty()), (gamma, chain)):
                t = time.perf_counter()
                ver.score(root, tree)
                times[n].append(time.perf_counter() - t)
                ver.commit([])
                ver.kv.crop(len(prompt_ids))
        t1, tg = statistics.median(times[0]), statistics.median(times[gamma])
        out[key] = {"attention": ver.engine.describe()["attention"], "decode_s": t1, "verify_s": tg,
                    "ratio": tg / t1}
    return out


class _Runner:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, cfg: LongBenchConfig):
        self.target, self.draft, self.cfg = target, draft, cfg

    def run(self, spec: MethodSpec, row: dict, retrieved, memos: dict, max_new: int) -> tuple[list[int], SpecStats]:
        cfg = self.cfg
        opts = replace(cfg.options, **spec.overrides) if spec.overrides else cfg.options
        if SPECS[spec.method].knob("eta") is None and opts.eta:  # --eta is RAPID's; baselines keep exact rules
            opts = replace(opts, eta=0.0)
        reuse = retrieved if not spec.overrides or opts.retrieval == cfg.options.retrieval else None
        p = plan(spec.method, row["context"], row["prompt"], self.target.tokenizer, cfg.sampling, opts, reuse)
        drf, method = None, SPECS[spec.method]
        if method.draft == "lm":
            drf = self.target if (spec.self_draft or self.draft is None) else self.draft
        options = dict(p.drafter_options)
        if method.knob("gamma") is not None:
            options["gamma"] = spec.gamma or cfg.gamma or method.context_gamma
            options["adaptive"] = spec.adaptive
        req = Request(self.target, drf, spec.method, p.target_prompt_ids, cfg.sampling,
                      DecodeConfig(max_new_tokens=max_new), options, rule=p.rule, info=p.info,
                      gating=resolve_gating(cfg.gating if spec.gating is None else spec.gating, cfg.sampling),
                      fastpath=None if opts.prefix_attention else "off")
        stats = SpecStats(method=spec.label, **p.info)
        short = method.retrieval and method.draft == "none"  # rag: the target reads the retrieved context
        memo = memos.setdefault("short" if short else "full", PrefillMemo())
        return Run(req, stats, memo=memo, text=False).run(), stats


def run_long_bench(target: LoadedModel, draft: LoadedModel | None, rows: list[dict], cfg: LongBenchConfig,
                   progress: bool = True) -> dict:
    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer files")
    for i, row in enumerate(rows):
        if not isinstance(row.get("context"), str) or not isinstance(row.get("prompt"), str):
            raise RetrospecError(f"row {i} needs string fields 'context' and 'prompt'")
    methods = with_baseline(cfg.methods)
    runner = _Runner(target, draft, cfg)
    tok = target.tokenizer
    torch.manual_seed(0)
    needs_retrieval = any(SPECS[m.method].retrieval for m in methods)
    if cfg.warmup and rows:
        first = min(rows, key=lambda r: len(r["context"]))
        got = retrieve("rapid", first["context"], first["prompt"], tok, cfg.options) if needs_retrieval else None
        warm_memos: dict = {}
        for m in methods:
            runner.run(m, first, got, warm_memos, min(4, cfg.max_new_tokens))
    runs, probes = [], []
    bar = tqdm(total=len(rows) * len(methods), desc="long bench", unit="run", disable=not progress,
               dynamic_ncols=True)
    probed: set[int] = set()
    for i, row in enumerate(rows):
        got = retrieve("rapid", row["context"], row["prompt"], tok, cfg.options) if needs_retrieval else None
        memos: dict = {}
        length = int(row.get("length") or 0)
        for m in methods:
            bar.set_postfix_str(f"{row.get('task', '?')}@{length} {m.label}")
            out, stats = runner.run(m, row, got, memos, cfg.max_new_tokens)
            text = tok.decode(out, skip_special_tokens=True)
            runs.append({"method": m.label, "row": i, "task": row.get("task", "?"), "length": length,
                         "context_tokens": row.get("context_tokens"), "token_ids": out, "text": text,
                         "correct": score(row, text), "stats": stats.to_dict(),
                         "prefill_full_s": memos["full"].seconds if "full" in memos else None,
                         "prefill_short_s": memos["short"].seconds if "short" in memos else None,
                         "retrieval_total_s": got.seconds if got is not None else None})
            bar.update()
        if cfg.verify_probe_gamma and length not in probed and "full" in memos:
            probed.add(length)
            ids = plan("lc", row["context"], row["prompt"], tok, cfg.sampling, cfg.options).target_prompt_ids
            probe = verify_cost(target.model, ids, cfg.verify_probe_gamma, memo=memos["full"])
            probes.append(probe | {"length": length})
    bar.close()
    return {"config": describe(target, draft, rows, cfg, methods), "runs": runs, "summary": summarize(runs),
            "verify_probes": probes}


def _sum(rs: list[dict], key: str) -> float:
    return sum(r["stats"][key] for r in rs)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (length, method) and per (length, task, method); see the module docstring for the fields."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["length"], "all", r["method"]), []).append(r)
        groups.setdefault((r["length"], r["task"], r["method"]), []).append(r)
    lc_by_row = {(r["row"]): r for r in runs if r["method"] == "lc"}
    for (length, task, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all", kv[0][1])):
        base = groups.get((length, task, "lc"), [])
        new, dec = _sum(rs, "new_tokens"), _sum(rs, "decode_s")
        calls, drafted, accepted = _sum(rs, "target_calls"), _sum(rs, "drafted_tokens"), _sum(rs, "accepted_tokens")
        steps = calls  # target_calls counts verification forwards only (the prompt's prefill is not one)
        tps = new / dec if dec else 0.0
        b_new, b_dec = _sum(base, "new_tokens"), _sum(base, "decode_s")
        b_tps = b_new / b_dec if b_dec else 0.0
        b_steps = _sum(base, "target_calls")
        t_lc = _sum(base, "verify_s") / b_steps if b_steps else 0.0
        t_step = (_sum(rs, "verify_s") + _sum(rs, "draft_s")) / steps if steps else 0.0
        t_verify = _sum(rs, "verify_s") / steps if steps else 0.0
        tau = new / calls if calls else 0.0
        out.append({
            "length": length, "task": task, "method": method, "rows": len(rs),
            "tokens_per_s": tps, "speedup": tps / b_tps if b_tps else 0.0,
            "ideal_speedup": tau * t_lc / t_step if t_step else 0.0,
            "mean_accepted_tokens": tau, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "verify_ratio": t_verify / t_lc if t_lc else 0.0,
            "t_lc_decode_s": t_lc, "t_verify_s": t_verify,
            "t_draft_per_token_s": _sum(rs, "draft_s") / drafted if drafted else 0.0,
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "same_as_lc": sum(r["token_ids"] == lc_by_row[r["row"]]["token_ids"] for r in rs) / len(rs)
            if all(r["row"] in lc_by_row for r in rs) else None,
            "prefill_s": sum(r["stats"]["prefill_s"] for r in rs) / len(rs),
            "prefill_full_s": _mean([r["prefill_full_s"] for r in rs]),
            "retrieval_s": _mean([r["stats"]["retrieval_s"] for r in rs if r["stats"]["retrieved_tokens"]]),
            "retrieved_tokens": _mean([r["stats"]["retrieved_tokens"] for r in rs if r["stats"]["retrieved_tokens"]]),
            "context_tokens": _mean([r["context_tokens"] for r in rs]),
            "rule": rs[0]["stats"]["rule"], "lossless": all(r["stats"]["lossless"] for r in rs),
            "gating": any(r["stats"].get("gating") for r in rs),
            "gated_share": sum(r["stats"].get("gated_steps", 0) for r in rs) / calls if calls else 0.0,
            "new_tokens": new, "decode_s": dec,
        })
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def describe(target: LoadedModel, draft: LoadedModel | None, rows: list[dict], cfg: LongBenchConfig,
             methods: list[MethodSpec]) -> dict:
    o = cfg.options
    return {
        "target": target.path, "draft": draft.path if draft else "(target itself)", "rows": len(rows),
        "tasks": sorted({r.get("task", "?") for r in rows}),
        "lengths": sorted({int(r.get("length") or 0) for r in rows}),
        "methods": [m.label for m in methods], "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.sampling.temperature, "seed": cfg.sampling.seed,
        "gamma": cfg.gamma or SPECS["rapid"].context_gamma,
        "gating": cfg.gating,
        "eta": o.eta, "chunk_tokens": o.chunk_tokens, "retrieval_tokens": o.retrieval_tokens,
        "min_retrieval_tokens": o.min_retrieval_tokens, "max_retrieval_fraction": o.max_retrieval_fraction,
        "similarity_floor": o.similarity_floor, "piece_tokens": o.piece_tokens, "embedder": str(o.embedder or "all-MiniLM-L6-v2 (bundled)"),
        "sink": o.sink, "window": o.window, "attention": target.model.config._attn_implementation,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
