"""A draft model for a real target: target-initialised blocks, a reduced vocabulary, distilled on the target's
own distributions (``retrospec zoo real-draft``; the first stage of the bundled ``smollm2-135m-draft``).

Why this shape. On a CPU a 135M target spends a large share of its forward in the 49,152-wide LM head; a small
draft with that head would cost almost a third of the target per token. The draft here therefore:

- keeps the target's width and copies ``layers`` of its decoder blocks (early-exit initialisation: it starts as a
  truncated target rather than from noise, which matters when training has minutes of CPU);
- proposes only from a **reduced vocabulary**: the ``vocab`` most frequent target tokens of its training text
  (chat-template specials always included), embedding/head rows copied from the target's. ``draft_vocab.json`` maps
  each draft row to its target id; q = 0 on every other token, so rejection sampling against p stays exact (the
  drafter scatters q into the target vocabulary); input tokens outside it are read as row 0 (target token 0);
- is distilled with forward KL(p_V || q), p_V = the target's next-token distribution renormalised over the draft
  vocabulary (the best a draft restricted to V can do for sum_x min(p, q)).

Training text (what the draft meets at inference): the stdlib's training split (code), prose and questions from a
passage corpus (NQ-open rows from ``nq_skip`` on: the first rows are the benchmark's), and the target's own greedy
answers to chat prompts and continuations of code prefixes (sequence-level distillation).

Invariants: the saved directory is an ordinary Hugging Face checkpoint (float16) plus ``draft_vocab.json`` (the
draft reads and writes target ids, so it ships no tokenizer: the target's is used) and ``real_draft.json`` (recipe,
data, time, metrics, and ``target_identity``: ``identity.target_record`` of the target); it is written atomically,
so a failed build leaves nothing at ``out``.
"""

from __future__ import annotations

import collections
import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..atomic import atomic_build
from ..batched import generate_batch
from ..errors import RetrospecError
from ..identity import target_record
from ..models.vocab import VocabMap
from ..speculative_rag.data import read_passages, read_questions
from .common import adamw, jsonable, kl, optimizer_step, set_lr, set_threads, warmup_cosine, write_json

# chat prompts the draft is trained on (the target answers them); the bench's and demo's prompts are not here
_TRAIN_INSTRUCTIONS = [
    "Explain what a {x} is in two sentences.", "Give three tips for {y}.", "Write a short poem about {x}.",
    "What are the main differences between {x} and {z}?", "Summarize the history of {x} briefly.",
    "How do I get started with {y}?", "List five facts about {x}.", "Why is {x} important?",
    "Write a Python function that {f}.", "Describe {x} to a ten-year-old.",
]
_X = ["volcano", "photosynthesis", "the internet", "a black hole", "democracy", "the Roman Empire", "a compiler",
      "the moon", "jazz", "a neural network", "the ocean", "coffee", "a rainbow", "electricity", "gravity",
      "the printing press", "a bicycle", "vaccines", "chess", "the Amazon rainforest", "a database", "tea",
      "glaciers", "the stock market", "bees", "a telescope", "recycling", "the Olympic Games", "bread", "music"]
_Y = ["learning a new language", "staying focused", "saving money", "running a marathon", "writing an essay",
      "cooking rice", "public speaking", "sleeping better", "learning to code", "gardening", "traveling cheaply",
      "reading more books", "managing time", "taking photos", "making friends in a new city"]
_F = ["reverses a string", "checks if a number is prime", "returns the largest element of a list",
      "counts the vowels in a string", "merges two sorted lists", "computes the factorial of n",
      "removes duplicates from a list", "converts Celsius to Fahrenheit", "finds the GCD of two numbers",
      "checks whether a string is a palindrome", "sums the digits of an integer", "flattens a nested list"]


@dataclass
class RealDraftConfig:
    out: Path
    target: str = "smollm2-135m"
    layers: tuple[int, ...] = (0, 1)
    vocab: int = 12288
    seconds: float = 2000.0  # draft training on the cached soft labels
    teacher_seconds: float = 1400.0  # target forwards producing the soft labels
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    seed: int = 0
    nq_dir: Path | None = None  # a directory with passages.jsonl / questions.jsonl (NQ-open)
    nq_skip: int = 200  # rows kept out of training (benchmarks use the first rows)
    chat_answers: int = 0  # target-generated chat answers (sequence-level distillation; slow on a CPU)
    code_continuations: int = 0  # target continuations of stdlib prefixes (likewise)
    gen_tokens: int = 128
    threads: int = 0
    mix: dict = field(default_factory=lambda: {"code": 0.35, "prose": 0.15, "chatqa": 0.2, "chat": 0.2,
                                               "selfcode": 0.1})


# ----------------------------------------------------------------------------------------------------------- data


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chat_prompts(n: int, seed: int, questions: list[str]) -> list[str]:
    """``n`` user prompts: templated instructions and (when given) corpus questions, deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if questions and i % 2 == 1:
            q = questions[rng.randrange(len(questions))]
            out.append(q[0].upper() + q[1:] + ("?" if not q.endswith("?") else ""))
        else:
            t = rng.choice(_TRAIN_INSTRUCTIONS)
            out.append(t.format(x=rng.choice(_X), y=rng.choice(_Y), z=rng.choice(_X), f=rng.choice(_F)))
    return out


def target_generations(model, tok, prompts: list[list[int]], max_new: int, eos: list[int], batch: int = 16,
                       desc: str = "target generations") -> list[list[int]]:
    """Greedy continuations of each prompt (``batched.generate_batch``, ``batch`` at a time), returned as prompt +
    continuation ids (the stopping EOS included)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    out: list[list[int]] = []
    for i in tqdm(range(0, len(prompts), batch), desc=desc, unit="batch", dynamic_ncols=True):
        rows = prompts[i : i + batch]
        res = generate_batch(model, rows, max_new_tokens=max_new, eos_ids=frozenset(eos), pad_id=pad)
        out += [r + t for r, t in zip(rows, res.tokens)]
    return out


def build_streams(cfg: RealDraftConfig, target, tok, log=print) -> dict[str, np.ndarray]:
    """The training mixture as 1-D token streams (documents joined by the target's EOS)."""
    from ..stdlib_corpus import read_texts, stdlib_files

    rng = random.Random(cfg.seed)
    eos = tok.eos_token_id
    streams: dict[str, np.ndarray] = {}

    def join(docs: list[list[int]]) -> np.ndarray:
        return np.asarray([t for d in docs for t in (*d, eos)], dtype=np.int32)

    texts = read_texts(stdlib_files("train"))
    rng.shuffle(texts)
    n_prefix_files = max(1, len(texts) // 10)  # continuation prefixes come from files kept out of the code stream
    prefix_texts, texts = texts[:n_prefix_files], texts[n_prefix_files:]
    streams["code"] = join([_encode(tok, t) for t in texts])
    questions = []
    if cfg.nq_dir is not None:
        all_passages = read_passages(Path(cfg.nq_dir) / "passages.jsonl")
        qa = read_questions(Path(cfg.nq_dir) / "questions.jsonl")[cfg.nq_skip:]
        questions = [q.question for q in qa]
        streams["prose"] = join([_encode(tok, t) for t in [p.title + "\n" + p.text for p in all_passages[cfg.nq_skip:]]
                                 + questions])
    if questions and getattr(tok, "chat_template", None):
        # chat-formatted turns without generating: a corpus question, its passage as the answer (the target's soft
        # labels on it are what the draft learns; the template's tokens are what it must learn to read)
        by_id = {p.id: p.text for p in all_passages}
        turns = [[{"role": "user", "content": q.question}, {"role": "assistant", "content": by_id[q.gold_passage]}]
                 for q in qa if q.gold_passage in by_id]
        streams["chatqa"] = join([_encode(tok, tok.apply_chat_template(t, tokenize=False)) for t in turns])
    eos_ids = sorted({eos} | ({tok.convert_tokens_to_ids("<|im_end|>")} if "<|im_end|>" in tok.get_vocab() else set()))
    if cfg.chat_answers > 0 and getattr(tok, "chat_template", None):
        prompts = chat_prompts(cfg.chat_answers, cfg.seed, questions)
        enc = [_encode(tok, tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True)) for p in prompts]
        streams["chat"] = join(target_generations(target, tok, enc, cfg.gen_tokens, eos_ids, desc="chat answers"))
    if cfg.code_continuations > 0:
        prefixes = []
        for t in prefix_texts:
            ids = _encode(tok, t)
            if len(prefixes) < cfg.code_continuations and len(ids) > 96:
                start = rng.randrange(0, len(ids) - 96)
                prefixes.append(ids[start : start + rng.randrange(32, 96)])
        streams["selfcode"] = join(target_generations(target, tok, prefixes, cfg.gen_tokens, eos_ids,
                                                      desc="code continuations"))
    for k, v in streams.items():
        log(f"stream {k}: {len(v):,} tokens")
    return streams


def select_vocab(streams: dict[str, np.ndarray], weights: dict[str, float], size: int,
                 always: list[int]) -> list[int]:
    """The ``size`` most frequent target ids under the mixture weights, plus ``always``; sorted ascending."""
    counts: collections.Counter = collections.Counter()
    for name, s in streams.items():
        ids, c = np.unique(s, return_counts=True)
        scale = weights.get(name, 0.0) / max(1, len(s))
        for i, n in zip(ids.tolist(), c.tolist()):
            counts[i] += n * scale
    chosen = list(dict.fromkeys(always))
    for tok_id, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if tok_id not in chosen:
            chosen.append(tok_id)
    return sorted(chosen[:size])


# ---------------------------------------------------------------------------------------------------------- model


def blank_draft(config, n_rows: int, **changes):
    """A float32 causal LM of a copy of ``config`` with ``changes`` and ``n_rows`` vocabulary rows; its rows are
    target ids, so it has no special ids of its own."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        setattr(cfg, attr, None)
    for attr, value in {**changes, "vocab_size": n_rows}.items():
        setattr(cfg, attr, value)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def init_from_target(target, layers: tuple[int, ...], vocab_ids: list[int]):
    """A model of the target's class and width with copies of ``layers``, the final norm and the target's embedding
    (and head, when untied) rows for ``vocab_ids``."""
    n_layers = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise RetrospecError(f"draft blocks {list(layers)} must be indices of the target's {n_layers} blocks")
    tied = target.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    changes = {"num_hidden_layers": len(layers), "tie_word_embeddings": tied}
    if getattr(target.config, "layer_types", None) is not None:
        changes["layer_types"] = [target.config.layer_types[i] for i in layers]
    draft = blank_draft(target.config, len(vocab_ids), **changes)
    idx = torch.tensor(vocab_ids)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight[idx])
        base_t, base_d = target.get_decoder(), draft.get_decoder()
        for j, i in enumerate(layers):
            base_d.layers[j].load_state_dict(base_t.layers[i].state_dict())
        base_d.norm.load_state_dict(base_t.norm.state_dict())
        if not tied:
            draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight[idx])
    return draft


# ------------------------------------------------------------------------------------------------------- training


def _windows(streams: dict[str, np.ndarray], mix: dict[str, float], rng: np.random.Generator, n: int,
             seq_len: int) -> torch.Tensor:
    names = [k for k in streams if mix.get(k, 0) > 0 and len(streams[k]) > seq_len + 1]
    w = np.array([mix[k] for k in names], dtype=np.float64)
    rows = []
    for src in rng.choice(len(names), size=n, p=w / w.sum()):
        s = streams[names[src]]
        start = int(rng.integers(0, len(s) - seq_len))
        rows.append(s[start : start + seq_len])
    return torch.from_numpy(np.stack(rows).astype(np.int64))  # [n, seq_len]


def distill_loss(draft, ids: torch.Tensor, mapper: VocabMap, target_sub_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_V || q) averaged over positions; p_V = target softmax over the draft vocabulary."""
    log_q = draft(input_ids=mapper.to_draft[ids]).logits.float().log_softmax(-1)  # [B, L, Vd]
    return kl(target_sub_logits.float().log_softmax(-1), log_q).mean()


@torch.no_grad()
def evaluate(draft, target, mapper: VocabMap, batches: list[torch.Tensor]) -> dict:
    """Acceptance proxies on held-out windows: sum_x min(p, q) (sampling) and argmax agreement (greedy), with p the
    target's full distribution and q the draft's scattered into the target vocabulary; plus vocabulary coverage of
    the target's own argmax."""
    draft.eval()
    overlap = agree = cover = n = 0.0
    for ids in batches:
        hidden = target.get_decoder()(input_ids=ids).last_hidden_state  # [B, L, H]
        p = target.get_output_embeddings()(hidden).log_softmax(-1).exp()  # [B, L, V]
        q_sub = draft(input_ids=mapper.to_draft[ids]).logits.float().softmax(-1)  # [B, L, Vd]
        q = torch.zeros_like(p)
        q[..., mapper.ids] = q_sub
        overlap += float(torch.minimum(p, q).sum(-1).sum())
        top_p = p.argmax(-1)
        agree += float((mapper.ids[q_sub.argmax(-1)] == top_p).sum())
        cover += float(mapper.covered[top_p].sum())
        n += top_p.numel()
    draft.train()
    return {"min_pq": overlap / n, "greedy_agree": agree / n, "vocab_covers_target_argmax": cover / n}


def cache_teacher(target, streams: dict[str, np.ndarray], mix: dict[str, float], rng: np.random.Generator,
                  seconds: float, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the mixture and the frozen target's last hidden states over them, for ``seconds`` of target
    forwards: (ids [K, L] int64, hidden [K, L, H] float16). The draft is then trained for several epochs on this
    cache; the target's forward (about 4/5 of an online distillation step on a CPU) runs once per token."""
    ids_list, hid_list = [], []
    t0 = time.time()
    bar = tqdm(total=int(seconds), desc="target soft labels", unit="s", dynamic_ncols=True)
    with torch.no_grad():
        while time.time() - t0 < seconds:
            ids_list.append(_windows(streams, mix, rng, batch, seq_len))
            hid_list.append(target.get_decoder()(input_ids=ids_list[-1]).last_hidden_state.to(torch.float16))
            bar.n = min(int(time.time() - t0), int(seconds))
            bar.set_postfix(tokens=sum(i.numel() for i in ids_list))
    bar.close()
    return torch.cat(ids_list), torch.cat(hid_list)


def build_real_draft(cfg: RealDraftConfig, log=print) -> dict:
    """Build, train and save the draft; returns the manifest written to ``real_draft.json``."""
    from ..models import load_model

    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    loaded = load_model(cfg.target, role="target")
    target, tok = loaded.model, loaded.tokenizer
    for p in target.parameters():
        p.requires_grad_(False)
    streams = build_streams(cfg, target, tok, log)
    specials = [i for i in (tok.all_special_ids or []) if i is not None]
    vocab_ids = select_vocab(streams, cfg.mix, cfg.vocab, always=[0] + specials + [tok.eos_token_id])
    V = loaded.vocab_size
    mapper = VocabMap(vocab_ids, V)
    draft = init_from_target(target, tuple(cfg.layers), vocab_ids)
    held = {k: v[-max(len(v) // 20, cfg.seq_len + 2):] for k, v in streams.items()}  # last 5% of each stream
    train = {k: v[: len(v) - len(held[k])] for k, v in streams.items()}
    eval_batches = [_windows(held, {k: 1.0 for k in held}, np.random.default_rng(cfg.seed + 1), 4, cfg.seq_len)
                    for _ in range(2)]
    before = evaluate(draft, target, mapper, eval_batches)
    log(f"before training: {before}")
    t_data = time.time() - t_start
    rng = np.random.default_rng(cfg.seed)
    ids_all, hid_all = cache_teacher(target, train, cfg.mix, rng, cfg.teacher_seconds, cfg.batch_size, cfg.seq_len)
    head = target.get_output_embeddings().weight[mapper.ids].detach()  # [Vd, H]: p_V's logits = hidden @ head.T
    log(f"cached target hidden states for {ids_all.numel():,} tokens")
    opt = adamw(draft.parameters(), cfg.lr)
    draft.train()
    t0, step, losses, running = time.time(), 0, [], None
    order = torch.randperm(len(ids_all), generator=torch.Generator().manual_seed(cfg.seed))
    pos = 0
    bar = tqdm(total=int(cfg.seconds), desc="distil draft", unit="s", dynamic_ncols=True)
    while time.time() - t0 < cfg.seconds:
        frac = (time.time() - t0) / cfg.seconds
        set_lr(opt, warmup_cosine(step, 0, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, progress=frac))
        if pos + cfg.batch_size > len(order):  # a new epoch over the cache
            order, pos = torch.randperm(len(ids_all), generator=torch.Generator().manual_seed(cfg.seed + step)), 0
        rows = order[pos : pos + cfg.batch_size]
        pos += cfg.batch_size
        loss = distill_loss(draft, ids_all[rows], mapper, hid_all[rows].float() @ head.T)  # p_V's logits [b, L, Vd]
        value = optimizer_step(opt, loss, draft.parameters(), 1.0)
        running = value if running is None else 0.95 * running + 0.05 * value
        step += 1
        if step % 10 == 0:
            losses.append(round(running, 4))
        bar.n = min(int(time.time() - t0), int(cfg.seconds))
        bar.set_postfix(loss=f"{running:.3f}", step=step, epoch=f"{step * cfg.batch_size / len(ids_all):.1f}")
    bar.close()
    draft.eval()
    after = evaluate(draft, target, mapper, eval_batches)
    log(f"after training: {after}")
    manifest = {"kind": "retrospec real-model draft", "config": jsonable(cfg), "target": loaded.path,
                "target_identity": target_record(target, tok, loaded.path),
                "draft_params": sum(p.numel() for p in draft.parameters()),
                "streams": {k: int(len(v)) for k, v in streams.items()}, "teacher_tokens": int(ids_all.numel()),
                "steps": step, "train_token_passes": step * cfg.batch_size * cfg.seq_len,
                "data_seconds": round(t_data, 1), "teacher_seconds": cfg.teacher_seconds,
                "train_seconds": round(time.time() - t0, 1), "loss_curve": losses, "heldout_before": before,
                "heldout_after": after, "date": time.strftime("%Y-%m-%d %H:%M")}
    save_draft(draft, vocab_ids, V, manifest, Path(cfg.out))
    return manifest


def save_draft(draft, vocab_ids: list[int], target_vocab: int, manifest: dict, out: Path,
               extra: Callable[[Path], None] | None = None) -> None:
    """Write the draft atomically: fp16 safetensors, draft_vocab.json, real_draft.json (no tokenizer: see above) and
    whatever ``extra(directory)`` writes."""
    with atomic_build(Path(out), overwrite=True, required="real_draft.json") as tmp:
        if extra is not None:
            extra(tmp)
        draft.to(torch.float16).save_pretrained(tmp)
        draft.to(torch.float32)
        write_json(tmp / "draft_vocab.json", {"target_vocab_size": target_vocab,
                                              "token_ids": list(map(int, vocab_ids))}, indent=None)
        write_json(tmp / "real_draft.json", manifest)
