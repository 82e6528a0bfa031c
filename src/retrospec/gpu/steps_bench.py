"""Steps ``tests`` and ``bench``: greedy identity with the oracle on CUDA, and the CUDA bench with the profile.

Both call the bench harness (``bench.harness.run_bench``) on models loaded with ``load_model(..., device=...)``:
``retrospec bench`` itself loads on the CPU (it has no ``--device``), so the options it derives (rest/dresd stores,
longspec's block, magicdec's window) are derived here through the same functions from a namespace parsed by the
real ``retrospec bench`` parser, and the harness runs unchanged.

``tests`` (zoo pair, float32): per method, the greedy tokens of every prompt equal the oracle's
(``decode.autoregressive_generate``) token for token; plus pytest over the CUDA-relevant tests (``-k "cuda or
triton"``: the ``test_cuda_*`` tests skip without a GPU) — a dry run only collects them.

``bench`` (``smollm2-135m`` with its bundled draft and LongSpec block; a dry run: the zoo pair, 1 prompt, 4
tokens): methods x prompt sets (chat, code = MBPP, long code = ``lcc``) x dtypes (float32 first, where lossless
is checked; then bfloat16), each cell while the budget lasts; then ``bench.profile.run_profile`` on CUDA.
Gaps (recorded in the JSON): dresd needs faiss and rapid needs the sentence-transformers embedder and the
long-context harness; neither travels (see ``prepare.WHEELS``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from . import common

CUDA_TESTS = ("tests/test_cuda.py", "tests/test_hybrid_tree_attention.py", "tests/test_rapid_zoo_long.py")
# load_block and open_store check a fingerprint of the target's weights taken in float32: a bfloat16 copy is refused
FP32_ONLY = {"longspec": "the block's target fingerprint is of the float32 weights (load_block refuses bf16)",
             "dresd": "the dense store's target fingerprint is of the float32 weights (open_store refuses bf16)"}
METHODS = ("ar", "sd", "pld", "magicdec", "longspec", "rest", "dresd", "hf-assisted", "hf-pld")


def have(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # ImportError, or a broken wheel
        return False
    return True


def store_corpus(path: Path, max_bytes: int) -> Path:
    """A text corpus of stdlib training-split files, about ``max_bytes`` long (tokenizing all of the stdlib takes
    half a minute on a small CPU; the stores only need to be real, not large)."""
    from ..stdlib_corpus import stdlib_files

    parts, size = [], 0
    for f in stdlib_files("train"):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    path.write_text("\n\n".join(parts), encoding="utf-8")
    return path


def build_stores(target: str, work: Path, max_bytes: int) -> dict[str, str]:
    """Retrieval stores for rest (suffix) and dresd (dense, only with faiss), built as ``retrospec datastore build
    --corpus`` builds them, from ``store_corpus``; returns {kind: dir}."""
    from ..models import load_model
    from ..retrieval import build_dense_store, build_suffix_store
    from ..retrieval.corpus import open_text_corpus, tokenize
    from ..retrieval.store import target_meta, tokenizer_meta

    work = work / f"stores-{Path(target).name}-{max_bytes}"  # built once per target and size, reused
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "store-corpus.txt"
    stores = {}
    kinds = ["suffix"] + (["dense"] if have("faiss") else [])
    model = None
    for kind in kinds:
        out = work / f"store-{kind}"
        if not (out / "meta.json").is_file():
            if not corpus.is_file():
                store_corpus(corpus, max_bytes)
            model = model or load_model(target, role="target")
            text = open_text_corpus(str(corpus))
            docs = tokenize(text, model.tokenizer, total=len(text), progress=False)
            eos = sorted(model.eos_ids())[0]
            tok = tokenizer_meta(model.tokenizer, model.vocab_size, eos, source=model.path)
            info = {"description": text.description, "corpus": str(corpus)}
            if kind == "suffix":
                build_suffix_store(docs, out, tokenizer_info=tok, corpus=info, target_info={"path": model.path})
            else:
                build_dense_store(model.model, docs, out, tokenizer_info=tok, corpus=info,
                                  target_info=target_meta(model.model, model.path))
        stores[kind] = str(out)
    return stores


def bench_args(target: str, stores: dict[str, str], methods: list[str], extra: list[str] = ()) -> dict:
    """What the bench's method options are built from: the target, the stores by kind (``extra`` unused)."""
    return {"target": target, "stores": dict(stores)}


def method_options(args: dict, methods: list[str], target) -> tuple[dict, str | None]:
    """Per-label factory options as ``retrospec bench`` builds them (``cli.bench_cmd``): the datastore of a
    retrieval method's kind, and the target's bundled LongSpec block for longspec labels."""
    from ..bench.labels import parse_label
    from ..drafters.longspec import load_block
    from ..drafters.registry import SPECS
    from ..models import paired_longspec

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
            options.setdefault(label, {})["block"] = load_block(src, target)
    return options, src


def runnable(methods, stores: dict[str, str], has_draft: bool) -> tuple[list[str], dict[str, str]]:
    skipped = {}
    keep = []
    for m in methods:
        if m == "dresd" and "dense" not in stores:
            skipped[m] = "faiss is not installed (not carried: ~30 MB)"
        elif m == "rest" and "suffix" not in stores:
            skipped[m] = "no suffix store"
        elif m in ("sd", "hf-assisted") and not has_draft:
            skipped[m] = "no draft"
        else:
            keep.append(m)
    return keep, skipped


def run_cell(res: common.StepResult, name: str, target, draft, prompts, methods, args, cfg_kw: dict) -> dict | None:
    """One harness run; on failure, each method again alone beside ar so one broken method keeps the others."""
    from ..bench.harness import BenchConfig, run_bench

    def once(ms):
        options, src = method_options(args, ms, target)
        cfg = BenchConfig(methods=ms, method_options=options, longspec_draft=src, **cfg_kw)
        return run_bench(target, draft, prompts, cfg, progress=False)

    got = res.part(name, once, methods)
    if got is not None:
        return got
    merged = None
    for m in methods:
        if m == "ar":
            continue
        one = res.part(f"{name}/{m}", once, ["ar", m])
        if one is None:
            continue
        if merged is None:
            merged = one
        else:
            merged["summary"] += [s for s in one["summary"] if s["method"] == m]
            merged["runs"] += [r for r in one["runs"] if r["method"] == m]
    return merged


def oracle_identity(res, target, draft, prompts, methods, args, max_new: int) -> dict:
    from ..bench.harness import encode_prompts
    from ..config import SamplingConfig
    from ..decode import autoregressive_generate

    got = run_cell(res, "identity", target, draft, prompts, methods, args,
                   {"max_new_tokens": max_new, "warmup": False})
    if got is None:
        return {}
    encoded, eos = encode_prompts(target, prompts, False)
    oracle = [list(autoregressive_generate(target.model, ids, sampling=SamplingConfig(), max_new_tokens=max_new,
                                           eos_ids=eos)) for ids in encoded]
    out = {}
    for r in got["runs"]:
        same = r["token_ids"] == oracle[r["prompt_index"]]
        out[r["method"]] = out.get(r["method"], True) and same
    return out


def pytest_part(dry_run: bool, out: Path, seconds: float) -> dict:
    files = CUDA_TESTS[:1] if dry_run else CUDA_TESTS  # a dry run collects the CUDA file only (seconds)
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-k", "cuda or triton"]
    if dry_run:
        cmd.append("--collect-only")
    limit = 600 if dry_run else max(seconds, 60)  # on a CPU starved by other jobs collection alone took > 60 s
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"returncode": proc.returncode, "summary": tail[0][:300], "collect_only": dry_run}


def run_tests(out: Path, dry_run: bool, budget_s: float) -> int:
    from ..bench.tasks import preset
    from ..models import load_model

    res, device, budget = common.start("tests", dry_run)
    budget.seconds = budget_s
    stores = res.part("stores", build_stores, "zoo", common.stage_root(), 12_000 if dry_run else 1_000_000) or {}
    target = load_model("zoo", device=device)
    draft = load_model("zoo-draft", role="draft", device=device)
    methods, skipped = runnable(METHODS, stores, True)
    res.figures["skipped"] = skipped
    args = bench_args("zoo", stores, methods)
    prompts = preset("heldout", 1 if dry_run else 4)
    res.figures["identity_fp32"] = oracle_identity(res, target, draft, prompts, methods, args, 6 if dry_run else 48)
    res.figures["pytest"] = res.part("pytest", pytest_part, dry_run, out, max(budget.left() - 5, 10))
    return common.finish(res, out, budget)


def prompt_sets(target, dry_run: bool, ref_dir: Path) -> dict[str, tuple[list[dict], bool]]:
    """{set: (prompts, chat)}: chat (the chat preset under the chat template), code (MBPP, else held-out stdlib
    functions), long (``lcc``: 4K-7K-token code files)."""
    from ..bench.tasks import lcc_prompts, load_prompts, preset

    n = 1 if dry_run else 5
    sets = {}
    if getattr(target.tokenizer, "chat_template", None):
        sets["chat"] = (preset("chat", n), True)
    mbpp = ref_dir / "mbpp_sanitized.jsonl"
    sets["code"] = (load_prompts(mbpp)[:n] if mbpp.is_file() else preset("heldout", n), False)
    if dry_run:  # the same long-code rows, cut short: a 7K-token prefill per method is a minute on a small CPU
        sets["long"] = (lcc_prompts(target.tokenizer, 1, lengths=(400,), tolerance=100), False)
    else:
        sets["long"] = (preset("lcc", 3, tokenizer=target.tokenizer), False)
    return sets


def run_bench_step(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref")) -> int:
    from ..bench.profile import run_profile
    from ..models import load_model, paired_draft

    res, device, budget = common.start("bench", dry_run)
    budget.seconds = budget_s
    name = "zoo" if dry_run else "smollm2-135m"
    max_new = 4 if dry_run else 128
    stores = res.part("stores", build_stores, name, common.stage_root(), 12_000 if dry_run else 2_000_000) or {}
    draft_name = str(paired_draft(name))
    methods, skipped = runnable(METHODS, stores, True)
    res.figures |= {"target": name, "draft": draft_name, "max_new_tokens": max_new, "skipped": skipped
                    | {"rapid": "needs the long-context harness and its embedder (not carried: ~90 MB)"},
                    "cells": {}}
    args = bench_args(name, stores, methods)
    for dtype in (torch.float32, torch.bfloat16):
        target = res.part(f"load/{dtype}", load_model, name, dtype=dtype, device=device)
        draft = res.part(f"load-draft/{dtype}", load_model, draft_name, role="draft", dtype=dtype, device=device)
        if target is None:
            continue
        sets = res.part(f"prompts/{dtype}", prompt_sets, target, dry_run, ref_dir) or {}
        cell_methods = methods
        if dtype != torch.float32:  # a bf16 target's fingerprint differs from the fp32 one the block/store carry
            cell_methods = [m for m in methods if m not in FP32_ONLY]
            res.figures["skipped"] |= {f"{m}@bfloat16": FP32_ONLY[m] for m in methods if m in FP32_ONLY}
        if dry_run and dtype != torch.float32:
            sets = {k: v for k, v in sets.items() if k == "code"}  # the bf16 path once, in seconds
        for set_name, (prompts, chat) in sets.items():
            cell = f"{set_name}/{str(dtype).replace('torch.', '')}"
            if budget.left() < (5 if dry_run else 45):
                res.notes.append(f"{cell}: skipped, out of budget")
                continue
            got = run_cell(res, cell, target, draft, prompts,
                           cell_methods if draft else runnable(cell_methods, stores, False)[0],
                           args, {"max_new_tokens": max_new, "chat": chat, "warmup": not dry_run})
            if got is not None:
                res.figures["cells"][cell] = {"prompts": len(prompts), "summary": [_row(s, got) for s in
                                                                                   got["summary"]]}
    if budget.left() > (1 if dry_run else 40):
        target = load_model(name, device=device)
        draft = load_model(draft_name, role="draft", device=device)
        kw = dict(contexts=(64,), tokens=(1, 2), reps=1, plain=False, trees=False) if dry_run else dict(
            contexts=(300, 2000), tokens=(1, 2, 4, 8, 16), reps=7)
        res.figures["profile"] = res.part("profile", run_profile, target, draft, **kw)
        res.notes.append("profile: bench.profile times with a host clock and no CUDA synchronize, and measures host "
                         "memory bandwidth; CUDA figures are indicative (see docs/gpu.md)")
    return common.finish(res, out, budget)


def _row(s: dict, got: dict) -> dict:
    """A summary row plus tokens per target forward (root included), for the cost model's projections."""
    runs = [r for r in got["runs"] if r["method"] == s["method"]]
    calls = sum(r["stats"]["target_calls"] for r in runs)
    drafted = sum(r["stats"]["drafted_tokens"] for r in runs)
    keep = ("method", "tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate", "lossless", "new_tokens")
    return {k: s[k] for k in keep} | {"tokens_per_forward": 1 + drafted / calls if calls else 1.0}
