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

import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_build
from ..models.files import read_json
from ..stdlib_corpus import HELDOUT_PACKAGES, read_texts, stdlib_files, stdlib_root
from .common import set_threads, write_json
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

        return LlamaConfig(vocab_size=vocab_size, **asdict(self), max_position_embeddings=max_positions,
                           tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)


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
    set_threads(cfg.threads)
    with atomic_build(cfg.out, overwrite=True, required="zoo.json") as tmp:
        return _build_into(tmp, cfg, Path(cfg.out), log)


def _build_into(tmp: Path, cfg: ZooBuildConfig, out: Path, log) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    started = time.perf_counter()
    train_texts = read_texts(stdlib_files("train"))
    heldout_texts = read_texts(stdlib_files("heldout"))
    log(f"corpus: {len(train_texts)} training files, {len(heldout_texts)} held-out files from {stdlib_root()}")
    train_texts = [train_texts[i] for i in np.random.default_rng(cfg.seed).permutation(len(train_texts))]

    t0 = time.perf_counter()
    src = Path(cfg.reuse_target) if cfg.reuse_target is not None else None
    tokenizer = AutoTokenizer.from_pretrained(src / "target") if src else train_bpe(train_texts, cfg.vocab_size)
    train_stream = _encode_stream(tokenizer, train_texts)
    heldout_stream = _encode_stream(tokenizer, heldout_texts)
    log(f"tokenizer: vocab {len(tokenizer)}, {len(train_stream):,} training tokens, "
        f"{len(heldout_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)")
    vocab = len(tokenizer)
    results = {}
    if src:
        target = LlamaForCausalLM.from_pretrained(src / "target", dtype=torch.float32).eval()
        shutil.copytree(src / "target", tmp / "target")
        old = read_json(src / "zoo.json", f"corrupt zoo {src}") if (src / "zoo.json").exists() else {}
        results["target"] = {k: v for k, v in old.get("models", {}).get("target", {}).items()
                             if k in ("train", "heldout_loss")}
        log(f"target: reused from {src}")
    else:
        torch.manual_seed(cfg.seed)
        target = LlamaForCausalLM(TARGET_SPEC.config(vocab, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                     cfg.max_positions))
        tcfg = TrainConfig(tokens=cfg.target_tokens, seq_len=cfg.seq_len, batch_size=4, lr=1.5e-3, seed=cfg.seed)
        results["target"] = _train(target, train_stream, tcfg, heldout_stream, tokenizer, tmp / "target", log)
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
    results["draft"] = _train(draft, draft_data, dcfg, heldout_stream, tokenizer, tmp / "draft", log, teacher=target)

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
    write_json(tmp / "zoo.json", manifest, indent=2)
    return manifest


def _train(model, data, tcfg: TrainConfig, heldout: np.ndarray, tokenizer, path: Path, log, teacher=None) -> dict:
    """``train_lm``, the held-out loss, the model saved at ``path``; the manifest's entry."""
    res = train_lm(model, data, tcfg, teacher=teacher, desc=path.name + (" (distil)" if teacher is not None else ""))
    out = {"train": asdict(res) | {"losses": None}, "heldout_loss": eval_loss(model, heldout)}
    _save_model(model, tokenizer, path)
    log(f"{path.name}: {res.tokens:,} tokens in {res.seconds:.0f}s, held-out loss {out['heldout_loss']:.3f}")
    return out
