"""``retrospec zoo build``: train the bundled tiny model zoo on the standard library's source code.

Produces ordinary Hugging Face model directories (``config.json``, ``model.safetensors``, tokenizer files) under
``out/target`` and ``out/draft`` plus ``out/zoo.json`` describing how they were made (seed, token budgets,
wall-clock time, held-out packages and held-out loss). Weights are stored in float16 to keep the bundle small;
retrospec always loads them back as float32.

Steps: (1) byte-level BPE on the training split; (2) the Llama target, language modelling; (3) the draft,
distilled from the target's soft labels (acceptance = 1 - TV(p, q), so agreeing with p is the objective).

Invariant: the build is atomic (``atomic.atomic_build``): written next to ``out``, renamed into place at the end.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_build
from ..stdlib_corpus import HELDOUT_PACKAGES, read_texts, stdlib_files, stdlib_root
from .lm import TrainConfig, eval_loss, train_lm
from .tokenizer import train_bpe


@dataclass(frozen=True)
class LlamaSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    def config(self, vocab_size: int, eos_id: int, pad_id: int, max_positions: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )


TARGET_SPEC = LlamaSpec(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=704)
DRAFT_SPEC = LlamaSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=352)


@dataclass
class ZooBuildConfig:
    out: Path
    seed: int = 0
    vocab_size: int = 4096
    seq_len: int = 512
    max_positions: int = 4096
    target_tokens: int = 4_000_000
    draft_tokens: int = 2_500_000
    threads: int = 0  # 0 = torch default
    reuse_target: Path | None = None  # an existing zoo dir: keep its tokenizer + target, retrain only the draft
    self_distill_tokens: int = 0  # target-generated tokens mixed 50/50 into the draft's distillation data


def _encode_stream(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    return np.asarray(ids, dtype=dtype)


def _save_model(model, tokenizer, path: Path) -> None:
    model = model.to(torch.float16)
    model.config.dtype = "float16"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.to(torch.float32)


def build_zoo(cfg: ZooBuildConfig, log=print) -> dict:
    """Train tokenizer, target and draft; write them atomically to ``cfg.out`` (``atomic.atomic_build``: the old
    directory, if any, is replaced only when ``zoo.json`` is written). Returns the manifest."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with atomic_build(cfg.out, overwrite=True, required="zoo.json") as tmp:
        return _build_into(tmp, cfg, Path(cfg.out), log)


def _build_into(tmp: Path, cfg: ZooBuildConfig, out: Path, log) -> dict:
    from transformers import LlamaForCausalLM

    started = time.perf_counter()

    train_texts = read_texts(stdlib_files("train"))
    heldout_texts = read_texts(stdlib_files("heldout"))
    log(f"corpus: {len(train_texts)} training files, {len(heldout_texts)} held-out files from {stdlib_root()}")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(train_texts))
    train_texts = [train_texts[i] for i in order]

    t0 = time.perf_counter()
    if cfg.reuse_target is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(cfg.reuse_target) / "target")
    else:
        tokenizer = train_bpe(train_texts, vocab_size=cfg.vocab_size)
    train_stream = _encode_stream(tokenizer, train_texts)
    heldout_stream = _encode_stream(tokenizer, heldout_texts)
    log(f"tokenizer: vocab {len(tokenizer)}, {len(train_stream):,} training tokens, "
        f"{len(heldout_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)")

    vocab = len(tokenizer)
    results = {}
    if cfg.reuse_target is not None:
        src = Path(cfg.reuse_target)
        target = LlamaForCausalLM.from_pretrained(src / "target", dtype=torch.float32).eval()
        shutil.copytree(src / "target", tmp / "target")
        old = json.loads((src / "zoo.json").read_text()) if (src / "zoo.json").exists() else {}
        results["target"] = {k: v for k, v in old.get("models", {}).get("target", {}).items()
                             if k in ("train", "heldout_loss")}
        log(f"target: reused from {src}")
    else:
        torch.manual_seed(cfg.seed)
        target = LlamaForCausalLM(TARGET_SPEC.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                     cfg.max_positions))
        tcfg = TrainConfig(tokens=cfg.target_tokens, seq_len=cfg.seq_len, batch_size=4, lr=1.5e-3, seed=cfg.seed)
        res = train_lm(target, train_stream, tcfg, desc="target")
        results["target"] = {"train": asdict(res) | {"losses": None},
                             "heldout_loss": eval_loss(target, heldout_stream)}
        _save_model(target, tokenizer, tmp / "target")
        log(f"target: {res.tokens:,} tokens in {res.seconds:.0f}s, "
            f"held-out loss {results['target']['heldout_loss']:.3f}")

    torch.manual_seed(cfg.seed + 1)
    draft = LlamaForCausalLM(DRAFT_SPEC.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                               cfg.max_positions))
    dcfg = TrainConfig(tokens=cfg.draft_tokens, seq_len=cfg.seq_len, batch_size=8, lr=3e-3, seed=cfg.seed + 1)
    draft_data = train_stream
    if cfg.self_distill_tokens > 0:
        from .selfgen import generate_stream

        t0 = time.perf_counter()
        gen_stream = generate_stream(target, train_stream, cfg.self_distill_tokens, eos_id=tokenizer.eos_token_id,
                                     pad_id=tokenizer.pad_token_id, seed=cfg.seed + 2)
        results["self_generation"] = {"tokens": int(len(gen_stream)), "seconds": time.perf_counter() - t0}
        draft_data = [(train_stream, 0.5), (gen_stream, 0.5)]
        log(f"self-generation: {len(gen_stream):,} target tokens in {time.perf_counter() - t0:.0f}s")
    res = train_lm(draft, draft_data, dcfg, teacher=target, desc="draft (distil)")
    results["draft"] = {"train": asdict(res) | {"losses": None}, "heldout_loss": eval_loss(draft, heldout_stream)}
    _save_model(draft, tokenizer, tmp / "draft")
    log(f"draft: {res.tokens:,} tokens in {res.seconds:.0f}s, held-out loss {results['draft']['heldout_loss']:.3f}")

    manifest = {
        "command": f"retrospec zoo build --out {out} --seed {cfg.seed} --target-tokens {cfg.target_tokens} "
                   f"--draft-tokens {cfg.draft_tokens} --self-distill-tokens {cfg.self_distill_tokens}"
                   + (f" --reuse-target {cfg.reuse_target}" if cfg.reuse_target else ""),
        "seed": cfg.seed,
        "corpus": f"Python {platform.python_version()} standard library (.py, tests excluded)",
        "heldout_packages": list(HELDOUT_PACKAGES),
        "vocab_size": vocab,
        "train_tokens_in_corpus": int(len(train_stream)),
        "models": {
            "target": {"spec": asdict(TARGET_SPEC), "params": sum(p.numel() for p in target.parameters())}
            | results["target"],
            "draft": {"spec": asdict(DRAFT_SPEC), "params": sum(p.numel() for p in draft.parameters()),
                      "distilled_from": "target"} | results["draft"],
        },
        "self_generation": results.get("self_generation"),
        "build_seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    (tmp / "zoo.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:  # `python -m retrospec.train.zoo`
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-tokens", type=int, default=ZooBuildConfig.target_tokens)
    ap.add_argument("--draft-tokens", type=int, default=ZooBuildConfig.draft_tokens)
    ap.add_argument("--reuse-target", type=Path, default=None)
    ap.add_argument("--self-distill-tokens", type=int, default=0)
    args = ap.parse_args(argv)
    build_zoo(ZooBuildConfig(out=args.out, seed=args.seed, target_tokens=args.target_tokens,
                             draft_tokens=args.draft_tokens, reuse_target=args.reuse_target,
                             self_distill_tokens=args.self_distill_tokens))


if __name__ == "__main__":
    main()
