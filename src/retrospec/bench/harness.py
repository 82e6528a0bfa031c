"""``retrospec bench``: every method on every row, side by side, in one process and one run.

A row with a ``context`` field is a long-context row (``retrospec tasks make``: ``context``, ``prompt`` = the query,
``answers``, ``task``, ``length``); a file's rows are all of one kind. Prompt rows compare against ``ar``, context
rows against ``lc`` (each always runs). Per row, every label runs in turn after one untimed warm-up each
(interleaved, so slow drift of the machine affects all alike). Every label of ours runs through the one run path
(``run.Run``) and verifies on the engine's fast copy of the target (``fastpath``); the caller's model is left as it
was. Labels follow ``bench.labels`` (one grammar); what each reported quantity means is defined once in
``bench.summary``.

Prompt rows: with ``chat`` each row's text becomes one user message under the target's chat template and the
template's end-of-turn id joins the EOS ids; every label, ours and the HF peers (``hf-*``), gets the same prompt ids
and EOS ids, so lossless comparisons stay exact. ``longspec`` gets its block, loaded once, in
``method_options[label]["draft"]``; forward time (``forward_s``) is the verification forwards plus drafting when the
engine runs its private copies, else what forward hooks on the caller's modules measure.

Context rows: retrieval runs once per row (rag and rapid share it) and is timed (``retrieval_s``); the long
prompt's prefill runs once per row and prompt (``verify.PrefillMemo``) and is timed separately (``prefill_full_s``;
``prefill_short_s`` for rag's retrieved prompt), so each label's own ``prefill_s`` holds only what it adds.
``hybrid_timing.verify_cost`` probes one verification forward against one decode token per context length.
"""

from __future__ import annotations

import contextlib
import platform
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..chat import build_chat_prompt
from ..config import SamplingConfig
from ..drafters.registry import BASELINE, CONTEXT_BASELINE, SPECS, methods as registry_methods
from ..errors import RetrospecError
from ..fastpath import engine_for
from ..models import LoadedModel, placement
from ..request import CONTEXT_OPTIONS, LongContextOptions, plan, prepare, retrieve
from ..run import Run
from ..tasks import score
from ..text import encode
from ..types import SpecStats
from ..verify import PrefillMemo
from ..weight_only import format_of
from .hf_peers import HF_METHODS, ForwardProbe, full_vocab_draft, run_hf
from .hybrid_timing import verify_cost
from . import llamacpp, vllm_peer
from .llamacpp import LLAMACPP_METHODS
from .vllm_peer import VLLM_METHODS
from .labels import MethodLabel, parse_label
from .summary import summarize_prompts, summarize_rows


@dataclass
class BenchConfig:
    methods: list[str]  # labels (``bench.labels``)
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int | None = None
    pld_k: int = SPECS["pld"].default_gamma
    pld_ngram: int = 3
    warmup: bool = True
    method_options: dict[str, dict] = field(default_factory=dict)  # extra factory options per label (prompt rows)
    chat: bool = False  # each prompt = one user message under the target's chat template
    gating: bool | None = None  # our methods' default (None = ``gating.resolve``); ``m@gating=0|1`` overrides it
    longspec_draft: str | None = None  # where longspec's block came from (reported; the block is in method_options)
    options: LongContextOptions = field(default_factory=LongContextOptions)  # context rows
    verify_probe_gamma: int = 10  # context rows: ``verify_cost`` per length (0 = no probe)


def validate_methods(methods: list[str], has_draft: bool) -> list[str]:
    known = set(SPECS) | set(HF_METHODS) | set(PEER_METHODS)
    short = set(registry_methods(context=False)) | set(HF_METHODS) | set(PEER_METHODS)
    for label in methods:
        m = parse_label(label).method
        if m not in known:
            raise RetrospecError(f"unknown method {m!r}; available: {', '.join(sorted(short))}")
        if m not in short:
            raise RetrospecError(f"method '{m}' needs long-context rows: a --prompts file whose rows have a "
                                 "'context' field (retrospec tasks make)")
        if (m in SPECS and SPECS[m].draft == "lm" or m.startswith("hf-assisted")) and not has_draft:
            raise RetrospecError(f"method '{m}' needs a draft model (--draft DIR)")
    return with_baseline(list(dict.fromkeys(methods)), BASELINE)


def with_baseline(labels: list[str], base: str) -> list[str]:
    """The labels with the baseline first (added when missing); each label at most once."""
    if len(set(labels)) != len(labels):
        raise RetrospecError("each method label may appear once")
    return ([base] if base not in labels else []) + list(labels)


def label_options(label: MethodLabel, cfg: BenchConfig) -> dict:
    """Factory options of one label: the chain length (or longspec's tree) from the label, else the run's, checked
    by the method's spec (which fills in its default gamma, as for the API)."""
    spec = SPECS[label.method]
    if spec.knob("gamma") is None:
        return {}
    if spec.knob("tree") is not None:  # a tree unless a chain length is given (by the label, else by --gamma)
        gamma = label.gamma if label.gamma is not None else (cfg.gamma if label.tree is None else None)
        return spec.check({"gamma": gamma, "tree": label.tree})
    if spec.knob("max_ngram") is not None:  # pld: --pld-k / --pld-ngram
        return spec.check({"gamma": label.gamma or cfg.pld_k, "max_ngram": cfg.pld_ngram})
    return spec.check({"gamma": label.gamma or cfg.gamma})


def _gating(label: MethodLabel, cfg: BenchConfig) -> bool | None:
    return cfg.gating if label.gating is None else label.gating  # None: ``gating.resolve`` decides


def sampling_kwargs(sampling: SamplingConfig) -> dict:
    """``prepare``'s sampling keywords from a ``SamplingConfig``."""
    return {f: getattr(sampling, f) for f in SamplingConfig.__dataclass_fields__}


def _run_ours(label: str, target: LoadedModel, draft: LoadedModel | None, prompt: str | list[int],
              cfg: BenchConfig, max_new: int) -> tuple[list[int], SpecStats, float]:
    """One label on one prompt row; ``prompt``: its token ids, or its text under the chat template (``cfg.chat``)."""
    parsed = parse_label(label)
    spec = SPECS[parsed.method]
    options = label_options(parsed, cfg) | parsed.knobs | cfg.method_options.get(label, {})
    # a label's own resource (longspec: its block, loaded once) else the run's draft LM for the methods that take one
    resource = options.pop("draft", draft if spec.draft == "lm" else None)
    chat = [{"role": "user", "content": prompt}] if cfg.chat else None
    req = prepare(None if cfg.chat else prompt, messages=chat, target=target, draft=resource, method=parsed.method,
                  max_new_tokens=max_new, gating=_gating(parsed, cfg), **sampling_kwargs(cfg.sampling), **options)
    stats = SpecStats(method=label)
    engine_on = engine_for(target.model).mode != "off"
    # the engine runs private copies of the models (fastpath): hooks on the caller's modules would see nothing
    probes = [] if engine_on else [ForwardProbe(target.model)] + ([ForwardProbe(draft.model)] if draft else [])
    with contextlib.ExitStack() as stack:
        for p in probes:
            stack.enter_context(p)
        out = Run(req, stats, text=False).run()
    if engine_on:  # forward time = verification forwards + drafting (stats.draft_s, Python included)
        return out, stats, stats.verify_s + stats.draft_s
    # the first target forward is the prefill (all prompt tokens but the last), not decoding
    prefill_fwd = probes[0].durations[0] if len(req.prompt_ids) > 1 and probes[0].durations else 0.0
    block_s = stats.draft_s if req.draft is None else 0.0  # a draft that is no model (a block) the probes do not see
    return out, stats, sum(p.seconds for p in probes) - prefill_fwd + block_s


def encode_prompts(target: LoadedModel, prompts: list[dict], chat: bool) -> tuple[list[list[int]], frozenset[int]]:
    """Prompt ids of every row and the EOS ids of the run (the target's, plus the end-of-turn id with ``chat``)."""
    tok = target.tokenizer
    if not chat:
        return [encode(tok, p["prompt"], f"prompt {i}") for i, p in enumerate(prompts)], target.eos_ids()
    built = [build_chat_prompt(tok, [{"role": "user", "content": p["prompt"]}], name=f"target {target.path}")
             for p in prompts]
    return [b.prompt_ids for b in built], target.eos_ids().union(*(b.end_of_turn_ids for b in built))


def run_bench(target: LoadedModel, draft: LoadedModel | None, rows: list[dict], cfg: BenchConfig,
              progress: bool = True) -> dict:
    """Run every label on every row (see the module docstring); returns config, runs and summary."""
    if target.tokenizer is None:
        raise RetrospecError(f"target {target.path} has no tokenizer files")
    run = _run_context_rows if any("context" in r for r in rows) else _run_prompt_rows
    return run(target, draft, rows, cfg, progress)


PEER_METHODS = (*LLAMACPP_METHODS, *VLLM_METHODS)  # rows another engine runs, in its own interpreter (bench.peers)


def open_peers(methods: list[str], target_path, fmt: str, greedy: bool, threads: int, n_ctx: int, pld_k: int,
               pld_ngram: int) -> tuple[dict, list[str]]:
    """A started worker per requested peer row (llama.cpp, vLLM), and one note per row skipped (why)."""
    peers, notes = {}, []
    for module in (llamacpp, vllm_peer):
        got, why = module.open_peers(methods, target_path, fmt, greedy, threads, n_ctx, pld_k, pld_ngram)
        peers.update(got)
        notes.extend(why)
    return peers, notes


def _run_prompt_rows(target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: BenchConfig,
                     progress: bool) -> dict:
    encoded, eos = encode_prompts(target, prompts, cfg.chat)
    if any(not ids for ids in encoded):
        raise RetrospecError("a prompt encodes to zero tokens")
    limit = target.max_positions or 1 << 30
    for i, ids in enumerate(encoded):
        if len(ids) >= limit:
            raise RetrospecError(f"prompt {i} has {len(ids)} tokens; the target supports {limit} positions")
    pad = getattr(target.tokenizer, "pad_token_id", None)
    torch.manual_seed(0)
    fmt = format_of(target.model) or str(placement(target)["dtype"]).removeprefix("torch.")
    peers, notes = open_peers(cfg.methods, target.path, fmt, cfg.sampling.greedy, torch.get_num_threads(),
                              max(map(len, encoded)) + cfg.max_new_tokens + 64, cfg.pld_k, cfg.pld_ngram)
    methods = [m for m in cfg.methods if m not in PEER_METHODS or m in peers]
    try:
        return _interleave(target, draft, prompts, replace(cfg, methods=methods), encoded, eos, pad, peers, progress,
                           notes)
    finally:
        for peer in peers.values():
            peer.close()


def _interleave(target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: BenchConfig,
                encoded: list[list[int]], eos: frozenset[int], pad: int | None, peers: dict, progress: bool,
                notes: list[str]) -> dict:
    def run_one(method: str, i: int, max_new: int):
        ids = encoded[i]
        if method in peers:
            return peers[method].generate(ids, max_new, eos)
        if method in HF_METHODS:
            hf_draft = full_vocab_draft(draft, target.vocab_size) if draft is not None else None
            return run_hf(method, target.model, hf_draft, ids, sampling=cfg.sampling, max_new_tokens=max_new,
                          eos_ids=eos, pad_id=pad, gamma=cfg.gamma or SPECS["sd"].default_gamma, pld_k=cfg.pld_k,
                          pld_ngram=cfg.pld_ngram)
        return _run_ours(method, target, draft, prompts[i]["prompt"] if cfg.chat else ids, cfg, max_new)

    methods, runs = list(cfg.methods), []

    def attempt(m: str, i: int, max_new: int):
        """run_one; a peer that fails is dropped with a note (its rows gone), never the bench."""
        try:
            return run_one(m, i, max_new)
        except RetrospecError as exc:
            if m not in peers:
                raise
            notes.append(f"{m} dropped: {exc}")
            methods.remove(m)
            runs[:] = [r for r in runs if r["method"] != m]
            peers.pop(m).close()
            return None

    if cfg.warmup:
        for m in list(methods):
            attempt(m, 0, min(16, cfg.max_new_tokens))
    with _bar(len(encoded) * len(methods), progress) as bar:
        for i, ids in enumerate(encoded):
            for m in list(methods):
                bar.set_postfix_str(m)
                got = attempt(m, i, cfg.max_new_tokens)
                if got is not None:
                    out, stats, forward_s = got
                    runs.append({"method": m, "prompt_index": i, "token_ids": out,
                                 "stats": stats.to_dict() | {"forward_s": forward_s}})
                bar.update()
    cfg = replace(cfg, methods=methods)
    peer_info = {m: p.describe() for m, p in peers.items()}
    return {"config": _describe_prompts(target, draft, prompts, cfg) | {"eos_ids": sorted(eos), "notes": notes}
            | ({"peers": peer_info} if peer_info else {}), "runs": runs,
            "summary": summarize_prompts(runs, cfg.sampling.greedy)}


def _bar(total: int, progress: bool) -> tqdm:
    return tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)


def _option_value(v):
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, torch.nn.Module):  # a loaded model (longspec's block): its class, not its repr
        return type(v).__name__
    return str(v)


def _describe_prompts(target: LoadedModel, draft: LoadedModel | None, prompts: list[dict], cfg: BenchConfig) -> dict:
    return {
        "target": target.path, "draft": draft.path if draft else None, "prompts": len(prompts), "chat": cfg.chat,
        "methods": cfg.methods, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.sampling.temperature,
        "top_p": cfg.sampling.top_p, "top_k": cfg.sampling.top_k, "seed": cfg.sampling.seed,
        "gamma": cfg.gamma or SPECS["sd"].default_gamma, "pld_k": cfg.pld_k, "pld_max_ngram": cfg.pld_ngram,
        "gating": cfg.gating, "longspec_draft": cfg.longspec_draft,
        "method_options": {m: {k: _option_value(v) for k, v in o.items()} for m, o in cfg.method_options.items()},
        "attention": getattr(target.model.config, "_attn_implementation", None),
        "engine": engine_for(target.model).describe(),
        "prompt_rows": [{k: p[k] for k in ("source", "prompt_tokens") if k in p} for p in prompts]
        if any("source" in p or "prompt_tokens" in p for p in prompts) else None,
    } | _machine(target)


def _machine(target: LoadedModel) -> dict:
    """Where and how the run ran: torch, threads, the CPU (and the GPU the target is on), the target's dtype."""
    where = placement(target)
    gpu = torch.cuda.get_device_name(where["device"]) if where["device"].type == "cuda" else None
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "device": str(where["device"]) + (f" ({gpu})" if gpu else ""),
            "dtype": format_of(target.model) or str(where["dtype"]).removeprefix("torch."),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def _run_context_label(spec: MethodLabel, row: dict, retrieved, memos: dict, max_new: int, target: LoadedModel,
                       draft: LoadedModel | None, cfg: BenchConfig) -> tuple[list[int], SpecStats]:
    """One label on one context row; ``retrieved``: the row's shared retrieval, ``memos``: its prefill memos."""
    opts = replace(cfg.options, **spec.overrides) if spec.overrides else cfg.options
    if SPECS[spec.method].knob("eta") is None and opts.eta:  # --eta is RAPID's; baselines keep exact rules
        opts = replace(opts, eta=0.0)
    reuse = retrieved if not spec.overrides or opts.retrieval == cfg.options.retrieval else None
    method = SPECS[spec.method]
    knobs = dict(spec.knobs)
    if method.knob("gamma") is not None:  # the spec fills in its long-context default gamma
        knobs |= {"gamma": spec.gamma or cfg.gamma, "adaptive_gamma": spec.adaptive}
    drf = None if spec.self_draft or method.draft != "lm" else draft  # None: the target itself
    req = prepare(row["prompt"], context=row["context"], target=target, draft=drf, method=spec.method,
                  max_new_tokens=max_new, gating=_gating(spec, cfg), retrieved=reuse, **sampling_kwargs(cfg.sampling),
                  **{f: getattr(opts, f) for f in CONTEXT_OPTIONS}, **knobs)
    stats = SpecStats(method=spec.label, **req.info)
    short = method.retrieval and method.draft == "none"  # rag: the target reads the retrieved context
    memo = memos.setdefault("short" if short else "full", PrefillMemo())
    return Run(req, stats, memo=memo, text=False).run(), stats


def _run_context_rows(target: LoadedModel, draft: LoadedModel | None, rows: list[dict], cfg: BenchConfig,
                      progress: bool) -> dict:
    for i, row in enumerate(rows):
        if not isinstance(row.get("context"), str) or not isinstance(row.get("prompt"), str):
            raise RetrospecError(f"row {i} needs string fields 'context' and 'prompt'")
    methods = [parse_label(m, context=True) for m in with_baseline(cfg.methods, CONTEXT_BASELINE)]
    tok = target.tokenizer
    torch.manual_seed(0)
    retriever = next((m.method for m in methods if SPECS[m.method].retrieval), None)  # one retrieval per row

    def fetch(row: dict):
        return retrieve(retriever, row["context"], row["prompt"], tok, cfg.options) if retriever else None

    if cfg.warmup and rows:
        first = min(rows, key=lambda r: len(r["context"]))
        got, warm_memos = fetch(first), {}
        for m in methods:
            _run_context_label(m, first, got, warm_memos, min(4, cfg.max_new_tokens), target, draft, cfg)
    runs, probes, probed = [], [], set()
    with _bar(len(rows) * len(methods), progress) as bar:
        for i, row in enumerate(rows):
            got, memos = fetch(row), {}
            length = int(row.get("length") or 0)
            for m in methods:
                bar.set_postfix_str(f"{row.get('task', '?')}@{length} {m.label}")
                out, stats = _run_context_label(m, row, got, memos, cfg.max_new_tokens, target, draft, cfg)
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
                ids = plan(CONTEXT_BASELINE, row["context"], row["prompt"], tok, cfg.sampling, cfg.options).target_prompt_ids
                probe = verify_cost(target.model, ids, cfg.verify_probe_gamma, memo=memos["full"])
                probes.append(probe | {"length": length})
    return {"config": _describe_rows(target, draft, rows, cfg, methods), "runs": runs,
            "summary": summarize_rows(runs), "verify_probes": probes}


def _describe_rows(target: LoadedModel, draft: LoadedModel | None, rows: list[dict], cfg: BenchConfig,
                   methods: list[MethodLabel]) -> dict:
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
        "similarity_floor": o.similarity_floor, "piece_tokens": o.piece_tokens,
        "embedder": str(o.embedder or "all-MiniLM-L6-v2 (bundled)"),
        "sink": o.sink, "window": o.window, "attention": target.model.config._attn_implementation,
    } | _machine(target)
