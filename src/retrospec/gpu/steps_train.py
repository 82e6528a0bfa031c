"""Step ``train``: a corpus of the target's own outputs on CUDA, the LongSpec block retrained on it, int8 back.

1. Corpus (``generations.CorpusBuilder``, what ``retrospec corpus generate`` runs, with the target loaded on
   CUDA in bfloat16): sources MBPP (rows 100+), NQ-open train questions (both carried in ``.gpu/ref``), stdlib
   openings and self-instruct; greedy and T = 0.7. ``corpus generate`` has no time limit, so the builder is
   grown here in whole shards (rows in multiples of ``shard_size / len(temperatures)``, which keeps every built
   shard valid: the corpus resumes) until ``corpus_share`` of the budget is spent.
2. LongSpec (``train.longspec_distill.distill_longspec``, what ``retrospec train longspec-distill`` runs) on the
   corpus for the rest of the budget, less the evaluation's share: KL distillation of the target's distribution
   over a 16K-token draft vocabulary, starting from the bundled block, with the held-out agreement learning curve.
3. Evaluation: the new block against the bundled one, method ``longspec`` on MBPP rows (tau, acceptance rate).
4. Back: the block re-saved with ``storage="int8"`` (``models.quant``) into ``$OUT/block-int8/`` (<= 16 MiB a
   file, 4 files: weights, ids, meta, manifest), plus ``train.json``.

Gaps (recorded in the JSON): ``retrospec zoo real-draft`` (the SD draft) cannot run on CUDA here —
``train.real_draft.build_real_draft`` loads the target with ``load_model(cfg.target)`` on the CPU and takes no
``device`` — and it does not read a corpus directory; the 20M-token goal needs ~10x this step's budget.
Dry run: the zoo target on the CPU, a few stdlib rows, 8 tokens, 2 optimizer steps.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from . import common


def grow_corpus(target, sources: str, out: Path, seconds: float, cfg_kw: dict, log=print) -> dict:
    """Build the corpus in whole shards until ``seconds`` pass (estimated from the first shard's pace)."""
    from ..generations import CorpusBuilder, CorpusConfig, load_rows, parse_sources

    cfg = CorpusConfig(sources=sources, **cfg_kw)
    rows = load_rows(parse_sources(sources))
    step = max(1, cfg.shard_size // len(cfg.temperatures))
    n, t0 = step, time.monotonic()
    while True:
        manifest = CorpusBuilder(target, rows[:n], out, cfg).build(progress=False)
        spent = time.monotonic() - t0
        log(f"corpus: {len(manifest['shards'])} shards, {manifest['output_tokens']:,} tokens, {spent:.0f} s")
        more = int((seconds - spent) // max(spent / max(1, len(manifest["shards"])), 1e-3))
        if n >= len(rows) or more < 1:
            break
        n = min(len(rows), n + step * min(more, len(manifest["shards"])))  # at most doubling: a slow shard shows
    return manifest


def corpus_text(corpus: Path, tokenizer, out: Path) -> int:
    """Write ``{"text": prompt + reply}`` per record (``train longspec --corpus FILE.jsonl``); returns records."""
    from ..generations import read_corpus

    n = 0
    with out.open("w") as f:
        for r in read_corpus(corpus):
            f.write(json.dumps({"text": r["prompt"] + tokenizer.decode(r["output_ids"], skip_special_tokens=True)})
                    + "\n")
            n += 1
    return n


def evaluate_block(res, name: str, blocks: dict[str, str], prompts: list[dict], device, max_new: int) -> dict:
    from ..bench.harness import BenchConfig, run_bench
    from ..drafters.longspec import load_block
    from ..models import load_model

    target = load_model(name, device=device)
    out = {}
    for label, src in blocks.items():
        block = res.part(f"eval/{label}/load", load_block, src, target)
        if block is None:
            continue
        cfg = BenchConfig(methods=["ar", "longspec"], max_new_tokens=max_new, warmup=False,
                          method_options={"longspec": {"block": block}}, longspec_draft=src)
        got = res.part(f"eval/{label}", run_bench, target, None, prompts, cfg, progress=False)
        if got is not None:
            s = next(s for s in got["summary"] if s["method"] == "longspec")
            out[label] = {k: s[k] for k in ("mean_accepted_tokens", "acceptance_rate", "speedup", "lossless")}
    return out


def run_train(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref"),
              corpus_share: float = 0.45) -> int:
    from ..bench.tasks import load_prompts, preset
    from ..drafters.longspec import load_block
    from ..models import load_model, paired_longspec
    from ..models.longspec.checkpoint import save_longspec
    from ..train.longspec_distill import DistillConfig, distill_longspec

    res, device, budget = common.start("train", dry_run)
    budget.seconds = budget_s
    name = "zoo" if dry_run else "smollm2-135m"
    work = Path(tempfile.mkdtemp(prefix="rs-gpu-train-"))
    mbpp, nq = ref_dir / "mbpp_sanitized.jsonl", ref_dir / "nq_open" / "questions.jsonl"
    if dry_run:
        sources, cfg_kw = "stdlib=8", dict(max_new_tokens=8, batch_size=4, shard_size=8, temperatures=(0.0, 0.7))
    else:
        parts = [f"mbpp={mbpp}"] * mbpp.is_file() + [f"nq={nq}"] * nq.is_file() + ["stdlib", "self-instruct=2000"]
        sources, cfg_kw = ",".join(parts), dict(max_new_tokens=256, batch_size=96, shard_size=192,
                                                 temperatures=(0.0, 0.7))
    gen_dtype = torch.float32 if dry_run else torch.bfloat16
    target = load_model(name, dtype=gen_dtype, device=device)
    corpus = work / "corpus"
    manifest = res.part("corpus", grow_corpus, target, sources, corpus, budget.seconds * corpus_share, cfg_kw)
    if manifest is not None:
        res.figures["corpus"] = {k: manifest.get(k) for k in ("output_tokens", "prompt_tokens", "seconds",
                                                              "by_source", "by_temperature", "complete")} | {
            "sources": sources, "dtype": str(gen_dtype).replace("torch.", ""), "shards": len(manifest["shards"]),
            "tokens_per_s": manifest["output_tokens"] / manifest["seconds"] if manifest["seconds"] else None}
    tokenizer = target.tokenizer
    del target
    text = work / "corpus.jsonl"
    records = res.part("corpus_text", corpus_text, corpus, tokenizer, text) if manifest else None
    block_dir = work / "block"
    eval_s = 4 if dry_run else 45
    train_s = budget.left() - eval_s - (1 if dry_run else 20)
    if records and train_s > (0 if dry_run else 30):
        bundled_init = paired_longspec(name)
        cfg = DistillConfig(target=name, corpus=str(corpus), out=str(block_dir),
                            init=None if bundled_init is None else str(bundled_init),
                            draft_vocab=64 if dry_run else 16384, max_len=64 if dry_run else 768,
                            batch_tokens=128 if dry_run else 16384, heldout=0.3 if dry_run else 0.04,
                            eval_records=4 if dry_run else 96, seconds=train_s, curve=(64,) if dry_run else
                            (250_000, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000),
                            max_positions=256 if dry_run else 8192, storage=None)
        trainee = load_model(name, device=device)  # float32: a block is bound to the float32 weights' identity
        m = res.part("longspec", distill_longspec, cfg, print, trainee)
        del trainee
        if m is not None:
            res.figures["longspec"] = {k: m.get(k) for k in ("steps", "tokens_seen", "seconds", "draft_vocab",
                                                             "heldout_coverage", "curve")} | {
                "corpus_records": records, "device": device.type}
    else:
        res.notes.append(f"longspec: not trained ({train_s:.0f} s left, {records} corpus records)")
    if (block_dir / "longspec.json").is_file():
        prompts = load_prompts(mbpp)[:3] if mbpp.is_file() and not dry_run else preset("heldout", 1)
        blocks = {"retrained": str(block_dir)}
        bundled = paired_longspec(name)
        if bundled is not None:
            blocks["bundled"] = str(bundled)
        res.figures["eval"] = evaluate_block(res, name, blocks, prompts, device, 4 if dry_run else 64)
        target = load_model(name, device=device)
        block = res.part("int8/load", load_block, str(block_dir), target)
        if block is not None:
            dest = out / "block-int8"
            shutil.rmtree(dest, ignore_errors=True)
            res.part("int8/save", save_longspec, block, target, dest, target_path=name, storage="int8")
            shutil.copyfile(block_dir / "manifest.json", dest / "manifest.json")
            res.figures["returned"] = {p.name: p.stat().st_size for p in sorted(dest.iterdir())}
    res.notes.append("zoo real-draft (the sd draft) is not retrained on CUDA: build_real_draft takes no device")
    return common.finish(res, out, budget)
