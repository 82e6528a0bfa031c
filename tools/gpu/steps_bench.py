"""Steps ``tests`` and ``bench`` (tools/gpu/README.md: what each measures, known gaps).

Both run the bench harness (``bench.harness.run_bench``) unchanged on models loaded with ``load_model(...,
device=...)``, with the per-label options (rest/dresd stores, longspec's block) built as ``cli.bench_cmd`` builds
them. ``tests``: the greedy tokens of every method equal the oracle's (``decode.autoregressive_generate``) token for
token (zoo pair, float32), and pytest over the CUDA-relevant tests (a dry run only collects them). ``bench``:
methods x prompt sets x dtypes (float32 first, where lossless is checked), each cell while the budget lasts, then
``bench.profile.run_profile``. Dry run: the zoo pair, 1 prompt, 4 tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from . import common

CUDA_TESTS = ("tests/test_cuda.py", "tests/test_hybrid_tree_attention.py", "tests/test_rapid_zoo_long.py")
METHODS = ("ar", "sd", "pld", "magicdec", "longspec", "rest", "dresd", "hf-assisted", "hf-pld")


def store_corpus(path: Path, max_bytes: int) -> Path:
    """A text corpus of stdlib training-split files, about ``max_bytes`` long (tokenizing all of the stdlib takes
    half a minute on a small CPU; the stores only need to be real, not large)."""
    from retrospec.stdlib_corpus import stdlib_files

    parts, size = [], 0
    for f in stdlib_files("train"):
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= max_bytes:
            break
    path.write_text("\n\n".join(parts), encoding="utf-8")
    return path


def build_stores(target: str, work: Path, max_bytes: int) -> dict[str, str]:
    """Retrieval stores for rest (suffix) and dresd (dense, only with faiss), built as ``retrospec datastore build
    --corpus`` builds them, from ``store_corpus``; returns {kind: dir}."""
    from retrospec.models import load_model
    from retrospec.retrieval import build_dense_store, build_suffix_store
    from retrospec.retrieval.corpus import open_text_corpus, tokenize
    from retrospec.retrieval.store import target_meta, tokenizer_meta

    try:
        __import__("faiss")
        kinds = ("suffix", "dense")
    except Exception:  # ImportError, or a broken wheel
        kinds = ("suffix",)
    work = work / f"stores-{Path(target).name}-{max_bytes}"  # built once per target and size, reused
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "store-corpus.txt"
    stores = {kind: work / f"store-{kind}" for kind in kinds}
    if todo := [kind for kind, out in stores.items() if not (out / "meta.json").is_file()]:
        if not corpus.is_file():
            store_corpus(corpus, max_bytes)
        model = load_model(target, role="target")
        text = open_text_corpus(str(corpus))
        docs = list(tokenize(text, model.tokenizer, total=len(text), progress=False))
        tok = tokenizer_meta(model.tokenizer, model.vocab_size, sorted(model.eos_ids())[0], source=model.path)
        info = {"description": text.description, "corpus": str(corpus)}
        for kind in todo:
            if kind == "suffix":
                build_suffix_store(docs, stores[kind], tokenizer_info=tok, corpus=info,
                                   target_info={"path": model.path})
            else:
                build_dense_store(model.model, docs, stores[kind], tokenizer_info=tok, corpus=info,
                                  target_info=target_meta(model.model, model.path))
    return {kind: str(out) for kind, out in stores.items()}


def method_options(args: dict, methods: list[str], target) -> tuple[dict, str | None]:
    """Per-label factory options as ``retrospec bench`` builds them (``cli.bench_cmd``) from ``args``
    (``{"target": name, "stores": {kind: dir}}``): the datastore of a retrieval method's kind, and the target's
    bundled LongSpec block for longspec labels."""
    from retrospec.bench.labels import parse_label
    from retrospec.drafters.longspec import load_block
    from retrospec.drafters.registry import SPECS
    from retrospec.models import paired_longspec

    options: dict[str, dict] = {}
    src = None
    for label in methods:
        spec = SPECS.get(parse_label(label).method)
        if spec is None:
            continue
        if spec.store and spec.store in args["stores"]:
            options.setdefault(label, {})["datastore"] = args["stores"][spec.store]
        if spec.draft == "block":
            src = src or str(paired_longspec(args["target"]))
            options.setdefault(label, {})["draft"] = load_block(src, target)
    return options, src


def runnable(methods, stores: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The methods whose store was built, and {method: why not} of the others."""
    why = {"dresd": None if "dense" in stores else "faiss is not installed (not carried: ~30 MB)",
           "rest": None if "suffix" in stores else "no suffix store"}
    skipped = {m: why[m] for m in methods if why.get(m)}
    return [m for m in methods if m not in skipped], skipped


def run_cell(res: common.StepResult, name: str, target, draft, prompts, methods, args, cfg_kw: dict) -> dict | None:
    """One harness run; on failure, each method again alone beside ar so one broken method keeps the others."""
    from retrospec.bench.harness import BenchConfig, run_bench

    def once(ms):
        options, src = method_options(args, ms, target)
        cfg = BenchConfig(methods=ms, method_options=options, longspec_draft=src, **cfg_kw)
        return run_bench(target, draft, prompts, cfg, progress=False)

    got = res.part(name, once, methods)
    if got is not None:
        return got
    for m in [m for m in methods if m != "ar"]:
        one = res.part(f"{name}/{m}", once, ["ar", m])
        if got is None:
            got = one
        elif one is not None:
            got["summary"] += [s for s in one["summary"] if s["method"] == m]
            got["runs"] += [r for r in one["runs"] if r["method"] == m]
    return got


def oracle_identity(res, target, draft, prompts, methods, args, max_new: int) -> dict:
    from retrospec.bench.harness import encode_prompts
    from retrospec.config import SamplingConfig
    from retrospec.decode import autoregressive_generate

    got = run_cell(res, "identity", target, draft, prompts, methods, args,
                   {"max_new_tokens": max_new, "warmup": False})
    if got is None:
        return {}
    encoded, eos = encode_prompts(target, prompts, False)
    oracle = [list(autoregressive_generate(target.model, ids, sampling=SamplingConfig(), max_new_tokens=max_new,
                                           eos_ids=eos)) for ids in encoded]
    out = {}
    for r in got["runs"]:
        out[r["method"]] = out.get(r["method"], True) and r["token_ids"] == oracle[r["prompt_index"]]
    return out


def pytest_part(dry_run: bool, seconds: float) -> dict:
    files = CUDA_TESTS[:1] if dry_run else CUDA_TESTS  # a dry run collects the CUDA file only (seconds)
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-k", "cuda or triton"]
    # at least 150 s: on an H200 these files took ~70 s, building the long zoo pair 36 s of it, and a
    # 65 s limit killed the run with no summary; on a CPU starved by other jobs collection alone took > 60 s
    limit = 600 if dry_run else max(seconds, 150)
    proc = subprocess.run(cmd + ["--collect-only"] * dry_run, capture_output=True, text=True, timeout=limit)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"returncode": proc.returncode, "summary": tail[0][:300], "collect_only": dry_run}


def run_tests(out: Path, dry_run: bool, budget_s: float, ref_dir: Path | None = None) -> int:
    from retrospec.tasks import preset
    from retrospec.models import load_model

    res, device = common.start("tests", dry_run, budget_s)
    stores = res.part("stores", build_stores, "zoo", common.stage_root(), 12_000 if dry_run else 1_000_000) or {}
    target = load_model("zoo", device=device)
    draft = load_model("zoo-draft", role="draft", device=device)
    methods, res.figures["skipped"] = runnable(METHODS, stores)
    res.figures["identity_fp32"] = oracle_identity(res, target, draft, preset("heldout", 1 if dry_run else 4), methods,
                                                   {"target": "zoo", "stores": stores}, 6 if dry_run else 48)
    res.figures["pytest"] = res.part("pytest", pytest_part, dry_run, max(res.left() - 5, 10))
    return common.finish(res, out)


def prompt_sets(target, dry_run: bool, ref_dir: Path) -> dict[str, tuple[list[dict], bool]]:
    """{set: (prompts, chat)}: chat (the chat preset under the chat template), code (MBPP, else held-out stdlib
    functions), long (``lcc``: 4K-7K-token code files)."""
    from retrospec.tasks import lcc_prompts, load_prompts, preset

    n = 1 if dry_run else 3  # a 15-minute session: 3 prompts a set, so that the bf16 cells fit too
    sets = {}
    if getattr(target.tokenizer, "chat_template", None):
        sets["chat"] = (preset("chat", n), True)
    mbpp = ref_dir / "mbpp_sanitized.jsonl"
    sets["code"] = (load_prompts(mbpp)[:n] if mbpp.is_file() else preset("heldout", n), False)
    # a dry run: the same long-code rows, cut short (a 7K-token prefill per method is a minute on a small CPU)
    sets["long"] = (lcc_prompts(target.tokenizer, 1, lengths=(400,), tolerance=100) if dry_run
                    else preset("lcc", 3, tokenizer=target.tokenizer), False)
    return sets


def run_bench_step(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref")) -> int:
    from retrospec.bench.profile import run_profile
    from retrospec.models import load_model, paired_draft

    res, device = common.start("bench", dry_run, budget_s)
    name = "zoo" if dry_run else "smollm2-135m"
    max_new = 4 if dry_run else 128
    stores = res.part("stores", build_stores, name, common.stage_root(), 12_000 if dry_run else 2_000_000) or {}
    draft_name = str(paired_draft(name))
    methods, skipped = runnable(METHODS, stores)
    res.figures |= {"target": name, "draft": draft_name, "max_new_tokens": max_new, "skipped": skipped
                    | {"rapid": "needs the long-context harness and its embedder (not carried: ~90 MB)"},
                    "cells": {}}
    for dtype in (torch.float32, torch.bfloat16):
        target = res.part(f"load/{dtype}", load_model, name, dtype=dtype, device=device)
        draft = res.part(f"load-draft/{dtype}", load_model, draft_name, role="draft", dtype=dtype, device=device)
        if target is None:
            continue
        sets = res.part(f"prompts/{dtype}", prompt_sets, target, dry_run, ref_dir) or {}
        cell_methods = methods  # the block and the dense store accept a bf16 copy of their target (same_model)
        if dtype != torch.float32 and dry_run:  # the bf16 path once, in seconds
            sets = {k: v for k, v in sets.items() if k == "code"}
        if not draft:
            cell_methods = [m for m in cell_methods if m not in ("sd", "hf-assisted")]
        for set_name, (prompts, chat) in sets.items():
            cell = f"{set_name}/{common.dtype_name(dtype)}"
            if res.left() < (5 if dry_run else 45):
                res.notes.append(f"{cell}: skipped, out of budget")
                continue
            got = run_cell(res, cell, target, draft, prompts, cell_methods, {"target": name, "stores": stores},
                           {"max_new_tokens": max_new, "chat": chat, "warmup": not dry_run})
            if got is not None:  # "engine": what verified (on CUDA: hybrid tree + Triton from a measured length?)
                res.figures["cells"][cell] = {"prompts": len(prompts), "summary": [_row(s, got) for s in
                                                                                   got["summary"]],
                                              "engine": got.get("config", {}).get("engine")}
    if res.left() > (1 if dry_run else 40):
        kw = dict(contexts=(64,), tokens=(1, 2), reps=1, plain=False, trees=False) if dry_run else dict(
            contexts=(300, 2000), tokens=(1, 2, 4, 8, 16), reps=7)
        res.figures["profile"] = res.part("profile", run_profile, load_model(name, device=device),
                                          load_model(draft_name, role="draft", device=device), **kw)
    return common.finish(res, out)


def _row(s: dict, got: dict) -> dict:
    """A summary row plus tokens per target forward (root included), for the cost model's projections."""
    runs = [r for r in got["runs"] if r["method"] == s["method"]]
    calls = sum(r["stats"]["target_calls"] for r in runs)
    drafted = sum(r["stats"]["drafted_tokens"] for r in runs)
    keep = ("method", "tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate", "lossless", "new_tokens")
    return {k: s[k] for k in keep} | {"tokens_per_forward": 1 + drafted / calls if calls else 1.0}
