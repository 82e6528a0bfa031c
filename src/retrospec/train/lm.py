"""A small, CPU-friendly causal-LM training loop for the zoo (and for users' own tiny models).

Two modes:
- language modelling: cross-entropy on the next token;
- distillation: the student (draft, q) matches a frozen teacher's (target, p) full next-token distribution with
  forward KL(p || q), mixed with a little cross-entropy. Acceptance in speculative decoding is
  ``sum_x min(p(x), q(x)) = 1 - TV(p, q)``, so matching p directly is what makes a draft useful.

Invariants: batches are drawn from a seeded generator over one token stream; the learning-rate schedule depends
only on the token budget, so a build is reproducible given the seed (up to float non-associativity).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .common import adamw, optimizer_step, set_lr, warmup_cosine


@dataclass
class TrainConfig:
    tokens: int  # token budget (sequence positions seen)
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    distill_alpha: float = 0.9  # weight of KL(p || q) when a teacher is given; rest is cross-entropy
    log_every: int = 25


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    losses: list[float] = field(default_factory=list)


Streams = np.ndarray | list[tuple[np.ndarray, float]]


def _batch(streams: list[np.ndarray], weights: np.ndarray, gen: np.random.Generator,
           cfg: TrainConfig) -> torch.Tensor:
    """Random windows [batch, seq_len + 1]; each row's source stream is drawn with the mixture weights."""
    rows = []
    for src in gen.choice(len(streams), size=cfg.batch_size, p=weights):
        start = int(gen.integers(0, len(streams[src]) - cfg.seq_len - 1))
        rows.append(streams[src][start : start + cfg.seq_len + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def train_lm(model: torch.nn.Module, stream: Streams, cfg: TrainConfig, teacher: torch.nn.Module | None = None,
             desc: str = "train") -> TrainResult:
    """Train ``model`` in place for ``cfg.tokens`` tokens on random windows of ``stream`` (1-D token ids), or of
    a weighted mixture ``[(stream, weight), ...]``."""
    pairs = [(stream, 1.0)] if isinstance(stream, np.ndarray) else list(stream)
    for s, _ in pairs:
        if len(s) <= cfg.seq_len + 1:
            raise ValueError(f"token stream of {len(s)} tokens is shorter than seq_len + 1 = {cfg.seq_len + 1}")
    streams, weights = [s for s, _ in pairs], np.array([w for _, w in pairs], dtype=np.float64)
    weights /= weights.sum()
    torch.manual_seed(cfg.seed)
    gen = np.random.default_rng(cfg.seed)
    opt = adamw(model.parameters(), cfg.lr, cfg.weight_decay)
    total_steps = max(1, cfg.tokens // (cfg.batch_size * cfg.seq_len))
    model.train()
    if teacher is not None:
        teacher.eval()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(total_steps), desc=desc, unit="step", dynamic_ncols=True)
    running = None
    for step in bar:
        set_lr(opt, warmup_cosine(step, total_steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio))
        rows = _batch(streams, weights, gen, cfg)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=inputs).logits  # [batch, seq, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if teacher is not None:
            with torch.no_grad():
                p_logits = teacher(input_ids=inputs).logits  # [batch, seq, vocab]
            kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(p_logits, -1).flatten(0, 1),
                          log_target=True, reduction="batchmean")
            loss = cfg.distill_alpha * kl + (1 - cfg.distill_alpha) * loss
        value = optimizer_step(opt, loss, model.parameters(), cfg.grad_clip)
        running = value if running is None else 0.98 * running + 0.02 * value
        if step % cfg.log_every == 0 or step == total_steps - 1:
            losses.append(running)
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{running:.3f}", tok_s=f"{(step + 1) * cfg.batch_size * cfg.seq_len / elapsed:.0f}")
    model.eval()
    return TrainResult(steps=total_steps, tokens=total_steps * cfg.batch_size * cfg.seq_len,
                       seconds=time.perf_counter() - t0, final_loss=running if running is not None else float("nan"),
                       losses=losses)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, stream: np.ndarray, seq_len: int = 512, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy over up to ``max_windows`` consecutive windows of ``stream``."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n == 0:
        return float("nan")
    total = 0.0
    for i in range(n):
        rows = torch.from_numpy(stream[i * seq_len : (i + 1) * seq_len + 1].astype(np.int64))[None]
        total += float(F.cross_entropy(model(input_ids=rows[:, :-1]).logits[0], rows[0, 1:]))
    return total / n
