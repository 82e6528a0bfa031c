"""Training a LongSpec draft block (``retrospec train longspec``) and measuring it by position
(``retrospec train longspec-eval``).

Paper: Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and Verification"
(sail-sg, 2025). The block (``models.longspec``) sits between the target's frozen embedding and head and
cross-attends to the target's last-layer K/V. Training, per batch of token windows ``ids`` [b, L]:

1. positions [b, L]: 0..L-1, or **anchor-offset** positions: the first s in [0, 4] tokens keep positions 0..s-1 (the
   attention sinks), the rest are shifted by o in [0, max_positions - L], so a block trained on short windows sees
   the large position indices of long contexts;
2. the frozen target runs over ``ids`` at those positions with a KV cache (``kv.KVCache``) and hands over its last
   layer's cached (keys, values), post-RoPE at those positions;
3. **flash-noisy** training: one shift delta in [1, noisy_max] per batch; query i sees the target's K/V at indices
   j <= i - delta only (delta = 1 is inference: the cache holds every committed token but the newest);
4. loss: next-token cross-entropy of the block's logits (through the target's frozen head).

Visibility is by INDEX in the window for the cross-attention (``cross_visible``; with anchor-offset positions index
and position differ) and by position for the block's sliding window (``self_visible``, as at inference). Long
evaluation sequences run in chunks of queries (a token's self-attention K/V depend only on token and position, so a
chunk's past keys are ``token_kv`` of the window before it: chunked equals unchunked, tested).

Optimiser as the paper: AdamW, lr 5e-4, betas (0.9, 0.95), weight decay 0.1 on weight matrices, cosine schedule to 0
with 10 % linear warm-up (over elapsed time with a ``seconds`` budget), gradient clipping at 1.0.

Data: windows at uniform random starts of a token stream (documents joined by EOS) from the stdlib's training split
(its held-out packages never enter training) or any ``--corpus`` the datastores take. Output (atomic): a block
directory ``load_longspec`` reads, plus ``manifest.json`` (data, seed, steps, tokens, seconds, loss history, config).

Evaluation: the block's loss per position bucket on long held-out documents (delta = 1), next to the target's own
loss and their top-1 agreement; the target's loss with normal vs anchor-offset positions (the paper: +0.001).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..atomic import atomic_build
from ..errors import RetrospecError
from ..kv import KVCache
from ..models.longspec import LongSpecDraft, cross_visible, save_longspec, self_visible
from ..models.loading import as_module
from ..models.longspec.checkpoint import META_FILE
from ..stdlib_corpus import HELDOUT_PACKAGES, read_texts, stdlib_files
from .common import (adamw, check_budget, check_new, jsonable, optimizer_step, resolve_device, set_lr, warmup_cosine,
                     write_json)

MANIFEST = "manifest.json"
MAX_ANCHOR = 4
LOG_SECONDS = 60.0  # progress line interval when stderr is not a terminal (tqdm then stays silent)


@dataclass
class LongSpecTrainConfig:
    target: str  # a model name (``zoo``) or checkpoint directory
    out: str  # block directory to create
    corpus: str | None = None  # None: the stdlib training split; else a text file, a directory or a .jsonl file
    seq_len: int = 1024
    batch: int = 1
    anchor_offset: bool = True
    max_anchor: int = MAX_ANCHOR
    max_positions: int | None = None  # None: the target's max_position_embeddings
    noisy_max: int = 4  # shift delta in [1, noisy_max] per batch (1: no noise)
    steps: int | None = None  # exactly one of steps / seconds
    seconds: float | None = None
    device: str = "cpu"
    window: int = 512  # the block's sliding self-attention window
    lr: float = 5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = 0.1  # share of the schedule spent warming up
    grad_clip: float = 1.0
    init: str = "identity"  # "identity" or "random" (LongSpecDraft.reset_parameters)
    intermediate_size: int | None = None  # the block's MLP width (None: the target's)
    seed: int = 0
    log_every: int = 10


# ------------------------------------------------------------------------------------------------ positions, shift


def _randint(rng, low: int, high: int) -> int:
    """An integer in [low, high] from a ``random.Random`` or a ``numpy.random.Generator``."""
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(low, high + 1))
    return rng.randint(low, high)


def anchor_offset_positions(length: int, max_positions: int, rng, max_anchor: int = MAX_ANCHOR) -> torch.Tensor:
    """Anchor-offset position ids [L] (LongTensor): s in [0, min(max_anchor, L)] random anchors keep positions
    0..s-1, the other tokens follow contiguously from s + o, o in [0, max_positions - L] random; so every position
    is < ``max_positions``. ``rng``: ``random.Random`` or ``numpy.random.Generator``."""
    if length < 1 or max_positions < length:
        raise ValueError(f"need 1 <= length <= max_positions, got length {length}, max_positions {max_positions}")
    s = _randint(rng, 0, min(max_anchor, length))
    o = _randint(rng, 0, max_positions - length)
    pos = torch.arange(length, dtype=torch.long)
    pos[s:] += o
    return pos


def sample_positions(batch: int, length: int, max_positions: int, rng, anchor_offset: bool = True,
                     max_anchor: int = MAX_ANCHOR) -> torch.Tensor:
    """Position ids [b, L] of one training batch: anchor-offset rows, or 0..L-1 in every row when off."""
    if not anchor_offset:
        return torch.arange(length, dtype=torch.long)[None].repeat(batch, 1)
    return torch.stack([anchor_offset_positions(length, max_positions, rng, max_anchor) for _ in range(batch)])


def sample_shift(rng, noisy_max: int) -> int:
    """The flash-noisy shift delta of one batch, uniform in [1, noisy_max] (noisy_max = 1: always 1)."""
    if noisy_max < 1:
        raise ValueError(f"noisy_max must be >= 1, got {noisy_max}")
    return _randint(rng, 1, noisy_max)


# ------------------------------------------------------------------------------------------------ target and block


@torch.no_grad()
def target_logits(target, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                  head: bool = True, layers: tuple[int, ...] = ()) -> tuple:
    """The frozen target over ``ids`` [b, L] at ``positions`` [b, L], one ``use_cache=True`` forward: (logits
    [b, L, V], or with ``head=False`` its decoder's final hidden states [b, L, H]; its last layer's cached (keys,
    values), each [b, kv_heads, L, head_dim], post-RoPE); with ``layers`` also the outputs of those decoder layers
    [b, L, n, H] (a block's ``target_feature`` input). ``mask`` [b, L]: 1 on real tokens (right padding)."""
    model = as_module(target)
    cache = KVCache(model)
    # an explicit attention mask and a cache: transformers then never reads a position jump as the start of a
    # packed sequence (it would hide the anchors from the other tokens)
    out = (model if head else model.get_decoder())(
        input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids) if mask is None else mask,
        past_key_values=cache.cache, use_cache=True, output_hidden_states=bool(layers))
    main = (out.logits if head else out.last_hidden_state, cache.layer_tensors()[-1])
    if not layers:
        return main
    return (*main, torch.stack([out.hidden_states[i + 1] for i in layers], dim=2))  # entry i + 1: layer i's output


def target_last_kv(target, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's last-layer cached (keys, values) over ``ids`` (its decoder only, no LM head)."""
    return target_logits(target, ids, positions, head=False)[1]


def draft_logits(draft: LongSpecDraft, ids: torch.Tensor, positions: torch.Tensor,
                 target_kv: tuple[torch.Tensor, torch.Tensor] | None, shift: int | torch.Tensor = 1,
                 chunk: int | None = None, feature: torch.Tensor | None = None, outputs: bool = False):
    """The block's logits [b, L, V] over a window ``ids`` [b, L] at ``positions`` [b, L], the target's K/V of the
    same window at index j visible to query i iff j <= i - shift (by index), the block's own keys per
    ``self_visible`` (by position) and causality. ``chunk``: queries per block forward (None: all at once).
    ``feature`` [b, L, H]: each query's feature (a block with ``features``); ``outputs``: return (logits, the block's
    outputs [b, L, H]) instead."""
    b, n = ids.shape
    idx = torch.arange(n, device=ids.device)[None].expand(b, n)  # [b, L]
    length = 0 if target_kv is None else target_kv[0].shape[2]
    step = n if chunk is None else max(1, int(chunk))
    out = []
    for a in range(0, n, step):
        e = min(n, a + step)
        q_pos = positions[:, a:e]  # [b, c]
        own = self_visible(q_pos, q_pos, draft.window) & torch.ones(e - a, e - a, dtype=torch.bool,
                                                                   device=ids.device).tril()
        past = past_allowed = None
        p0 = max(0, a - draft.window + 1)  # positions grow at least as fast as indices: older keys are out of window
        if p0 < a:
            past = draft.token_kv(ids[:, p0:a], positions[:, p0:a])
            past_allowed = self_visible(q_pos, positions[:, p0:a], draft.window)  # [b, c, a - p0]
        sh = shift[..., a:e] if isinstance(shift, torch.Tensor) and shift.dim() and shift.shape[-1] == n else shift
        cross = None if target_kv is None else cross_visible(idx[:, a:e], length, sh)
        f = None if feature is None else feature[:, a:e]
        logits, _, _, x = draft.run(ids[:, a:e], q_pos, own, past, past_allowed, target_kv, cross, f)
        out.append((logits, x))
    logits, x = (torch.cat(parts, 1) for parts in zip(*out))
    return (logits, x) if outputs else logits


def draft_token_losses(draft: LongSpecDraft, ids: torch.Tensor, positions: torch.Tensor,
                       target_kv: tuple[torch.Tensor, torch.Tensor] | None, shift: int | torch.Tensor = 1,
                       chunk: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy [b, L - 1] of the block: query i (0..L-2) predicting ``ids[:, i + 1]``."""
    logits = draft_logits(draft, ids, positions, target_kv, shift, chunk)[:, :-1]  # [b, L - 1, V]
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)


# ------------------------------------------------------------------------------------------------------------ data


def corpus_texts(spec: str | None, split: str = "train") -> tuple[list[str], dict]:
    """(texts, description) of a corpus: None = the stdlib ``split`` (``train`` or ``heldout``), else anything the
    datastores' ``--corpus`` takes (``retrieval.corpus.open_text_corpus``: a text file, a ``.jsonl`` file with a
    ``text`` field (or ``prompt`` + ``completion``) per line, or a directory, recursively, in sorted order)."""
    import sys

    if spec is None:
        texts = read_texts(stdlib_files(split))
        return texts, {"source": f"python {sys.version_info.major}.{sys.version_info.minor} stdlib, {split} split",
                       "files": len(texts), "packages" if split == "heldout" else "excluded_packages":
                       list(HELDOUT_PACKAGES)}
    from ..retrieval.corpus import open_text_corpus  # lazy: the datastores' corpus reader

    path = Path(spec).expanduser()
    texts = [t for t in open_text_corpus(str(path)) if t.strip()]
    if not texts:
        raise RetrospecError(f"--corpus {spec} holds no readable text")
    kind = "directory" if path.is_dir() else "jsonl" if path.suffix == ".jsonl" else "text file"
    return texts, {"source": str(path), "kind": kind, "documents": len(texts)}


def token_stream(tok, spec: str | None, split: str = "train") -> tuple[np.ndarray, dict]:
    """The corpus as one token stream (EOS after each document) and its description (with the token count)."""
    from .zoo import _encode_stream  # the zoo's: batched encoding, EOS after each document

    texts, desc = corpus_texts(spec, split)
    stream = _encode_stream(tok, texts)
    return stream, desc | {"tokens": int(len(stream))}


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    """``batch`` windows [b, L] of ``stream`` at uniform random starts."""
    starts = rng.integers(0, len(stream) - length + 1, size=batch)
    return torch.from_numpy(np.stack([stream[s: s + length] for s in starts]).astype(np.int64))


def long_documents(stream: np.ndarray, n: int, length: int) -> list[torch.Tensor]:
    """Up to ``n`` consecutive, non-overlapping windows of ``length`` tokens from the start of ``stream`` (held-out
    files joined: long sequences made of many files)."""
    return [torch.from_numpy(stream[i * length: (i + 1) * length].astype(np.int64))
            for i in range(min(n, len(stream) // length))]


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """[b, L, H] -> [b, L, H]: entry i is x's entry i - 1 (zeros at 0: nothing added there)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)


def feature_passes(block: LongSpecDraft, ids: torch.Tensor, positions: torch.Tensor, target_kv,
                   states: torch.Tensor | None, shift: int, passes: int) -> list[torch.Tensor]:
    """A feature block's logits [b, L, K] at each of ``passes`` drafting depths (training-time test, EAGLE-3: Li et
    al. 2025). Depth 1 reads the target's fused feature of the position before each query (``states`` [b, L, n, H]:
    the target's outputs of the block's layers; the target's K/V up to ``shift`` tokens back); depth d > 1 reads the
    block's own depth d - 1 output of the position before (below a drafted parent: the K/V one token further back).
    A block without features: its plain forward at ``shift`` (``states`` unused)."""
    if not block.features:  # a block without features: its one forward
        return [draft_logits(block, ids, positions, target_kv, shift)]
    feature = shift_right(block.target_feature(states.to(block.norm1.weight.dtype)))  # [b, L, H]
    out = []
    for d in range(passes):
        logits, x = draft_logits(block, ids, positions, target_kv, shift + d, feature=feature, outputs=True)
        out.append(logits)
        feature = shift_right(x)
    return out


# -------------------------------------------------------------------------------------------------------- training


def check_config(cfg: LongSpecTrainConfig) -> None:
    """Refuse bad knobs (one ``RetrospecError`` line) before anything is loaded."""
    check_budget(cfg.steps, cfg.seconds)
    for name, value, low in (("seq-len", cfg.seq_len, 2), ("batch", cfg.batch, 1), ("noisy-max", cfg.noisy_max, 1),
                             ("window", cfg.window, 1), ("intermediate-size", cfg.intermediate_size, 1)):
        if value is not None and value < low:
            raise RetrospecError(f"--{name} must be at least {low}, got {value}")
    if not cfg.lr > 0:
        raise RetrospecError(f"--lr must be positive, got {cfg.lr}")
    if cfg.init not in ("identity", "random"):
        raise RetrospecError(f"--init must be identity or random, got {cfg.init!r}")
    if cfg.max_anchor < 0 or not 0 <= cfg.warmup < 1 or cfg.log_every < 1:
        raise RetrospecError("max_anchor must be >= 0, warmup in [0, 1), log_every >= 1")
    if cfg.corpus is not None and not Path(cfg.corpus).expanduser().exists():
        raise RetrospecError(f"--corpus not found: {cfg.corpus}")
    check_new(cfg.out)


def train_longspec(cfg: LongSpecTrainConfig, log=print, target=None, stream: np.ndarray | None = None,
                   data: dict | None = None) -> dict:
    """Train a block for ``cfg.target`` and save it to ``cfg.out``; returns the manifest. ``target`` (a loaded
    model) and ``stream`` (token ids) replace loading / tokenizing when given (tests)."""
    from ..models.loading import load_model

    check_config(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    loaded = load_model(target if target is not None else cfg.target, device=device)
    model = as_module(loaded)
    max_positions = cfg.max_positions or getattr(model.config, "max_position_embeddings", None) or cfg.seq_len
    if cfg.seq_len > max_positions:
        raise RetrospecError(f"--seq-len {cfg.seq_len} exceeds the target's {max_positions} positions")
    if stream is None:
        if loaded.tokenizer is None:
            raise RetrospecError(f"target {loaded.path} has no tokenizer to encode the corpus with")
        t0 = time.perf_counter()
        stream, data = token_stream(loaded.tokenizer, cfg.corpus)
        log(f"longspec: corpus {data['source']}: {len(stream):,} tokens (encoded in {time.perf_counter() - t0:.0f} s)")
    data = dict(data or {"source": "<token stream>", "tokens": int(len(stream))})
    if len(stream) < cfg.seq_len:
        raise RetrospecError(f"the corpus has {len(stream)} tokens, fewer than --seq-len {cfg.seq_len}")

    block = LongSpecDraft.for_target(model, window=cfg.window, init=cfg.init,
                                     intermediate_size=cfg.intermediate_size).train()
    opt = adamw(block.parameters(), cfg.lr, cfg.weight_decay, betas=tuple(cfg.betas))
    rng = np.random.default_rng(cfg.seed)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)  # the shared embedding and head stay frozen: no gradient is ever stored for them
    history, window_losses, shifts, running = [], [], [], None
    step, tokens, started = 0, 0, time.perf_counter()
    last_line = started
    bar = tqdm(total=cfg.steps or int(cfg.seconds), desc="train longspec", unit="step" if cfg.steps else "s",
               dynamic_ncols=True, disable=None)

    def record() -> None:
        history.append({"step": step, "loss": round(float(np.mean(window_losses)), 4),
                        "seconds": round(time.perf_counter() - started, 1), "lr": float(f"{lr:.3g}")})
        window_losses.clear()

    try:
        while True:
            elapsed = time.perf_counter() - started
            if (cfg.steps is not None and step >= cfg.steps) or (cfg.seconds is not None and elapsed >= cfg.seconds):
                break
            if cfg.steps is not None:
                progress = (step + 0.5) / cfg.steps
            else:  # the middle of this step, in elapsed time at the pace so far
                pace = elapsed / step if step else 0.0
                progress = max((elapsed + 0.5 * pace) / cfg.seconds, 0.01 * cfg.warmup)
            lr = set_lr(opt, warmup_cosine(min(1.0, max(0.0, progress)), 1.0, cfg.lr, cfg.warmup, ramp=0))
            ids = random_windows(stream, cfg.batch, cfg.seq_len, rng).to(device)  # [b, L]
            pos = sample_positions(cfg.batch, cfg.seq_len, max_positions, rng, cfg.anchor_offset,
                                   cfg.max_anchor).to(device)  # [b, L]
            shift = sample_shift(rng, cfg.noisy_max)
            loss = draft_token_losses(block, ids, pos, target_last_kv(model, ids, pos), shift).mean()
            value = optimizer_step(opt, loss, block.parameters(), cfg.grad_clip)
            step += 1
            tokens += ids.numel()
            window_losses.append(value)
            shifts.append(shift)
            if len(window_losses) == cfg.log_every:
                record()
            running = value if running is None else 0.95 * running + 0.05 * value
            bar.set_postfix(loss=f"{running:.3f}", delta=shift)
            if bar.disable and time.perf_counter() - last_line >= LOG_SECONDS:  # no terminal: a line a minute
                last_line = time.perf_counter()
                log(f"longspec: step {step}, {tokens:,} tokens, {last_line - started:.0f} s, loss {running:.3f}, "
                    f"lr {lr:.2e}")
            bar.update(1 if cfg.steps else int(time.perf_counter() - started) - bar.n)
    finally:
        bar.close()
        for p, flag in frozen:
            p.requires_grad_(flag)
    if window_losses:
        record()
    seconds = time.perf_counter() - started
    block.eval()
    manifest = {
        "what": "LongSpec draft block (Yang et al. 2025): one block, cross-attention to the target's last-layer KV",
        "target": {"name": cfg.target, "path": loaded.path}, "data": data,
        "config": jsonable(cfg) | {"max_positions": max_positions},
        "seed": cfg.seed, "steps": step, "tokens_seen": tokens, "seconds": round(seconds, 1),
        "shift_counts": {str(d): shifts.count(d) for d in range(1, cfg.noisy_max + 1)},
        "loss_first": history[0]["loss"] if history else None, "loss_last": history[-1]["loss"] if history else None,
        "loss_history": history, "device": str(device), "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    save_block(block, loaded, manifest, Path(cfg.out).expanduser())
    log(f"longspec: {step} steps, {tokens:,} tokens in {seconds:.0f} s; loss {manifest['loss_first']} -> "
        f"{manifest['loss_last']}; saved {cfg.out}")
    return manifest


def save_block(block: LongSpecDraft, target, manifest: dict, out: Path, storage: str | None = None,
               extra: Callable[[Path], None] | None = None) -> Path:
    """``save_longspec`` (weights in ``storage``) plus ``manifest.json`` and whatever ``extra(directory)`` writes,
    written into a temporary sibling and renamed into place (``atomic.atomic_build``: nothing at ``out`` on
    failure)."""
    with atomic_build(out, required=META_FILE) as tmp:
        save_longspec(block, target, tmp, target_path=getattr(target, "path", None), overwrite=True, storage=storage)
        write_json(tmp / MANIFEST, manifest)
        if extra is not None:
            extra(tmp)
    return out


# ------------------------------------------------------------------------------------------------------ evaluation


def _docs(docs, max_len: int) -> list[torch.Tensor]:
    out = [torch.as_tensor(d, dtype=torch.long).reshape(-1)[:max_len] for d in docs]
    out = [d for d in out if d.numel() >= 2]
    if not out:
        raise RetrospecError("no evaluation document has 2 tokens or more")
    return out


@torch.no_grad()
def evaluate_position_buckets(draft: LongSpecDraft, target, docs, bucket: int = 1024, max_len: int = 8192,
                              anchor: bool = False, seed: int = 0, chunk: int = 1024) -> list[dict]:
    """The block's mean next-token loss per position bucket ([0, bucket), [bucket, 2 bucket), ...) over ``docs``
    (token id sequences, cut to ``max_len``), shift 1 (inference). Each bucket: ``start``, ``end``, ``tokens``,
    ``draft_loss``, ``target_loss`` (the target's own loss on the same tokens) and ``agree`` (share of positions
    where the block's argmax is the target's). ``anchor``: run both at anchor-offset positions (seeded)."""
    model = as_module(target)
    device = model.get_input_embeddings().weight.device
    rng = np.random.default_rng(seed)
    n_buckets = math.ceil((max_len - 1) / bucket)
    sums = np.zeros((3, n_buckets))
    counts = np.zeros(n_buckets)
    was_training = draft.training
    draft.eval()
    try:
        for doc in _docs(docs, max_len):
            ids = doc[None].to(device)  # [1, L]
            n = ids.shape[1]
            pos = (anchor_offset_positions(n, getattr(model.config, "max_position_embeddings", None) or n, rng)
                   if anchor else torch.arange(n))[None].to(device)
            t_logits, kv = target_logits(model, ids, pos)
            d_logits = draft_logits(draft, ids, pos, kv, 1, chunk)
            gold = ids[0, 1:]
            d_loss = F.cross_entropy(d_logits[0, :-1].float(), gold, reduction="none")
            t_loss = F.cross_entropy(t_logits[0, :-1].float(), gold, reduction="none")
            agree = (d_logits[0, :-1].argmax(-1) == t_logits[0, :-1].argmax(-1)).float()
            which = torch.arange(gold.numel()) // bucket  # [L - 1]
            for j in range(int(which.max()) + 1):
                sel = (which == j).to(device)
                counts[j] += int(sel.sum())
                for r, v in enumerate((d_loss, t_loss, agree)):
                    sums[r, j] += float(v[sel].sum())
    finally:
        draft.train(was_training)
    out = []
    for j in range(n_buckets):
        if counts[j]:
            d, t, a = sums[:, j] / counts[j]
            out.append({"start": j * bucket, "end": min((j + 1) * bucket, max_len), "tokens": int(counts[j]),
                        "draft_loss": round(float(d), 4), "target_loss": round(float(t), 4),
                        "agree": round(float(a), 4)})
    return out


@torch.no_grad()
def target_loss_under_offset(target, docs, max_len: int = 8192, seed: int = 0, max_anchor: int = MAX_ANCHOR,
                             max_positions: int | None = None) -> dict:
    """The target's mean next-token loss on ``docs`` with positions 0..L-1 (``normal``) and with anchor-offset
    positions (``anchor_offset``, seeded), and their difference (``delta``; the paper reports +0.001)."""
    model = as_module(target)
    device = model.get_input_embeddings().weight.device
    limit = max_positions or getattr(model.config, "max_position_embeddings", None)
    rng = np.random.default_rng(seed)
    totals, count, offsets = [0.0, 0.0], 0, []
    for doc in _docs(docs, max_len):
        ids = doc[None].to(device)
        n = ids.shape[1]
        shifted = anchor_offset_positions(n, limit or n, rng, max_anchor)
        offsets.append(int(shifted[-1]) - (n - 1))
        for r, pos in enumerate((torch.arange(n), shifted)):
            logits, _ = target_logits(model, ids, pos[None].to(device))
            totals[r] += float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
        count += n - 1
    normal, shifted_loss = totals[0] / count, totals[1] / count
    return {"normal": round(normal, 4), "anchor_offset": round(shifted_loss, 4),
            "delta": round(shifted_loss - normal, 4), "tokens": count, "offsets": offsets}


def evaluate_drafts(target: str, drafts: list[str], docs: int = 4, seq_len: int = 8192, bucket: int = 1024,
                    corpus: str | None = None, device: str = "cpu", anchor: bool = False, seed: int = 0,
                    check_target: bool = True, log=print) -> dict:
    """``retrospec train longspec-eval``: every block's position buckets and the target's offset check on ``docs``
    long documents (held-out stdlib files joined, or ``corpus``)."""
    from ..models.loading import load_model
    from ..models.longspec import load_longspec, read_meta

    if docs < 1 or seq_len < 2 or bucket < 1:
        raise RetrospecError("--docs and --bucket must be >= 1 and --seq-len >= 2")
    for d in drafts:
        read_meta(Path(d).expanduser())  # a missing or corrupt block directory fails before anything is loaded
    loaded = load_model(target, device=resolve_device(device))
    model = as_module(loaded)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise RetrospecError(f"--seq-len {seq_len} exceeds the target's {limit} positions")
    blocks = [(d, load_longspec(Path(d).expanduser(), loaded)) for d in drafts]
    if loaded.tokenizer is None:
        raise RetrospecError(f"target {loaded.path} has no tokenizer to encode the documents with")
    stream, data = token_stream(loaded.tokenizer, corpus, split="heldout")
    documents = long_documents(stream, docs, seq_len)
    if not documents:
        raise RetrospecError(f"the evaluation corpus has {len(stream)} tokens, fewer than --seq-len {seq_len}")
    if len(documents) < docs:
        log(f"longspec-eval: only {len(documents)} documents of {seq_len} tokens in the corpus (asked {docs})")
    result = {"target": {"name": target, "path": loaded.path}, "data": data | {"documents_used": len(documents),
              "seq_len": seq_len}, "bucket": bucket, "anchor": anchor, "drafts": {}}
    for name, block in blocks:
        t0 = time.perf_counter()
        result["drafts"][name] = evaluate_position_buckets(block, loaded, documents, bucket, seq_len, anchor, seed)
        log(f"longspec-eval: {name} in {time.perf_counter() - t0:.0f} s")
    if check_target:
        result["target_offset_check"] = target_loss_under_offset(loaded, documents, seq_len, seed)
    return result


def format_buckets(rows: list[dict]) -> str:
    """A plain-text table of ``evaluate_position_buckets`` rows."""
    lines = [f"{'positions':>13}  {'tokens':>7}  {'draft loss':>10}  {'target loss':>11}  {'agree':>6}"]
    for r in rows:
        span = f"{_k(r['start'])}-{_k(r['end'])}"
        lines.append(f"{span:>13}  {r['tokens']:>7}  {r['draft_loss']:>10.4f}  {r['target_loss']:>11.4f}  "
                     f"{r['agree']:>6.3f}")
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)
