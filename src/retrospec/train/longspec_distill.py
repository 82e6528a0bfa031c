"""Distilling the LongSpec block on the target's own outputs (``retrospec train longspec-distill``).

The bundled block was first trained on code windows the target never wrote; what it meets at inference is text the
target writes. This trainer reads a corpus of the target's own replies (``retrospec corpus generate``:
``prompt_ids`` + ``output_ids`` per record) and distils the target's next-token distribution into the block:

- **sequences**: the last ``max_len`` tokens of a record's prompt + output, right-padded into batches of similar
  length (at most ``batch_tokens`` tokens per batch, padding included);
- **the target** runs frozen once per batch: its last layer's cached (keys, values) feed the block's
  cross-attention, its final hidden states [b, L, H] give p over the draft vocabulary;
- **draft vocabulary** (FR-Spec, Zhao et al. 2025): the ``draft_vocab`` tokens the target emits most in the training
  records (every EOS / end-of-turn id added); the block's logits are the head's rows for them only, so a drafted
  token costs a fraction of a full-head step and q = 0 elsewhere (lossless: the target verifies). ``draft_vocab=0``
  keeps the full head;
- **loss**: KL(p_V || q) at every non-pad position, p_V = the target's distribution renormalised over the draft
  vocabulary; a flash-noisy shift in [1, noisy_max] per batch and anchor-offset positions on a share of batches
  (``train.longspec``) keep the block usable at long contexts;
- **corpora**: ``corpus`` names one corpus directory or several, comma-separated, read in that order (a new corpus
  of new prompts extends an old one whose prompts ran out; the held-out sample stays the same); each must be the
  target's own (``corpus.check_corpus``: a corpus another model wrote is one ``RetrospecError`` line);
- **follow** (``--follow --seconds S``): train while ``corpus generate`` still runs, taking the shards written since
  the last pass, in whichever corpus of the list they landed (``follow_corpora``); when too few are new, another
  pass over every training record so far (``tokens`` in the curve counts tokens trained on, ``corpus_tokens`` the
  distinct corpus tokens behind them); the draft vocabulary and the held-out set come from the records present at
  the start (grow the last corpus listed to keep a later run's held-out sample the same);
- **precision** (``train.common.pick_precision``): the training forwards run in float32 or under bfloat16 autocast,
  measured on the running machine by default (``auto``); the agreement is always measured in float32, as drafting
  runs;
- **held-out** records (``heldout`` share of prompts by SHA-1 of the prompt text, so both temperatures of a prompt
  fall on the same side) measure, teacher-forced at shift 1 on output tokens, the block's agreement with the
  target's greedy token per kind (chat / code) at each point of ``curve`` (corpus output tokens seen; the learning
  rate at an early point is still high, so it under-states what a smaller corpus trained to the end would reach);
- **schedule**: ``cosine`` (warm-up, cosine to 0), or ``wsd`` with ``resume`` (``train.resume``): runs spread over
  several sittings train as one, without the dip a restart from ``--init`` costs;
- **several processes** (``torchrun`` / ``accelerate launch``; ``train.distributed``): data-parallel, each process
  computing its rows of every batch, the gradients summed; the loss, curve and block are one process's of the same
  batches (up to float summation order); rank 0 logs and writes; ``follow`` is one process only; ``fsdp``: the
  frozen target's decoder layers sharded over the processes (``train.fsdp``), the block data-parallel as before.

Output: a block directory (``storage`` int8 by default) plus ``manifest.json`` (config, corpus, draft-vocabulary
coverage, learning curve, seconds; ``tokens_total``: tokens trained since the first of a chain of resumed runs) and,
with ``wsd``, ``resume.pt``; written atomically.
"""

from __future__ import annotations

import collections
import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..corpus import check_corpus, read_corpus
from ..corpus.build import MANIFEST
from ..drafters.longspec import load_block
from ..errors import RetrospecError
from ..identity import head_rows, target_record
from ..models.loading import as_module, load_model
from ..models.longspec import LongSpecDraft
from ..models.longspec.block import feature_layers_for
from .common import (adamw, autocast, check_new, check_precision, kl, optimizer_step, pick_precision, set_lr,
                     warmup_cosine, warmup_stable_decay)
from .distributed import Dist, check_global_batch, env, setup
from .fsdp import shard_target
from .longspec import feature_passes, sample_positions, save_block, target_logits
from .resume import chain_fields, check_schedule, resume_run, save_stable_state, stable_state


@dataclass
class DistillConfig:
    target: str  # model name or directory
    corpus: str  # a corpus directory (``retrospec corpus generate``)
    out: str  # block directory to create
    init: str | None = None  # block to start from (name / directory); None: a fresh identity-initialised block
    draft_vocab: int = 16384  # 0: the full head
    keep_vocab: bool = False  # keep the init block's draft vocabulary instead of re-choosing it from the corpus
    max_len: int = 768
    batch_tokens: int = 4096
    heldout: float = 0.04
    max_tokens: int | None = None  # stop after this many corpus output tokens (None: one pass)
    seconds: float | None = None  # stop after this long, or at the token budget if sooner (the schedule ends there)
    lr: float | None = None  # peak learning rate; None: ``peak_lr`` (lower from a trained block)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = 0.05
    grad_clip: float = 1.0
    noisy_max: int = 2
    anchor_share: float = 0.25
    max_positions: int = 8192
    curve: tuple[int, ...] = (62_500, 125_000, 250_000, 500_000, 1_000_000, 2_000_000)
    eval_records: int = 96
    storage: str | None = "int8"
    seed: int = 0
    follow: bool = False  # keep training on shards a running ``corpus generate`` adds (needs ``seconds``)
    precision: str = "auto"  # training forwards: float32, bfloat16 (autocast) or auto (the faster here)
    schedule: str = "cosine"  # learning rate: cosine, or wsd (warm-up, stable, decay; saves a state to resume from)
    decay: float = 0.2  # wsd: the share of the budget the learning rate decays over, at its end
    resume: str | None = None  # a block directory a wsd run wrote: go on from its stable weights and optimiser state
    features: tuple[int, ...] | str | None = None  # target layers a block without features starts reading ("auto")
    ttt: int = 1  # feature blocks: passes of training-time test (1: the target's feature at every position)
    device: str = "cpu"  # where the target loads and the block trains: cpu, cuda, cuda:N or auto (train.distributed)
    fsdp: bool = False  # several processes: shard the frozen target's decoder layers over them (train.fsdp)


# ------------------------------------------------------------------------------------------------------------ data


def is_heldout(record: dict, share: float) -> bool:
    digest = int(hashlib.sha1(record.get("prompt", "").encode("utf-8")).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < share


def heldout_sample(records: list[dict], share: float, n: int) -> list[dict]:
    """The first ``n`` held-out records in corpus order: a corpus grows only by appending shards, so the sample of a
    larger corpus is the same (learning curves of runs on a growing corpus compare)."""
    return [r for r in records if is_heldout(r, share)][:n]


def kind_of(record: dict) -> str:
    """A corpus record's kind: ``chat`` when its prompt was asked under the chat template (its ``chat`` flag: nq,
    self-instruct, tasks), else ``code`` (mbpp, stdlib: raw completion)."""
    return "chat" if record.get("chat") else "code"


def frequency_vocab(records: list[dict], k: int, always: set[int], vocab_size: int) -> list[int]:
    """``k`` target ids: ``always`` first, then by frequency among the records' output tokens, then among their
    prompt tokens, then by id (BPE ids rise roughly as merges get rarer); ties by id."""
    out_counts = collections.Counter(t for r in records for t in r["output_ids"])
    in_counts = collections.Counter(t for r in records for t in r["prompt_ids"])
    ids = sorted(t for t in always if 0 <= t < vocab_size)
    rest = sorted((t for t in range(vocab_size) if t not in always),
                  key=lambda t: (-out_counts.get(t, 0), -in_counts.get(t, 0), t))
    return (ids + rest)[:k]


def coverage(vocab: list[int], records: list[dict]) -> float:
    """Share of the records' output tokens inside ``vocab``."""
    inside, total = set(vocab), sum(len(r["output_ids"]) for r in records)
    return sum(t in inside for r in records for t in r["output_ids"]) / max(1, total)


def sequence_of(record: dict, max_len: int) -> tuple[list[int], int]:
    """(prompt + output ids, the last ``max_len`` of them; index of the first output token in it)."""
    ids = list(record["prompt_ids"]) + list(record["output_ids"])
    cut = max(0, len(ids) - max_len)
    return ids[cut:], max(0, len(record["prompt_ids"]) - cut)


def load_split(corpus: str, target_src: str, seed: int, heldout: float, eval_records: int, target=None,
               growing: bool = False, parts: list[tuple[str, list[dict]]] | None = None, device="cpu"):
    """What every distiller starts from: (training records, ``eval_records`` held-out records, all records with
    outputs, the target loaded on ``device`` (or ``target``) with its weights frozen, a ``random.Random(seed)``);
    torch seeded.
    The evaluated records: ``heldout_sample``; ``growing``: see ``corpus_records``; ``parts``: ``corpus_parts``
    already read (instead of reading ``corpus``). Every corpus must be the target's own (``check_corpus``: one
    ``RetrospecError`` line for a corpus another model wrote, or one with token ids outside its vocabulary)."""
    parts = corpus_parts(corpus, growing) if parts is None else parts
    records = [r for _, part in parts for r in part]
    if not records:
        raise RetrospecError(f"corpus {corpus} holds no generated outputs yet")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    target = target if target is not None else load_model(target_src, device=device)
    for d, part in parts:  # a corpus another model wrote is refused before anything trains on it
        check_corpus(d, part, target, name=target_src if isinstance(target_src, str) else None)
    model = as_module(target).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    train = [r for r in records if not is_heldout(r, heldout)]
    return train, heldout_sample(records, heldout, eval_records), records, target, rng


def corpus_dirs(spec: str) -> list[str]:
    """``--corpus A[,B ...]``: one corpus directory, or several read in the order given."""
    return [d for d in (part.strip() for part in str(spec).split(",")) if d]


def corpus_parts(spec: str, growing: bool = False, target=None) -> list[tuple[str, list[dict]]]:
    """(directory, its records with outputs in shard order) for each corpus in ``spec``, in the order given.
    ``growing`` (``--follow``): the last corpus may be one ``corpus generate`` has only just started (its directory,
    without a manifest until the first shard lands); it is then left out. ``target``: each corpus must be its own
    (``corpus.check_corpus``)."""
    dirs = corpus_dirs(spec)
    last = Path(dirs[-1]) if dirs else None
    if growing and last is not None and last.is_dir() and not (last / MANIFEST).is_file():
        dirs = dirs[:-1]
    return [(d, [r for r in read_corpus(d, target) if r.get("output_ids")]) for d in dirs]


def corpus_records(spec: str, growing: bool = False, target=None) -> list[dict]:
    """The records with outputs of every corpus in ``spec``, corpus after corpus (each in shard order): a held-out
    sample, the first held-out records, stays the same when a corpus is appended to the list or the last one grows
    (a corpus before it that grows puts its new held-out records ahead of the later corpora's). ``target``: see
    ``corpus_parts``."""
    return [r for _, part in corpus_parts(spec, growing, target) for r in part]


def follow_corpora(seen: dict[str, int], parts: list[tuple[str, list[dict]]]) -> tuple[list[dict], dict[str, int]]:
    """The records each corpus gained since ``seen`` (directory -> records read), corpus after corpus, and the new
    counts: any corpus of the list may grow, not only the last."""
    new = [r for d, part in parts for r in part[seen.get(d, 0):]]
    return new, {**seen, **{d: len(part) for d, part in parts}}


def teacher_forced(records: list[dict], max_len: int):
    """(record, sequence, index of its first output token) of each record with output tokens to score."""
    for r in records:
        seq, first = sequence_of(r, max_len)
        if 1 <= first < len(seq):
            yield r, seq, first


class Tally:
    """Greedy agreement per kind (``kind_of``) and, optionally, the draft vocabulary's coverage of the target's
    greedy tokens (``coverage``); ``result()`` is the learning curve's row."""

    def __init__(self, coverage: bool):
        self.hits: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.covered = [0, 0] if coverage else None

    def add(self, record: dict, drafted: torch.Tensor, greedy: torch.Tensor, inside: torch.Tensor | None) -> None:
        """``drafted``/``greedy`` [n] target ids; ``inside`` [V] bool: the draft vocabulary."""
        h = self.hits[kind_of(record)]
        h[0] += int((drafted == greedy).sum())
        h[1] += int(greedy.numel())
        if self.covered is not None:
            self.covered[0] += int(inside[greedy].sum())
            self.covered[1] += int(greedy.numel())

    def result(self) -> dict:
        out = {k: round(v[0] / max(1, v[1]), 4) for k, v in sorted(self.hits.items())}
        total = [sum(v[0] for v in self.hits.values()), sum(v[1] for v in self.hits.values())]
        out["all"] = round(total[0] / max(1, total[1]), 4)
        out["tokens"] = total[1]
        if self.covered is not None:
            out["vocab_coverage"] = round(self.covered[0] / max(1, self.covered[1]), 4)
        return out


def make_batches(records: list[dict], max_len: int, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Record indices grouped by length (b x longest <= batch_tokens), batches in random order."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["output_ids"]))
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(max_len, len(records[i]["prompt_ids"]) + len(records[i]["output_ids"]))
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def first_batch(records: list[dict], cfg) -> list[dict]:
    """The batch ``pick_precision`` times: the first of ``make_batches`` under the config's seed (its own generator, so
    the training draws stay what they are whatever the precision)."""
    return [records[i] for i in make_batches(records, cfg.max_len, cfg.batch_tokens, random.Random(cfg.seed))[0]]


def pad_batch(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, L] right-padded with ``pad``, mask [b, L]: 1 on real tokens)."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def distill_loss(block: LongSpecDraft, target, ids, positions, mask, shift: int, passes: int = 1) -> torch.Tensor:
    """Mean KL(p_V || q) over the real positions of one batch; a block with features: the mean over its
    ``feature_passes``."""
    hidden, kv, *states = target_logits(target, ids, positions, mask, head=False, layers=block.features)
    log_p = block.head(hidden).float().log_softmax(-1)  # [b, L, K]: p renormalised over the draft vocabulary
    drafts = feature_passes(block, ids, positions, kv, states[0] if states else None, shift, passes)
    real = mask.bool()
    return sum(kl(log_p, q.float().log_softmax(-1))[real].mean() for q in drafts) / len(drafts)


# ------------------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def agreement(block: LongSpecDraft, target, records: list[dict], max_len: int, pad: int) -> dict:
    """Teacher-forced top-1 agreement with the target's greedy token on the records' output tokens (shift 1), per
    kind, plus the draft vocabulary's coverage of those greedy tokens."""
    model = as_module(target)
    tally = Tally(coverage=block.vocab is not None)
    inside = None
    if block.vocab is not None:
        inside = torch.zeros(model.get_output_embeddings().weight.shape[0], dtype=torch.bool, device=block.vocab.device)
        inside[block.vocab] = True
    dev = block.norm1.weight.device
    for r, seq, first in teacher_forced(records, max_len):
        ids = torch.tensor(seq, device=dev)[None]
        pos = torch.arange(len(seq), device=dev)[None]
        hidden, kv, *states = target_logits(target, ids, pos, head=False, layers=block.features)
        greedy = model.get_output_embeddings()(hidden[0, first - 1:-1]).argmax(-1)  # [n] the target's next tokens
        logits = feature_passes(block, ids, pos, kv, states[0] if states else None, 1, 1)[0]
        drafted = block.token_ids(logits[0, first - 1:-1].argmax(-1))  # [n]
        tally.add(r, drafted, greedy, inside)
    return tally.result()


# -------------------------------------------------------------------------------------------------------- training


def batch_loss(block, target, records: list[dict], cfg: DistillConfig, rng: random.Random, pad: int,
               precision: str, dist: Dist = Dist()) -> torch.Tensor:
    """The distillation loss of one batch of ``records`` (positions and shift drawn from ``rng``); ``dist``: this
    process's share of it (its rows of the batch drawn whole, ``Dist.local_loss``)."""
    ids, mask = pad_batch([sequence_of(r, cfg.max_len)[0] for r in records], pad)
    anchored = rng.random() < cfg.anchor_share
    positions = sample_positions(ids.shape[0], ids.shape[1], cfg.max_positions, rng, anchor_offset=anchored)
    dev = block.norm1.weight.device  # the target's device (the block lives beside it)
    ids, mask, positions = ids.to(dev), mask.to(dev), positions.to(dev)
    shift = rng.randint(1, cfg.noisy_max)
    with autocast(precision, dev):
        return dist.local_loss(lambda i, p, m: distill_loss(block, target, i, p, m, shift, cfg.ttt), mask, ids,
                               positions, mask, target=lambda i, p, m: target_logits(target, i, p, m, head=False,
                                                                                    layers=block.features))


def train_step(block, target, opt, records: list[dict], cfg: DistillConfig, rng: random.Random,
               pad: int, precision: str = "float32", dist: Dist = Dist()) -> tuple[float, int]:
    """One optimizer step on ``records``; returns (the batch's KL, its output tokens); ``dist``: see
    ``train.distributed``."""
    loss = batch_loss(block, target, records, cfg, rng, pad, precision, dist)
    return (optimizer_step(opt, loss, block.parameters(), cfg.grad_clip, dist),
            sum(len(r["output_ids"]) for r in records))


def check_distill(cfg, vocab_ok: bool, vocab_rule: str) -> None:
    """The checks both distillers share (``vocab_rule``: what the vocabulary flag needs)."""
    for d in corpus_dirs(cfg.corpus) or [""]:
        if not Path(d).is_dir():
            raise RetrospecError(f"corpus directory not found: {d or cfg.corpus!r}")
    check_new(cfg.out)
    if not vocab_ok or cfg.max_len < 2 or cfg.batch_tokens < cfg.max_len or not 0 < cfg.heldout < 1:
        raise RetrospecError(f"need {vocab_rule}, --max-len >= 2, --batch-tokens >= --max-len and a held-out share "
                             "in (0, 1)")
    if cfg.lr is not None and not cfg.lr > 0:
        raise RetrospecError(f"--lr must be positive, got {cfg.lr}")
    if (cfg.max_tokens is not None and cfg.max_tokens < 1) or (cfg.seconds is not None and not cfg.seconds > 0):
        raise RetrospecError("--max-tokens / --seconds must be positive")
    check_precision(cfg.precision)
    check_global_batch(cfg.batch_tokens, "--batch-tokens")


FRESH_LR, FINE_TUNE_LR = 1e-3, 1e-4  # ``peak_lr``'s defaults


def peak_lr(cfg: DistillConfig) -> float:
    """``cfg.lr`` where given (a resumed run's is its predecessor's: ``resume_run`` keeps it); else ``FINE_TUNE_LR``
    from a trained ``--init`` block without ``--features`` (at 1e-3 such a run first undoes the block: held-out
    agreement 0.553 -> 0.473 after 63K tokens on SmolLM2's bundled block, 0.550 at 1e-4), ``FRESH_LR`` for a fresh
    block or with ``--features`` (new feature layers learn from scratch)."""
    if cfg.lr is not None:
        return cfg.lr
    return FINE_TUNE_LR if cfg.init and not cfg.features else FRESH_LR


def check_config(cfg: DistillConfig) -> None:
    check_distill(cfg, cfg.draft_vocab >= 0, "--draft-vocab >= 0")
    if cfg.noisy_max < 1 or not 0 <= cfg.anchor_share <= 1:
        raise RetrospecError("need --noisy-max >= 1 and an anchor share in [0, 1]")
    check_schedule(cfg)
    if cfg.resume is None and cfg.keep_vocab and not cfg.init:
        raise RetrospecError("--keep-vocab keeps the --init block's draft vocabulary: give --init")
    if cfg.ttt < 1 or (cfg.ttt > 1 and not cfg.features and not cfg.init and not cfg.resume):
        raise RetrospecError("--ttt N (N >= 1) trains a block with target features: give --features (or an --init "
                             "block that has them)")
    if cfg.follow and cfg.seconds is None:
        raise RetrospecError("--follow trains until --seconds run out: give --seconds")
    if cfg.follow and env().world > 1:
        raise RetrospecError("--follow runs in one process (the processes would read a growing corpus at different "
                             "moments); run it without torchrun / accelerate launch")


def train_curve(model, opt, train: list[dict], cfg, budget: int, points: list[int], rng: random.Random, log, *,
                step: Callable[[list[dict]], tuple[float, int]], evaluate: Callable[[], dict], desc: str,
                next_pass: Callable[[], list[dict] | None], extra: Callable[[], dict] = dict,
                snapshot: Callable[[int], None] | None = None, dist: Dist = Dist()):
    """The distillers' loop: passes over ``make_batches(train)``, each batch one ``step`` (returning its loss and
    the tokens it counts). The learning rate follows progress = tokens counted / ``budget``, or with ``cfg.seconds``
    the larger of that and elapsed / ``cfg.seconds`` (a run stops at whichever comes first, and its schedule ends
    there: a pass that ends before the time would otherwise stop in the middle of the decay): ``cfg.warmup`` +
    cosine, or with ``cfg.schedule == "wsd"`` ``warmup_stable_decay`` over the last ``cfg.decay``, with
    ``snapshot(tokens counted)`` called once as the decay starts (or at the end, if it never started). Stops at the
    budget, or when ``next_pass()`` (after each pass) gives no records. ``evaluate`` runs (``model`` in eval mode)
    before training, once the tokens counted pass each of ``points``, and at the end. ``dist`` (several processes):
    the elapsed share of ``cfg.seconds`` is the largest of the processes' (they stop at the same step), the progress
    bar is rank 0's. Returns the manifest's ``steps``, ``tokens_seen``, ``seconds`` and ``curve``."""
    wsd = cfg.schedule == "wsd"
    model.eval()
    curve = [{**evaluate(), "tokens": 0}]
    log(f"before: {curve[0]}")
    started, seen, n_steps, losses = time.perf_counter(), 0, 0, []
    bar = tqdm(total=None if cfg.seconds else budget, unit="tok", desc=desc, mininterval=5.0, disable=not dist.main)

    def row(**more) -> dict:
        model.eval()
        out = {**evaluate(), "tokens": seen, **extra(), "step": n_steps, **more,
               "seconds": round(time.perf_counter() - started, 1)}
        model.train()
        return out

    model.train()
    while train:
        for batch in make_batches(train, cfg.max_len, cfg.batch_tokens, rng):
            progress = seen / budget
            if cfg.seconds is not None:
                progress = max(progress, dist.most((time.perf_counter() - started) / cfg.seconds))
            if seen >= budget or progress >= 1:
                train = None
                break
            if wsd and snapshot is not None and progress >= 1 - cfg.decay:
                snapshot(seen)  # the weights and optimiser state a later run resumes from: before any decay
                snapshot = None
            set_lr(opt, warmup_stable_decay(progress, cfg.lr, cfg.warmup, cfg.decay) if wsd
                   else warmup_cosine(min(1.0, progress), 1.0, cfg.lr, cfg.warmup, ramp=0))
            loss, n = step([train[i] for i in batch])
            n_steps, seen = n_steps + 1, seen + n
            losses.append(loss)
            bar.update(n)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            if points and seen >= points[0]:
                while points and seen >= points[0]:
                    points.pop(0)
                curve.append(row(loss=round(sum(losses[-50:]) / len(losses[-50:]), 4)))
                log(f"after {seen} tokens: {curve[-1]}")
        train = train and next_pass()
    bar.close()
    if wsd and snapshot is not None:
        snapshot(seen)
    if curve[-1]["tokens"] != seen:
        curve.append(row())
    model.eval()
    log(f"after: {curve[-1]}")
    return {"steps": n_steps, "tokens_seen": seen, "seconds": round(time.perf_counter() - started, 1), "curve": curve}


def distill_longspec(cfg: DistillConfig, log=print, target=None) -> dict:
    """Distil a block for ``cfg.target`` on ``cfg.corpus``, save it to ``cfg.out``; returns the manifest. Under
    several processes (``train.distributed``) each runs this; rank 0 logs and saves."""
    check_config(cfg)
    dist = setup(cfg.device, fsdp=cfg.fsdp)
    log = dist.log(log)
    parts = corpus_parts(cfg.corpus, growing=cfg.follow)
    given = target is not None
    train, held, _, target, rng = load_split(cfg.corpus, cfg.target, cfg.seed, cfg.heldout, cfg.eval_records,
                                              target, growing=cfg.follow, parts=parts,
                                              device="cpu" if dist.fsdp else dist.device)
    record = target_record(as_module(target), getattr(target, "tokenizer", None),
                           getattr(target, "path", None) or cfg.target)  # before sharding: it reads every weight
    # the frozen forwards run on ``teacher``: the target, or with --fsdp its module with the layers sharded
    teacher = shard_target(target, dist, private=given) if dist.fsdp else target
    start = cfg.resume or cfg.init
    block = load_block(start, target) if start else LongSpecDraft.for_target(target, init="identity")
    layers = (feature_layers_for(block.config.num_hidden_layers) if cfg.features == "auto"
              else tuple(cfg.features or ()))
    if layers and layers != block.features:
        block.add_features(layers)  # a block with other features is refused (one line)
    if cfg.ttt > 1 and not block.features:
        raise RetrospecError(f"--ttt {cfg.ttt}: block {start} reads no target features; give --features")
    eos = set(getattr(target, "eos_ids", lambda: set())())
    vocab_size = head_rows(as_module(target))
    if cfg.resume is None:  # a resumed block keeps its draft vocabulary
        if not cfg.keep_vocab:
            block.set_vocab(frequency_vocab(train, cfg.draft_vocab, eos, vocab_size) if cfg.draft_vocab else None)
        elif block.vocab is None:
            raise RetrospecError(f"--keep-vocab: block {cfg.init} drafts over the full head; it has no draft "
                                 "vocabulary to keep")
    pad = eos and min(eos) or 0
    total_out = sum(len(r["output_ids"]) for r in train)
    budget = cfg.max_tokens or (10**12 if cfg.follow else total_out)
    held_coverage = None if block.vocab is None else round(coverage(block.vocab.tolist(), held), 4)
    log(f"corpus {cfg.corpus}: {len(train)} training records ({total_out} output tokens), {len(held)} held out; "
        f"draft vocabulary {block.draft_vocab_size}" + (f", held-out coverage {held_coverage:.4f}"
                                                      if block.vocab is not None else ""))
    for p in block.parameters():
        p.requires_grad_(True)
    opt = adamw(block.parameters(), peak_lr(cfg), cfg.weight_decay, betas=tuple(cfg.betas))  # set every step
    cfg, previous, before = resume_run(cfg, block, opt, MANIFEST, log, target=as_module(target))
    cfg = replace(cfg, lr=peak_lr(cfg))
    dist.same_start(block)
    stable: dict = {}
    first = first_batch(train, cfg)
    precision = dist.same(pick_precision(cfg.precision, block.norm1.weight.device, lambda: batch_loss(
        block, teacher, first, cfg, random.Random(0), pad, "float32", dist), log))
    pool, unique = list(train), total_out  # training records; their tokens
    seen = {d: len(part) for d, part in parts}  # corpus directory -> records read

    def next_pass() -> list[dict] | None:
        """Following a corpus still being generated: the shards written since; with too few new tokens, another
        pass over every training record so far (``corpus_tokens`` counts each token once, ``tokens`` every pass)."""
        nonlocal seen, unique
        if not cfg.follow:  # --max-tokens beyond one pass: another pass over the same records
            return pool if cfg.max_tokens is not None else None
        new, seen = follow_corpora(seen, corpus_parts(cfg.corpus, growing=True, target=target))
        fresh = [r for r in new if not is_heldout(r, cfg.heldout)]
        pool.extend(fresh)
        unique += sum(len(r["output_ids"]) for r in fresh)
        train = fresh if sum(len(r["output_ids"]) for r in fresh) >= 4 * cfg.batch_tokens else pool
        log(f"followed the corpus: {len(fresh)} new training records; next pass over {len(train)} records")
        return train

    result = train_curve(
        block, opt, train, cfg, budget, [c for c in cfg.curve if c < budget] + ([] if cfg.follow else [budget]), rng,
        log, step=lambda batch: train_step(block, teacher, opt, batch, cfg, rng, pad, precision, dist),
        desc="distill", evaluate=lambda: agreement(block, teacher, held, cfg.max_len, pad), next_pass=next_pass,
        extra=lambda: {"corpus_tokens": unique},
        snapshot=lambda done: stable.update(stable_state(block, opt, before + done, record)), dist=dist)
    for p in block.parameters():
        p.requires_grad_(False)
    manifest = {"what": "LongSpec block distilled on the target's own outputs (FR-Spec draft vocabulary)",
                "config": asdict(cfg), "target": {"name": cfg.target, "path": getattr(target, "path", None)},
                "target_identity": record,
                "corpus": {"path": cfg.corpus, "records": sum(seen.values()), "heldout_records": len(held)},
                "draft_vocab": block.draft_vocab_size, "heldout_coverage": held_coverage, "precision": precision,
                **result, **chain_fields(previous, before, result["tokens_seen"]), **dist.manifest()}
    if dist.main:
        save_block(block, target, manifest, Path(cfg.out), cfg.storage,
                   extra=(lambda d: save_stable_state(stable, d)) if stable else None)
    dist.barrier()
    return manifest


def describe_curve(manifest: dict) -> str:
    rows = ["| tokens trained | corpus tokens | chat | code | all | KL |", "|" + " ---: |" * 6]
    for c in manifest["curve"]:
        rows.append(f"| {c['tokens']:,} | {c.get('corpus_tokens', c['tokens']):,} | {c.get('chat', math.nan):.3f} | "
                    f"{c.get('code', math.nan):.3f} | {c['all']:.3f} | {c.get('loss', '')} |")
    return "\n".join(rows)
