"""``retrospec train rag-drafter``: tune a Speculative RAG drafter (a LoRA adapter on a base model).
``retrospec train longspec``: train a LongSpec draft block for a target; ``retrospec train longspec-eval``: its loss
per position bucket on long held-out documents, and the target's loss under anchor-offset positions;
``retrospec train longspec-pack``: re-save a block with another weight storage (int8: ~1/4 of float32, lossy);
``retrospec train longspec-distill`` / ``draft-distill``: distil the LongSpec block / a small draft LM on a corpus of
the target's own outputs; under ``torchrun`` / ``accelerate launch`` they train data-parallel
(``train.distributed``), with ``--fsdp`` the frozen target sharded over the processes (``train.fsdp``).

Training of the other models lives under ``retrospec zoo`` (the zoo pair, ``real-draft``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..errors import RetrospecError

TARGET_HELP = "target model directory or name (e.g. {})"


def config_from(cls, args, **over):
    """``cls`` (a config dataclass) from the parsed flags named like its fields, then ``over``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names} | over)


def _layers(text: str) -> tuple[int, ...] | str:
    """``--features 2,15,27`` -> (2, 15, 27); ``auto`` stays (``feature_layers_for`` the target)."""
    if text == "auto":
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated layer indices, e.g. 2,15,27; got {text!r}") from None


def add_common(p, budget: bool = False, seed: bool = True) -> None:
    """``--steps``/``--seconds`` (exactly one), ``--seed``, ``--threads``."""
    if budget:
        group = p.add_mutually_exclusive_group(required=True)
        group.add_argument("--steps", type=int, help="optimizer steps")
        group.add_argument("--seconds", type=float, help="train for this long (wall clock)")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train models: rag-drafter (Speculative RAG's drafter, a LoRA adapter), "
                                     "longspec (a LongSpec draft block), longspec-eval, longspec-pack, "
                                     "longspec-distill, draft-distill")
    tsub = p.add_subparsers(dest="train_command", required=True, parser_class=type(p))
    r = tsub.add_parser("rag-drafter", help="instruction-tune a Speculative RAG drafter on extractive rationales")
    r.add_argument("--base", default="smollm2-135m", help="base model directory or name (default smollm2-135m)")
    r.add_argument("--questions", required=True, help="questions.jsonl (id, question, answers, gold_passage); "
                                                      "only its train split is used")
    r.add_argument("--passages", required=True, help="passages.jsonl (id, title, text)")
    r.add_argument("--out", required=True, help="adapter directory to create")
    r.add_argument("--limit", type=int, default=None, help="use at most N training examples")
    r.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--accum", type=int, default=4, help="examples per optimizer step (default 4)")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="autocast dtype of the frozen base on the CPU (default bfloat16)")
    r.add_argument("--embedder", help="sentence-transformers directory for hard negatives (default: bundled MiniLM)")
    add_common(r, budget=True)
    r.set_defaults(func=run_rag_drafter)

    ls = tsub.add_parser("longspec", help="train a LongSpec draft block (one block reading the target's KV cache)")
    ls.add_argument("--target", required=True, help=TARGET_HELP.format("zoo"))
    ls.add_argument("--out", required=True, help="block directory to create")
    ls.add_argument("--corpus", default=None, help="a text file, a directory of text files or a .jsonl file "
                                                   "('text' per line); default: the stdlib training split")
    ls.add_argument("--seq-len", type=int, default=1024, help="training window in tokens (default 1024)")
    ls.add_argument("--batch", type=int, default=1, help="windows per step (default 1)")
    ls.add_argument("--anchor-offset", choices=("on", "off"), default="on",
                    help="anchor-offset positions: keep 0-4 anchor tokens, shift the rest randomly (default on)")
    ls.add_argument("--noisy-max", type=int, default=4,
                    help="flash-noisy training: per step a shift in [1, N] of the target KV (default 4; 1 = off)")
    ls.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ls.add_argument("--window", type=int, default=512, help="the block's sliding self-attention window (default 512)")
    ls.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    ls.add_argument("--init", choices=("identity", "random"), default="identity",
                    help="block initialisation (default identity: the block starts as lm_head(embed(ids)))")
    ls.add_argument("--intermediate-size", type=int, default=None,
                    help="the block's MLP width (default the target's; narrower = a smaller block)")
    add_common(ls, budget=True)
    ls.set_defaults(func=run_longspec)

    ev = tsub.add_parser("longspec-eval", help="LongSpec blocks' loss per position bucket on long held-out documents")
    ev.add_argument("--target", required=True, help=TARGET_HELP.format("zoo"))
    ev.add_argument("--draft", action="append", required=True, help="block directory or name (repeatable)")
    ev.add_argument("--seq-len", type=int, default=8192, help="document length in tokens (default 8192)")
    ev.add_argument("--docs", type=int, default=4, help="documents (default 4)")
    ev.add_argument("--bucket", type=int, default=1024, help="positions per bucket (default 1024)")
    ev.add_argument("--corpus", default=None, help="documents from this corpus instead of the held-out stdlib "
                                                   "packages")
    ev.add_argument("--anchor", action="store_true", help="evaluate at anchor-offset positions")
    ev.add_argument("--no-target-check", action="store_true",
                    help="skip the target's loss with normal vs anchor-offset positions")
    ev.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_common(ev)
    ev.add_argument("--out", help="write the results as JSON to this file")
    ev.set_defaults(func=run_longspec_eval)

    ds = _add_distill(tsub, "longspec-distill", "a LongSpec block", "block directory to create", 0.04, None,
                      "drafting over a frequency-ranked vocabulary (FR-Spec)", "corpus output tokens",
                      lr_help="1e-3; 1e-4 from a trained --init block without --features; --resume: the resumed "
                              "run's")
    ds.add_argument("--init", default=None, help="block to start from (directory or bundled name, e.g. "
                                                 "smollm2-135m-longspec); default a fresh identity block")
    ds.add_argument("--draft-vocab", type=int, default=16384,
                    help="draft over the K output tokens the target emits most (default 16384; 0 = full head)")
    ds.add_argument("--follow", action="store_true", help="keep training on the shards a running 'corpus generate' "
                                                          "adds, until --seconds")
    ds.add_argument("--features", type=_layers, default=None, metavar="I,J,K|auto",
                    help="the block also reads the target's outputs of these decoder layers, fused (EAGLE-3-style; "
                         "auto: low, middle and high, 2,15,27 on a 30-layer target); added to --init's block, which "
                         "starts out computing what it did")
    ds.add_argument("--ttt", type=int, default=1, metavar="N",
                    help="with features: N passes of training-time test, pass d reading the block's own output of "
                         "pass d - 1 as drafting does below a drafted token (default 1: the target's feature only)")
    ds.add_argument("--storage", choices=("int8", "float16", "float32"), default="int8")
    ds.set_defaults(func=run_longspec_distill)

    dd = _add_distill(tsub, "draft-distill", "a small draft LM (sd's draft)", "draft directory to create", 0.06,
                      "3e-4", "re-choosing its vocabulary from what the target writes", "tokens trained")
    dd.add_argument("--init", default=None, help="draft to start from (directory or name, e.g. smollm2-135m-draft); "
                                                 "required unless --resume")
    dd.add_argument("--vocab", type=int, default=12288, help="draft vocabulary: the K tokens the target emits most "
                                                            "(default 12288)")
    dd.set_defaults(func=run_draft_distill)

    pk = tsub.add_parser("longspec-pack", help="re-save a LongSpec block with another weight storage (int8: about "
                                               "1/4 of float32, lossy; the drafter stays lossless)")
    pk.add_argument("src", help="block directory to read")
    pk.add_argument("--target", required=True, help="the block's " + TARGET_HELP.format("zoo"))
    pk.add_argument("--out", required=True, help="block directory to create")
    pk.add_argument("--storage", required=True, choices=("int8", "float16", "bfloat16", "float32"),
                    help="int8: symmetric, one absmax scale per output row (lossy); or a float dtype")
    pk.set_defaults(func=run_longspec_pack)


def _add_distill(tsub, name: str, what: str, out: str, heldout: float, lr: str | None, how: str, counted: str,
                 lr_help: str | None = None):
    """A distiller's parser with the flags both distillers share (``lr`` None: the trainer chooses, ``lr_help``
    says how)."""
    p = tsub.add_parser(name, help=f"distil {what} on a corpus of the target's own outputs ('retrospec corpus "
                                   f"generate'), {how}")
    p.add_argument("--target", required=True, help=TARGET_HELP.format("smollm2-135m"))
    p.add_argument("--corpus", required=True, help="corpus directory written by 'retrospec corpus generate', or "
                                                    "several, comma-separated (read in that order)")
    p.add_argument("--out", required=True, help=out)
    p.add_argument("--max-len", type=int, default=768, help="tokens per training sequence (default 768)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch, padding included")
    p.add_argument("--max-tokens", type=int, default=None, help=f"stop after this many {counted}")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (wall clock)")
    p.add_argument("--heldout", type=float, default=heldout, help=f"share of prompts held out (default {heldout})")
    p.add_argument("--lr", type=float, default=None if lr is None else float(lr),
                   help=f"peak learning rate (default {lr_help or lr})")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="training forwards in float32 or under bfloat16 autocast; auto (default) times one batch "
                        "both ways here and keeps the faster")
    p.add_argument("--keep-vocab", action="store_true",
                   help="keep --init's draft vocabulary instead of re-choosing it from this corpus (for a corpus "
                        "still small, or followed from its first shard)")
    p.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine",
                   help="learning rate: cosine (default), or wsd: warm-up, stable, then decay over the last --decay; "
                        "writes resume.pt (the state before the decay) for --resume")
    p.add_argument("--decay", type=float, default=0.2, help="wsd: share of the run the rate decays over (default 0.2)")
    p.add_argument("--resume", default=None, help="go on from a --schedule wsd run's output directory (its resume.pt: "
                                                  "weights and optimiser state before the decay, its vocabulary), no "
                                                  "warm-up; instead of --init")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the target loads and the model trains (default cpu); cuda under torchrun / "
                        "accelerate launch: each process on cuda:LOCAL_RANK")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun / accelerate launch: shard the frozen target's decoder layers over the "
                        "processes (FSDP), each holding 1/N of them, for a target too big for one device; the model "
                        "being trained stays whole and data-parallel")
    add_common(p)
    return p


def run_rag_drafter(args) -> int:
    from ..train.common import set_threads
    from ..train.rag_drafter import RagDrafterConfig, train_rag_drafter

    for name in ("questions", "passages"):
        if not Path(getattr(args, name)).is_file():
            raise RetrospecError(f"--{name} file not found: {getattr(args, name)}")
    for name in ("limit", "rank", "accum"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise RetrospecError(f"--{name} must be at least 1, got {value}")
    if args.lr <= 0:
        raise RetrospecError(f"--lr must be positive, got {args.lr}")
    set_threads(args.threads)
    train_rag_drafter(config_from(RagDrafterConfig, args, alpha=2 * args.rank))
    return 0


def run_longspec(args) -> int:
    from ..train.longspec import LongSpecTrainConfig, check_config, train_longspec

    cfg = config_from(LongSpecTrainConfig, args, anchor_offset=args.anchor_offset == "on")
    return _run(cfg, check_config, train_longspec, args.threads)


def run_longspec_distill(args) -> int:
    from ..train.longspec_distill import DistillConfig, check_config, describe_curve, distill_longspec

    return _run(config_from(DistillConfig, args), check_config, distill_longspec, args.threads, describe_curve)


def run_draft_distill(args) -> int:
    from ..train.draft_distill import DraftDistillConfig, check_config, describe_curve, distill_draft

    return _run(config_from(DraftDistillConfig, args), check_config, distill_draft, args.threads, describe_curve)


def _run(cfg, check, train, threads: int, describe=None) -> int:
    """Check a trainer's config (user errors before any loading), run it with progress lines, print its curve (under
    several processes: rank 0 prints)."""
    from ..train.common import set_threads
    from ..train.distributed import env

    check(cfg)
    set_threads(threads)
    manifest = train(cfg, log=lambda msg: print(msg, flush=True))
    if describe is not None and env().main:
        print(describe(manifest))
    return 0


def run_longspec_eval(args) -> int:
    import json

    from ..train.common import set_threads
    from ..train.longspec import evaluate_drafts, format_buckets

    set_threads(args.threads)
    if args.out and Path(args.out).is_dir():
        raise RetrospecError(f"--out {args.out} is a directory; give a JSON file path")
    from ..models.named import longspec_dir

    drafts = [str(longspec_dir(d)) for d in args.draft]  # a block directory or a bundled block's name
    result = evaluate_drafts(args.target, drafts, docs=args.docs, seq_len=args.seq_len, bucket=args.bucket,
                             corpus=args.corpus, device=args.device, anchor=args.anchor, seed=args.seed,
                             check_target=not args.no_target_check)
    data = result["data"]
    print(f"target {args.target}; {data['documents_used']} documents of {data['seq_len']} tokens "
          f"({data['source']}); shift 1{'; anchor-offset positions' if args.anchor else ''}")
    for name, rows in result["drafts"].items():
        print(f"\ndraft {name}")
        print(format_buckets(rows))
    check = result.get("target_offset_check")
    if check:
        print(f"\ntarget loss: normal positions {check['normal']:.4f}, anchor-offset positions "
              f"{check['anchor_offset']:.4f} (delta {check['delta']:+.4f}; the paper reports +0.001)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def run_longspec_pack(args) -> int:
    from ..models.loading import load_model
    from ..models.longspec import read_meta, repack_longspec

    src, out = Path(args.src).expanduser(), Path(args.out).expanduser()
    read_meta(src)  # a missing or corrupt block fails before the target is loaded
    if out.exists():
        raise RetrospecError(f"{out} already exists; choose another --out")
    report = repack_longspec(src, load_model(args.target), out, args.storage)
    before, after = report["bytes_before"], report["bytes_after"]
    print(f"packed {src} ({report['storage_before'] or 'unrecorded storage'}) -> {out} ({args.storage})")
    print(f"block.safetensors: {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB ({after / before:.1%})")
    print(f"max abs weight error: {report['max_abs_error']:.3g}")
    return 0
