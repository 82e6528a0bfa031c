"""Distilling a small draft LM (``sd``'s draft, e.g. ``smollm2-135m-draft``) on the target's own outputs
(``retrospec train draft-distill``).

The bundled draft was first distilled on text the target never wrote, proposing from a vocabulary chosen on that
text. This trainer reads a corpus of the target's own replies (``retrospec corpus generate``; the records, held-out
split, batches and learning curve of ``train.longspec_distill``) and:

- **re-chooses the draft vocabulary**: the ``vocab`` target ids the target emits most in the training records (every
  EOS / end-of-turn id first), so the draft can propose what the target writes; q = 0 off it, which rejection
  sampling treats exactly;
- **starts from** ``init`` (a draft directory or name, with its ``draft_vocab.json``): its decoder layers as they
  are; per id of the new vocabulary its trained row where it had the id, else the target's row (same width), else a
  fresh normal row;
- **distils** KL(p_V || q) at every real position, p_V = the target's next-token distribution renormalised over the
  draft vocabulary (the best a draft restricted to V can do for sum_x min(p, q));
- **measures** on held-out records (teacher-forced, output tokens) the draft's greedy agreement with the target's
  greedy token per kind (chat / code) and the vocabulary's coverage of those tokens, before training and at each
  point of ``curve`` (tokens trained);
- **precision**: the training forwards in float32 or under bfloat16 autocast (``train.common.pick_precision``;
  ``auto`` measures which is faster here); agreement is measured in float32;
- **schedule**: ``cosine``, or ``wsd`` with ``resume`` (``train.resume``: a later run goes on from ``resume.pt``, the
  draft and AdamW's state before the decay, keeping that draft's vocabulary);
- **several processes** (``torchrun`` / ``accelerate launch``; ``train.distributed``): data-parallel, each process
  computing its rows of every batch (the target beside it), the gradients summed; rank 0 logs and writes;
  ``fsdp``: the frozen target's decoder layers sharded over the processes (``train.fsdp``), the draft data-parallel
  as before.

The draft trains on the target's device (``device``; measured on CPU only, CUDA untested). Output: a Hugging Face
checkpoint (float16) with ``draft_vocab.json`` and ``real_draft.json`` (config, corpus, coverage, learning curve,
seconds, and ``target_identity``: ``identity.target_record`` of the target it was distilled for), the layout of ``zoo
real-draft`` (``train.real_draft.save_draft``), and with ``wsd`` ``resume.pt``; written atomically.

Refusals (one ``RetrospecError`` line each, before training): a corpus the target did not write
(``corpus.check_corpus``); a draft to start from whose ids live in another vocabulary (its
``draft_vocab.json`` maps into another size, or the target it was distilled for had another tokenizer); a state to
resume that was trained for another target (``train.resume``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import RetrospecError
from ..identity import target_record
from ..models.files import read_json
from ..models.loading import load_model
from ..models.vocab import VocabMap
from .common import adamw, autocast, jsonable, kl, optimizer_step, pick_precision
from .distributed import setup
from .fsdp import shard_target
from .longspec_distill import (Tally, check_distill, coverage, first_batch, frequency_vocab, load_split, pad_batch,
                               sequence_of, teacher_forced, train_curve)
from .real_draft import blank_draft, save_draft
from .resume import chain_fields, check_schedule, resume_run, save_stable_state, stable_state

MANIFEST = "real_draft.json"


@dataclass
class DraftDistillConfig:
    target: str  # model name or directory
    corpus: str  # a corpus directory (``retrospec corpus generate``)
    out: str  # draft directory to create
    init: str | None  # the draft to start from (name or directory); None with ``resume``
    vocab: int = 12288  # draft vocabulary size (target ids, frequency-ranked on the training records)
    keep_vocab: bool = False  # keep the init draft's vocabulary instead of re-choosing it from the corpus
    max_len: int = 768
    batch_tokens: int = 4096
    heldout: float = 0.06
    max_tokens: int | None = None  # stop after this many tokens trained (None: one pass, or ``seconds``)
    seconds: float | None = None  # stop after this long (the schedule then runs over elapsed time)
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup: float = 0.05
    grad_clip: float = 1.0
    precision: str = "auto"  # training forwards: float32, bfloat16 (autocast) or auto (the faster here)
    curve: tuple[int, ...] = (125_000, 250_000, 500_000, 1_000_000, 2_000_000)
    eval_records: int = 96
    seed: int = 0
    schedule: str = "cosine"  # learning rate: cosine, or wsd (warm-up, stable, decay; saves a state to resume from)
    decay: float = 0.2  # wsd: the share of the budget the learning rate decays over, at its end
    resume: str | None = None  # a draft directory a wsd run wrote: go on from its stable weights and optimiser state
    device: str = "cpu"  # where the target loads and the draft trains: cpu, cuda, cuda:N or auto (train.distributed)
    fsdp: bool = False  # several processes: shard the frozen target's decoder layers over them (train.fsdp)


def check_config(cfg: DraftDistillConfig) -> None:
    check_distill(cfg, cfg.vocab >= 2, "--vocab >= 2")
    check_schedule(cfg)
    if not cfg.init and not cfg.resume:
        raise RetrospecError("give the draft to start from: --init DRAFT, or --resume DIR")


def check_init(init, src: str, record: dict) -> None:
    """Refuse a draft to start from whose token ids mean something else for the target ``record`` describes: rows
    of another vocabulary size (through its ``draft_vocab.json``, if any), or distilled for a target whose tokenizer
    differs (its ``real_draft.json``'s ``target_identity``, when recorded)."""
    V = record["vocab_size"]
    if init.target_vocab_size != V:
        how = "its draft_vocab.json maps into" if init.vocab_map is not None else "it has no draft_vocab.json and has"
        raise RetrospecError(f"draft {src} drafts for another vocabulary: {how} {init.target_vocab_size} tokens; the "
                             f"target has {V}")
    manifest = Path(init.path) / MANIFEST
    was = read_json(manifest, f"corrupt draft {src}").get("target_identity") if manifest.is_file() else None
    theirs = was.get("tokenizer_fingerprint") if isinstance(was, dict) else None
    if theirs is not None and record["tokenizer_fingerprint"] is not None and theirs != record["tokenizer_fingerprint"]:
        raise RetrospecError(f"draft {src} was distilled for a target with another tokenizer ({was.get('path')}); its "
                             "token ids mean other tokens for this target")


def revocab(draft, old_ids: list[int], new_ids: list[int], target) -> torch.nn.Module:
    """A copy of the causal LM ``draft`` (rows = target ids ``old_ids``) whose rows are target ids ``new_ids``:
    layers as they are; each row the draft's own where it had the id, else the target's row (same width) carried
    into the draft's space by ``row_map``, else a fresh normal row. ``draft`` is left as it is."""
    new = blank_draft(draft.config, len(new_ids))
    cfg = new.config
    state = {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or any("embed_tokens" not in k and "lm_head" not in k for k in missing):
        raise RetrospecError(f"cannot re-vocabulary this draft: unexpected weights {unexpected[:3]} / {missing[:3]}")
    where = {t: i for i, t in enumerate(old_ids)}
    std = getattr(cfg, "initializer_range", 0.02)
    with torch.no_grad():
        pairs = [[m.get_input_embeddings().weight for m in (draft, target, new)]]
        if not getattr(cfg, "tie_word_embeddings", True):
            pairs.append([m.get_output_embeddings().weight for m in (draft, target, new)])
        for own, theirs, dest in pairs:
            carry = row_map(theirs, own, [t for t in new_ids if t in where], where)
            for row, t in enumerate(new_ids):
                if t in where:
                    dest[row] = own[where[t]].float()
                elif carry is not None:
                    dest[row] = carry(theirs[t].float())
                else:
                    dest[row].normal_(0.0, std)
    return new


def row_map(theirs: torch.Tensor, own: torch.Tensor, shared: list[int], where: dict[int, int]):
    """How a target row [H] becomes a draft row: the least-squares linear map from the target's rows to the draft's
    over the ``shared`` ids (target id -> draft row ``where``), when there are at least H of them; else the target's
    row as it is; None when the widths differ. A draft started from the target's rows has trained them away from it:
    copied as they are, the new rows out-scored the trained ones (measured: held-out agreement 0.34 -> 0.16 after
    re-choosing 12,288 ids)."""
    if theirs.shape[1] != own.shape[1]:
        return None
    if len(shared) < own.shape[1]:
        return lambda row: row
    a = theirs[shared].float()  # [n, H]
    b = own[[where[t] for t in shared]].float()  # [n, H]
    w = torch.linalg.lstsq(a, b).solution  # [H, H]
    return lambda row: row @ w


def _teacher(target, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The frozen target's final hidden states [b, L, H] (right padding never seen by real tokens)."""
    with torch.no_grad():
        return target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state


def distill_loss(draft, target, vmap: VocabMap, head_rows: torch.Tensor, ids, mask) -> torch.Tensor:
    """Mean KL(p_V || q) over the real positions of one batch (ids [b, L] target ids, mask [b, L])."""
    log_p = (_teacher(target, ids, mask) @ head_rows.T).float().log_softmax(-1)  # [b, L, K]
    log_q = draft(input_ids=vmap.to_draft[ids], attention_mask=mask).logits.float().log_softmax(-1)  # [b, L, K]
    return kl(log_p, log_q)[mask.bool()].mean()


@torch.no_grad()
def agreement(draft, target, vmap: VocabMap, records: list[dict], max_len: int) -> dict:
    """Teacher-forced greedy agreement with the target on the records' output tokens, per kind; plus the draft
    vocabulary's coverage of the target's greedy tokens."""
    tally = Tally(coverage=True)
    for r, seq, first in teacher_forced(records, max_len):
        ids = torch.tensor(seq, device=vmap.ids.device)[None]
        hidden = _teacher(target, ids, torch.ones_like(ids))
        greedy = target.get_output_embeddings()(hidden[0, first - 1:-1]).argmax(-1)  # [n]
        drafted = vmap.ids[draft(input_ids=vmap.to_draft[ids]).logits[0, first - 1:-1].argmax(-1)]  # [n]
        tally.add(r, drafted, greedy, vmap.covered)
    return tally.result()


def distill_draft(cfg: DraftDistillConfig, log=print, target=None) -> dict:
    """Distil ``cfg.init`` for ``cfg.target`` on ``cfg.corpus`` and save it to ``cfg.out``; returns the manifest.
    Under several processes (``train.distributed``) each runs this; rank 0 logs and saves."""
    check_config(cfg)
    dist = setup(cfg.device, fsdp=cfg.fsdp)
    log = dist.log(log)
    train, held, records, loaded, rng = load_split(cfg.corpus, cfg.target, cfg.seed, cfg.heldout, cfg.eval_records,
                                                   target, device="cpu" if dist.fsdp else dist.device)
    tmodel = loaded.model
    record = target_record(tmodel, loaded.tokenizer, getattr(loaded, "path", cfg.target))  # reads every weight
    # the frozen forwards run on ``teacher``: the target, or with --fsdp its module with the layers sharded (what
    # this reads of the target outside them, its embedding and head, stays whole: ``train.fsdp``)
    teacher = shard_target(loaded, dist, private=target is not None) if dist.fsdp else tmodel
    init = load_model(cfg.resume or cfg.init, role="draft", device=tmodel.get_output_embeddings().weight.device)
    V = tmodel.get_output_embeddings().weight.shape[0]
    check_init(init, cfg.resume or cfg.init, record)
    old_ids = init.vocab_map.tolist() if init.vocab_map is not None else list(range(init.vocab_size))
    eos = set(loaded.eos_ids()) if hasattr(loaded, "eos_ids") else set()
    specials = {i for i in (getattr(loaded.tokenizer, "all_special_ids", None) or []) if i is not None}
    keep = cfg.keep_vocab or cfg.resume is not None  # a resumed draft keeps its vocabulary
    if keep and init.vocab_map is None:
        raise RetrospecError(f"--keep-vocab: draft {cfg.resume or cfg.init} has no draft_vocab.json; it drafts over "
                             "every id")
    new_ids = old_ids if keep else sorted(frequency_vocab(train, min(cfg.vocab, V), eos | specials | {0}, V))
    device = tmodel.get_output_embeddings().weight.device  # the draft trains beside the target (CPU or CUDA)
    vmap = VocabMap(new_ids, V).to(device)
    draft = revocab(init.model, old_ids, new_ids, tmodel).to(device)
    head_rows = tmodel.get_output_embeddings().weight[vmap.ids].detach()  # [K, H]: p_V's logits
    log(f"corpus {cfg.corpus}: {len(train)} training records, {len(held)} held out; draft vocabulary {len(new_ids)} "
        f"(held-out output coverage {coverage(new_ids, held):.4f}, the init draft's {coverage(old_ids, held):.4f})")
    total = sum(min(cfg.max_len, len(r["prompt_ids"]) + len(r["output_ids"])) for r in train)
    budget = cfg.max_tokens or (10**12 if cfg.seconds else total)
    pad = min(eos) if eos else 0
    opt = adamw(draft.parameters(), cfg.lr, cfg.weight_decay)
    cfg, previous, before = resume_run(cfg, draft, opt, MANIFEST, log, target=tmodel)
    dist.same_start(draft)
    stable: dict = {}

    def loss_of(batch: list[dict], how: str) -> tuple[torch.Tensor, int]:
        """(this process's share of the batch's loss, the batch's real tokens)."""
        ids, mask = pad_batch([sequence_of(r, cfg.max_len)[0] for r in batch], pad)
        ids, mask = ids.to(device), mask.to(device)
        with autocast(how, device):
            return dist.local_loss(lambda i, m: distill_loss(draft, teacher, vmap, head_rows, i, m), mask, ids,
                                   mask, target=lambda i, m: _teacher(teacher, i, m)), int(mask.sum())

    first = first_batch(train, cfg)
    precision = dist.same(pick_precision(cfg.precision, device, lambda: loss_of(first, "float32"), log))

    def step(batch: list[dict]) -> tuple[float, int]:
        loss, n = loss_of(batch, precision)
        return optimizer_step(opt, loss, draft.parameters(), cfg.grad_clip, dist), n

    result = train_curve(draft, opt, train, cfg, budget, [c for c in cfg.curve if c < budget], rng, log, step=step,
                         evaluate=lambda: agreement(draft, teacher, vmap, held, cfg.max_len), desc="distil draft",
                         next_pass=lambda: None if cfg.seconds is None and cfg.max_tokens is None else train,
                         snapshot=lambda done: stable.update(stable_state(draft, opt, before + done, record)),
                         dist=dist)
    manifest = {"kind": "retrospec real-model draft", "what": "draft distilled on the target's own outputs",
                "config": jsonable(cfg), "target": getattr(loaded, "path", cfg.target), "target_identity": record,
                "init": getattr(init, "path", cfg.resume or cfg.init),
                "corpus": {"path": cfg.corpus, "records": len(records), "heldout_records": len(held)},
                "draft_params": sum(p.numel() for p in draft.parameters()),
                "heldout_coverage": round(coverage(new_ids, held), 4), "precision": precision, **result,
                "date": time.strftime("%Y-%m-%d %H:%M"), **chain_fields(previous, before, result["tokens_seen"]),
                **dist.manifest()}
    if dist.main:
        save_draft(draft.cpu(), new_ids, V, manifest, Path(cfg.out),
                   extra=(lambda d: save_stable_state(stable, d)) if stable else None)
    dist.barrier()
    return manifest


def describe_curve(manifest: dict) -> str:
    rows = ["| tokens trained | chat | code | all | vocabulary coverage | KL |", "|" + " ---: |" * 6]
    for c in manifest["curve"]:
        rows.append(f"| {c['tokens']:,} | {c.get('chat', float('nan')):.3f} | {c.get('code', float('nan')):.3f} | "
                    f"{c['all']:.3f} | {c['vocab_coverage']:.3f} | {c.get('loss', '')} |")
    return "\n".join(rows)
