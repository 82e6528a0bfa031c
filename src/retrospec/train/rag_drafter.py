"""Instruction-tuning a Speculative RAG drafter (Wang et al., ICLR 2025, §3.2) as a LoRA adapter
(``retrospec train rag-drafter``).

The paper tunes its drafter on (question, documents, rationale, answer), loss on rationale and answer only, with
rationales written by a strong LM. We have none, so rationales are **extractive**: the first sentence of the gold
passage containing a gold answer (case-insensitive); questions without one are skipped. An example's documents are
the gold passage and one hard negative (the passage nearest to the question under the sentence embedder, gold
excluded) in random order, the shape of a drafting subset (k = 2). Only ``train``-split questions are used
(``rag.data.split_of``); the benchmark's ``eval`` split never is.

Why an adapter: a tuned 135M copy is 540 MB in float32; LoRA (peft) on every projection at rank 8 is ~2.4M
parameters, stored in float16 (~5 MiB), small enough to ship. ``models.adapters`` merges it into its base at load.

Invariants: the output directory is written atomically; it holds peft's ``adapter_config.json`` +
``adapter_model.safetensors``, ``retrospec_adapter.json`` (the base model and its identity, checked at load) and
``manifest.json`` (data, seed, steps, time, losses).
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..atomic import atomic_build
from ..chat import end_of_turn_ids, has_chat_template
from ..errors import RetrospecError
from ..models.adapters import ADAPTER_META, write_adapter_meta
from ..models.loading import load_model
from ..speculative_rag.data import Passage, Question, read_passages, read_questions, select
from ..speculative_rag.prompts import draft_spans, drafter_prompt
from .common import adamw, autocast, check_budget, check_new, set_lr, warmup_cosine, write_json

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@dataclass
class RagDrafterConfig:
    base: str
    questions: str
    passages: str
    out: str
    steps: int | None = None  # optimizer steps; None = until ``seconds``
    seconds: float | None = None
    limit: int | None = None  # training examples (after filtering)
    rank: int = 8
    alpha: int = 16
    lr: float = 3e-4
    accum: int = 4
    warmup: float = 0.05
    max_words: int = 40  # rationales longer than this are skipped (short rationales: fewer tokens to draft)
    seed: int = 0
    dtype: str = "bfloat16"  # autocast dtype for the frozen base on the CPU ("float32" to disable)
    embedder: str | None = None
    log_every: int = 10


def extractive_rationale(text: str, answers: tuple[str, ...] | list[str], max_words: int = 60) -> str | None:
    """The first sentence of ``text`` that contains one of ``answers`` (case-insensitive), or None."""
    wanted = [a.lower() for a in answers if a.strip()]
    for sentence in _SENTENCE.split(" ".join(text.split())):
        low = sentence.lower()
        if any(a in low for a in wanted):
            return sentence.strip() if len(sentence.split()) <= max_words else None
    return None


def hard_negatives(questions: list[Question], passages: list[Passage], embedder=None,
                   batch: int = 64) -> dict[str, str]:
    """For each question, the id of the passage nearest to it (cosine, sentence embedder), its gold passage excluded."""
    from ..retrieval.embedder import load_embedder

    if not questions:  # nothing to embed (encode([]) is not a [0, d] array)
        return {}
    emb = load_embedder(embedder)
    p = np.concatenate([emb.encode([x.as_text() for x in passages[i:i + batch]])
                        for i in range(0, len(passages), batch)])  # [P, d]
    q = emb.encode([x.question for x in questions])  # [Q, d]
    sims = q @ p.T  # [Q, P]
    out = {}
    for i, question in enumerate(questions):
        for j in np.argsort(-sims[i]):
            if passages[j].id != question.gold_passage:
                out[question.id] = passages[j].id
                break
    return out


def build_examples(tokenizer, questions: list[Question], passages: list[Passage], *, seed: int, max_words: int,
                   embedder=None) -> tuple[list[dict], dict]:
    """Tokenized examples ``{"ids": [...], "labels": [...]}`` (labels -100 outside rationale, answer and the end of
    turn) and counts of what was kept and skipped."""
    by_id = {p.id: p for p in passages}
    usable = [q for q in questions if q.gold_passage in by_id and q.answers]
    negatives = hard_negatives(usable, passages, embedder)
    eot = sorted(end_of_turn_ids(tokenizer)) if has_chat_template(tokenizer) else []
    eot = eot or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    rng = random.Random(seed)
    examples, skipped = [], 0
    for q in usable:
        gold = by_id[q.gold_passage]
        rationale = extractive_rationale(gold.text, q.answers, max_words)
        if rationale is None:
            skipped += 1
            continue
        answer = next(a for a in q.answers if a.lower() in rationale.lower())
        docs = [gold, by_id[negatives[q.id]]]
        rng.shuffle(docs)
        prompt = drafter_prompt(tokenizer, q.question, docs)
        text, _, _ = draft_spans(prompt, rationale, answer)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"]) + eot[:1]
        labels = [t if s >= len(prompt) else -100 for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
        examples.append({"ids": ids, "labels": labels + eot[:1], "question": q.id})
    return examples, {"questions": len(questions), "usable": len(usable), "no_rationale": skipped,
                      "examples": len(examples)}


def train_rag_drafter(cfg: RagDrafterConfig, log=print) -> dict:
    """Tune, save and return the manifest (also written to ``OUT/manifest.json``)."""
    from peft import LoraConfig, get_peft_model

    check_budget(cfg.steps, cfg.seconds)
    check_new(cfg.out)
    torch.manual_seed(cfg.seed)
    base = load_model(cfg.base)
    if base.tokenizer is None:
        raise RetrospecError(f"base model {cfg.base} has no tokenizer")
    questions = select(read_questions(cfg.questions), "train")
    passages = read_passages(cfg.passages)
    examples, counts = build_examples(base.tokenizer, questions, passages, seed=cfg.seed, max_words=cfg.max_words,
                                      embedder=cfg.embedder)
    if cfg.limit:
        examples = examples[: cfg.limit]
    if not examples:
        raise RetrospecError("no training examples: no train-split question has a gold passage sentence with its "
                             "answer")
    log(f"rag-drafter: {len(examples)} examples from {counts['questions']} train-split questions "
        f"({counts['no_rationale']} without an extractive rationale)")
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.05, target_modules=list(LORA_TARGETS),
                      task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base.model).train(), lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg.lr)
    cpu = torch.device("cpu")
    total = cfg.steps or max(1, int(cfg.seconds / 6))  # schedule length for --seconds: a guess, refined below
    rng = random.Random(cfg.seed)
    order: list[int] = []
    losses, history, tokens, step, seen = [], [], 0, 0, 0
    started = time.perf_counter()
    bar = tqdm(total=cfg.steps or int(cfg.seconds), desc="tune rag drafter", unit="step" if cfg.steps else "s",
               dynamic_ncols=True)
    while (step < cfg.steps) if cfg.steps is not None else (time.perf_counter() - started < cfg.seconds):
        set_lr(opt, warmup_cosine(step, total, cfg.lr, max(1, int(cfg.warmup * total))))
        opt.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for _ in range(cfg.accum):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            ex = examples[order.pop()]
            with autocast(cfg.dtype, cpu):  # ids, labels [1, T]
                loss = model(input_ids=torch.tensor([ex["ids"]]), labels=torch.tensor([ex["labels"]])).loss / cfg.accum
            loss.backward()
            batch_loss += float(loss)
            tokens += len(ex["ids"])
            seen += 1
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(batch_loss)
        if cfg.seconds is not None and step == 5:  # now we know the pace: fit the cosine schedule to the budget
            total = max(step + 1, int(cfg.seconds / ((time.perf_counter() - started) / step)))
        if step % cfg.log_every == 0:
            history.append({"step": step, "loss": round(float(np.mean(losses[-cfg.log_every:])), 4),
                            "seconds": round(time.perf_counter() - started, 1)})
        bar.set_postfix(loss=f"{np.mean(losses[-cfg.log_every:]):.3f}")
        bar.update(1 if cfg.steps else int(time.perf_counter() - started) - bar.n)
    bar.close()
    seconds = time.perf_counter() - started
    manifest = {
        "what": "Speculative RAG drafter: LoRA adapter tuned on extractive rationales",
        "base": cfg.base, "config": asdict(cfg),
        "data": {"questions": os.fspath(cfg.questions), "passages": os.fspath(cfg.passages), "split": "train",
                 **counts, "used": len(examples)},
        "steps": step, "examples_seen": seen, "tokens_seen": tokens, "seconds": round(seconds, 1),
        "loss_first": round(float(np.mean(losses[: cfg.log_every])), 4),
        "loss_last": round(float(np.mean(losses[-cfg.log_every:])), 4), "history": history,
        "torch_threads": torch.get_num_threads(),
    }
    save_adapter(model, base, cfg.base, manifest, Path(cfg.out))
    log(f"rag-drafter: {step} steps, {seen} examples, {tokens} tokens in {seconds:.0f} s; "
        f"loss {manifest['loss_first']} -> {manifest['loss_last']}; saved {cfg.out}")
    return manifest


def save_adapter(peft_model, base, base_name: str, manifest: dict, out: Path) -> None:
    """peft files (weights in float16) + ``retrospec_adapter.json`` + ``manifest.json``, renamed into place."""
    from safetensors.torch import load_file, save_file

    with atomic_build(out, required=ADAPTER_META) as tmp:  # renamed into place when complete
        peft_model.save_pretrained(tmp)
        weights = tmp / "adapter_model.safetensors"
        save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(weights).items()}, weights)
        cfg = json.loads((tmp / "adapter_config.json").read_text())
        write_json(tmp / "adapter_config.json", cfg | {"base_model_name_or_path": base_name}, indent=2)
        write_adapter_meta(tmp, base, base_name)
        write_json(tmp / "manifest.json", manifest)
