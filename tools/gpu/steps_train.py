"""Step ``train``: a corpus of the target's own outputs on CUDA, the LongSpec block retrained on it, int8 back.

The corpus (``corpus.CorpusBuilder``) grows in whole shards (rows in multiples of ``shard_size /
len(temperatures)``, which keeps every built shard valid) until ``corpus_share`` of the budget is spent; LongSpec
is distilled on it (``train.longspec_distill.distill_longspec``) for the rest, less the evaluation's share, in three
variants at equal tokens (``variant_configs``: the block as it is, + the target's fused layer features, +
training-time test); each is evaluated against the bundled one and the fastest re-saved as int8 into
``$OUT/block-int8.tar``. The corpus comes back packed (``corpus.pack``) in one tar cut into parts of at most ``PART_BYTES`` (``corpus.tar.000``, ...): ``cat``
them together and ``tar -x`` gives the pack, which ``retrospec.corpus.pack.unpack`` turns back into the corpus.
Gaps: tools/gpu/README.md. Dry run: the zoo target on the CPU, a few stdlib rows, 8 tokens, 2 optimizer steps.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch

from . import common

PART_BYTES = 15 * 2**20  # a file back from a device call is at most 16 MiB
MAX_PARTS = 4  # with train.json, train.log and block-int8.tar: 7 of the 8 files a call returns


def tar_parts(folder: Path, out: Path, stem: str, max_parts: int = MAX_PARTS) -> list[str]:
    """``folder`` as one uncompressed tar (its files are compressed already) in ``out/stem.000``, ``.001``, ...,
    each at most ``PART_BYTES``; refused (nothing written) past ``max_parts``."""
    import io
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(folder, arcname=folder.name)
    data = buf.getvalue()
    n = -(-len(data) // PART_BYTES)
    if n > max_parts:
        raise ValueError(f"{folder.name}: {len(data) / 2**20:.1f} MiB needs {n} parts > {max_parts}")
    names = []
    for k in range(n):
        names.append(f"{stem}.{k:03d}")
        (out / names[-1]).write_bytes(data[k * PART_BYTES:(k + 1) * PART_BYTES])
    return names


def grow_corpus(target, sources: str, out: Path, seconds: float, cfg_kw: dict, log=print) -> dict:
    """Build the corpus in whole shards until ``seconds`` pass (estimated from the first shard's pace)."""
    from retrospec.corpus import CorpusBuilder, CorpusConfig, load_rows, parse_sources

    cfg = CorpusConfig(sources=sources, **cfg_kw)
    rows = load_rows(parse_sources(sources))
    step = max(1, cfg.shard_size // len(cfg.temperatures))
    n, t0 = step, time.monotonic()
    while True:
        log(f"corpus: generating up to row {n:,} of {len(rows):,} ({cfg.batch_size} sequences a batch)")
        manifest = CorpusBuilder(target, rows[:n], out, cfg).build(progress=False)
        spent = time.monotonic() - t0
        log(f"corpus: {len(manifest['shards'])} shards, {manifest['output_tokens']:,} tokens, {spent:.0f} s")
        more = int((seconds - spent) // max(spent / max(1, len(manifest["shards"])), 1e-3))
        if n >= len(rows) or more < 1:
            break
        n = min(len(rows), n + step * min(more, len(manifest["shards"])))  # at most doubling: a slow shard shows
    return manifest


def evaluate_block(res, target, blocks: dict[str, str], prompts: list[dict], max_new: int) -> dict:
    from retrospec.bench.harness import BenchConfig, run_bench
    from retrospec.drafters.longspec import load_block

    out = {}
    for label, src in blocks.items():
        block = res.part(f"eval/{label}/load", load_block, src, target)
        if block is None:
            continue
        cfg = BenchConfig(methods=["ar", "longspec"], max_new_tokens=max_new, warmup=False,
                          method_options={"longspec": {"draft": block}}, longspec_draft=src)
        got = res.part(f"eval/{label}", run_bench, target, None, prompts, cfg, progress=False)
        if got is not None:
            s = next(s for s in got["summary"] if s["method"] == "longspec")
            out[label] = {k: s[k] for k in ("mean_accepted_tokens", "acceptance_rate", "speedup", "lossless")}
    return out


def variant_configs(cfg, work: Path, layers: tuple[int, ...], seconds: float) -> list[tuple[str, object]]:
    """The block variants trained at equal tokens (the first's, in its share of ``seconds``): today's block, + the
    target's fused layer features, + training-time test (3 passes). Each gets a share of the time as its cap."""
    share = seconds / 3
    return [(label, dataclasses.replace(cfg, out=str(work / f"block-{label}"), seconds=share, **kw))
            for label, kw in (("block", {}), ("features", {"features": layers}),
                              ("features-ttt", {"features": layers, "ttt": 3}))]


def run_train(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref"),
              corpus_share: float = 0.45) -> int:
    from retrospec.tasks import load_prompts, preset
    from retrospec.drafters.longspec import load_block
    from retrospec.corpus import read_corpus
    from retrospec.corpus.pack import pack
    from retrospec.models import load_model, paired_longspec
    from retrospec.models.longspec.block import feature_layers_for
    from retrospec.models.longspec.checkpoint import VOCAB_FILE, save_longspec
    from retrospec.train.longspec_distill import DistillConfig, distill_longspec

    res, device = common.start("train", dry_run, budget_s)
    timer = common.watchdog(res, out, budget_s + 20)  # the call's limit is the budget + ~70 s
    name = "zoo" if dry_run else "smollm2-135m"
    bundled = paired_longspec(name)
    work = Path(tempfile.mkdtemp(prefix="rs-gpu-train-"))
    mbpp, nq = ref_dir / "mbpp_sanitized.jsonl", ref_dir / "nq_open" / "questions.jsonl"
    parts = ([f"mbpp={mbpp}"] * mbpp.is_file() + [f"nq={nq}"] * nq.is_file()
             + ["stdlib", "self-instruct=16000", "tasks=16000"])
    sources = "stdlib=8" if dry_run else ",".join(parts)
    cfg_kw = dict(max_new_tokens=8, batch_size=4, shard_size=8) if dry_run else dict(
        max_new_tokens=256, batch_size=1024, shard_size=2048,  # launch-bound at 135M: rows are ~free
        max_prompt_tokens=512)  # a batch is padded to its longest prompt: its KV cache is read and copied per step
    gen_dtype = torch.float32 if dry_run else torch.bfloat16
    target = load_model(name, dtype=gen_dtype, device=device)
    corpus = work / "corpus"
    manifest = res.part("corpus", grow_corpus, target, sources, corpus, budget_s * corpus_share,
                        cfg_kw | {"temperatures": (0.0, 0.7)})
    if manifest is not None:
        res.figures["corpus"] = {k: manifest.get(k) for k in ("output_tokens", "prompt_tokens", "seconds",
                                                              "by_source", "by_temperature", "complete")} | {
            "sources": sources, "dtype": common.dtype_name(gen_dtype), "shards": len(manifest["shards"]),
            "tokens_per_s": manifest["output_tokens"] / manifest["seconds"] if manifest["seconds"] else None}
    del target
    records = res.part("corpus_records", lambda: len(read_corpus(corpus))) if manifest else None
    if records:
        packed = res.part("corpus_pack", pack, corpus, work / "corpus-pack", 1)
        if packed is not None:
            back = res.part("corpus_parts", tar_parts, work / "corpus-pack", out, "corpus.tar")
            res.figures["corpus_packed"] = {k: packed[k] for k in ("records", "tokens", "ids")} | {"parts": back}
    train_s = res.left() - (5 if dry_run else 45)  # the evaluation's share and a margin
    trained: dict[str, Path] = {}
    if records and train_s > (0 if dry_run else 30):
        cfg = DistillConfig(target=name, corpus=str(corpus), out="",
                            init=None if bundled is None else str(bundled),
                            # a bundled block's vocabulary was ranked on a larger corpus than one call writes
                            keep_vocab=bundled is not None and (Path(bundled) / VOCAB_FILE).is_file(),
                            draft_vocab=64 if dry_run else 16384, max_len=64 if dry_run else 768,
                            batch_tokens=128 if dry_run else 16384, heldout=0.3 if dry_run else 0.04,
                            # a trained block: the CPU passes went 5e-4 -> 2e-4 -> 1e-4 at 2,048-token batches
                            # (its CPU distillation runs); 3e-4 is 1e-4 scaled by sqrt(8) for 8x the batch
                            lr=3e-4,
                            eval_records=4 if dry_run else 96, curve=(64,) if dry_run else
                            (250_000, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000),
                            max_positions=256 if dry_run else 8192, storage=None)
        trainee = load_model(name, device=device)  # float32 weights, used in either precision
        layers = feature_layers_for(trainee.model.config.num_hidden_layers)
        variants = variant_configs(cfg, work, layers, train_s)
        torch.set_float32_matmul_precision("high")  # TF32 for training's matmuls only; restored before evaluating
        try:
            tokens = None  # the first variant's tokens: the budget of the others (equal tokens, not seconds)
            for label, vcfg in variants:
                if tokens is not None:
                    vcfg.max_tokens = tokens
                m = res.part(f"longspec/{label}", distill_longspec, vcfg, print, trainee)
                if m is None:
                    continue
                trained[label] = Path(vcfg.out)
                tokens = tokens or m["tokens_seen"]
                res.figures.setdefault("longspec", {})[label] = {
                    k: m.get(k) for k in ("steps", "tokens_seen", "seconds", "draft_vocab", "heldout_coverage",
                                          "curve")} | {
                    "features": list(vcfg.features or ()), "ttt": vcfg.ttt, "corpus_records": records,
                    "device": device.type,
                    "tokens_per_s": m["tokens_seen"] / m["seconds"] if m.get("seconds") else None}
        finally:
            torch.set_float32_matmul_precision("highest")
        del trainee
    else:
        res.notes.append(f"longspec: not trained ({train_s:.0f} s left, {records} corpus records)")
    if trained:
        prompts = load_prompts(mbpp)[:3] if mbpp.is_file() and not dry_run else preset("heldout", 1)
        blocks = {label: str(d) for label, d in trained.items()}
        if bundled is not None:
            blocks["bundled"] = str(bundled)
        target = load_model(name, device=device)
        res.figures["eval"] = evaluate_block(res, target, blocks, prompts, 4 if dry_run else 64)
        ranked = sorted(trained, key=lambda k: -(res.figures["eval"].get(k, {}).get("speedup") or 0))
        block_dir = trained[ranked[0]]  # the fastest variant comes back
        res.figures["returned_variant"] = ranked[0]
        block = res.part("int8/load", load_block, str(block_dir), target)
        if block is not None:
            dest = work / "block-int8"
            shutil.rmtree(dest, ignore_errors=True)
            res.part("int8/save", save_longspec, block, target, dest, target_path=name, storage="int8")
            if dest.is_dir():  # a failed save is in res already; the figures above still get written
                shutil.copyfile(block_dir / "manifest.json", dest / "manifest.json")
                res.figures["returned"] = {p.name: p.stat().st_size for p in sorted(dest.iterdir())}
                res.part("int8/tar", lambda: shutil.make_archive(str(out / "block-int8"), "tar", work, "block-int8"))
    res.notes.append("zoo real-draft (the sd draft) is not retrained on CUDA: build_real_draft takes no device")
    timer.cancel()
    return common.finish(res, out)
