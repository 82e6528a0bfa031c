"""``retrospec zoo build`` and ``zoo long``: the bundled tiny model zoo.

``zoo build`` trains it on the standard library's source code.

Produces ordinary Hugging Face model directories (``config.json``, ``model.safetensors``, tokenizer files) under
``out/target`` and ``out/draft`` plus ``out/zoo.json`` describing how they were made (seed, token budgets,
wall-clock time, held-out packages and held-out loss). Weights are stored in float16 to keep the bundle small;
retrospec always loads them back as float32.

Steps: (1) byte-level BPE on the training split; (2) the Llama target, language modelling; (3) the draft,
distilled from the target's soft labels (acceptance = 1 - TV(p, q), so agreeing with p is the objective).

Invariant: the build is atomic (``atomic.atomic_build``): written next to ``out``, renamed into place at the end.

``retrospec zoo long``: extend the bundled zoo with a long-context target for RAPID (Chen, Feng, Ni, Li,
Shieh, ICML 2025) benchmarks.

The zoo target saw 512-token windows of stdlib code and never a retrieval question. This step continues training a
copy of it (same architecture and tokenizer, so the zoo draft still shares its vocabulary) on a mix of stdlib code
windows (loss on every token) and long-context task examples from ``tasks`` (kv retrieval, passkey, fact QA;
never ``repo``, whose packages are held out) rendered as ``{context}\n\n{query}`` + reference completion + EOS
(loss on the completion only), every batch at one length drawn from ``lengths`` (at most 2048: the training
length). The saved config allows ``max_positions`` (default 65536) positions, so the model can *run* beyond its
training length, which is where RAPID's drafter over a short retrieved context is meant to help.

Optionally (``draft_steps > 0``) a small ``draft-long`` is distilled from the new target on the same mix (forward KL
on every non-padding position), initialised from the zoo draft with its MLP cut to ``draft_intermediate`` units so
that the bundled weights stay small (the bundle's budget: 48 MiB in all).

CPU by default; ``device="cuda"`` trains in bfloat16 autocast (weights and optimiser state float32); ``workers > 0``
renders task examples in background processes (the batches do not depend on the number of workers);
``seconds``/``draft_seconds`` replace the step counts by a wall-clock budget (the cosine runs over elapsed time).

Outputs (``atomic``: each written next to its destination and renamed into place, only after training and
evaluation succeeded, ``long.json`` last): ``out/target-long``, optionally ``out/draft-long``, and ``out/long.json``
(command, seed, steps, wall time, losses, task accuracy of the base and the new target at each evaluation length),
weights in float16 like the rest of the zoo.
"""

from __future__ import annotations

import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..atomic import atomic_build
from ..models import LoadedModel
from ..models.files import read_array, read_json
from ..request import DEFAULT_TEMPLATE, prepare
from ..run import Run
from ..stdlib_corpus import HELDOUT_PACKAGES, read_texts, stdlib_files, stdlib_root
from ..tasks import make_tasks, score
from .common import adamw, jsonable, optimizer_step, resolve_device, set_lr, set_threads, warmup_cosine, write_json
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


TRAIN_TASKS = ("kv", "passkey", "facts")
BUNDLE_LIMIT_BYTES = 48 * 2**20  # all bundled weights (the zoo pair and smollm2-135m-draft)
PREFETCH = 4  # batches of task examples rendered ahead when workers > 0


@dataclass
class LongZooConfig:
    base: Path  # zoo directory holding target/ (and draft/) and their tokenizer
    out: Path  # zoo directory to add target-long/ (and draft-long/) and long.json to
    seed: int = 0
    steps: int = 400
    batch_size: int = 4
    batch_tokens: int = 0  # > 0: rows per batch = max(1, batch_tokens // length) instead of batch_size
    lengths: tuple[int, ...] = (512, 1024, 1536, 2048)  # training length = max(lengths)
    task_fraction: float = 0.5  # share of each batch's rows that are task examples
    task_weight: float = 0.5  # weight of the completion loss against the code loss
    lr: float = 5e-4
    max_positions: int = 65536
    draft_steps: int = 0
    draft_intermediate: int = 192
    draft_lr: float = 2e-3
    eval_n: int = 6
    eval_lengths: tuple[int, ...] = (1024, 2048, 4096)
    eval_base: bool = True
    threads: int = 0
    log_every: int = 10
    device: str = "cpu"  # "cpu", "cuda" or "auto"
    workers: int = 0  # background processes rendering task examples (0: inline)
    seconds: float = 0.0  # > 0: wall-clock budget of the target phase (overrides ``steps``)
    draft_seconds: float = 0.0  # > 0: wall-clock budget of the draft phase (overrides ``draft_steps``)
    stream_file: str = ""  # a .npy token stream to use instead of encoding the stdlib (e.g. on another machine)
    init_target: str = ""  # continue from this checkpoint instead of base/target (a second, longer stage)
    init_draft: str = ""  # continue distilling this draft instead of cutting down base/draft
    draft_labels: bool = False  # train draft-long on the labels (like the target) instead of distilling
    command: str = ""


@dataclass
class _Batch:
    ids: torch.Tensor  # [B, L + 1]
    mask: torch.Tensor  # [B, L] loss mask over targets
    is_task: torch.Tensor  # [B] bool


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _prompt(tok, row: dict) -> list[int]:
    return _encode(tok, DEFAULT_TEMPLATE.replace("{context}", row["context"]).replace("{query}", row["prompt"]))


def task_example(tok, kind: str, length: int, seed: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one rendered task example of at most ``length + 1`` tokens; loss on the completion."""
    row = make_tasks(kind, max(256, length - 48), 1, seed, tok)[0]
    prompt = _prompt(tok, row)
    completion = _encode(tok, row["completion"]) + [tok.eos_token_id]
    ids = (prompt + completion)[-(length + 1):]
    mask = ([0] * len(prompt) + [1] * len(completion))[-(length + 1):][1:]  # mask over targets ids[1:]
    return ids, mask


def load_tokenizer(path):
    """A local tokenizer with no length cap (whole files and long task contexts are encoded at once)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.model_max_length = 1 << 30
    return tok


def stdlib_train_stream(tok) -> np.ndarray:
    """This interpreter's stdlib training split as one token stream (EOS after each file)."""

    return _encode_stream(tok, read_texts(stdlib_files("train")))


_WORKER_TOK = None


def _worker_init(tok_dir: str) -> None:
    global _WORKER_TOK
    torch.set_num_threads(1)
    _WORKER_TOK = load_tokenizer(tok_dir)


def _worker_example(kind: str, length: int, seed: int) -> tuple[list[int], list[int]]:
    return task_example(_WORKER_TOK, kind, length, seed)


class MixSampler:
    """Seeded batches: code windows and task examples, all rows of a batch at one length.

    A batch's plan (length, task kinds and seeds, code offsets) is drawn from one generator in a fixed order, so
    the batches are the same whether the examples are rendered inline or by ``workers`` background processes.
    """

    def __init__(self, tok, stream: np.ndarray, cfg: LongZooConfig, salt: int = 0, tok_dir: Path | None = None):
        self.tok, self.stream, self.cfg = tok, stream, cfg
        self.rng = np.random.default_rng([cfg.seed, salt])
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.count = 0
        self.pool = None
        self.pending: list = []
        if cfg.workers > 0 and tok_dir is not None:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(cfg.workers, _worker_init, (str(tok_dir),))

    def _plan(self) -> tuple[int, list]:
        cfg = self.cfg
        length = int(self.rng.choice(cfg.lengths))
        size = max(1, cfg.batch_tokens // length) if cfg.batch_tokens > 0 else cfg.batch_size
        n_task = int(round(size * cfg.task_fraction))
        rows = []
        for r in range(size):
            if r < n_task:
                kind = TRAIN_TASKS[int(self.rng.integers(len(TRAIN_TASKS)))]
                rows.append(("task", kind, 1_000_000 + self.count))
                self.count += 1
            else:
                rows.append(("code", int(self.rng.integers(0, len(self.stream) - length - 1)), None))
        return length, rows

    def _render(self, plan) -> list:
        length, rows = plan
        if self.pool is None:
            return [task_example(self.tok, r[1], length, r[2]) if r[0] == "task" else None for r in rows]
        return [self.pool.apply_async(_worker_example, (r[1], length, r[2])) if r[0] == "task" else None
                for r in rows]

    def next(self) -> _Batch:
        while len(self.pending) < (PREFETCH if self.pool is not None else 1):
            plan = self._plan()
            self.pending.append((plan, self._render(plan)))
        (length, rows), rendered = self.pending.pop(0)
        ids_rows, masks, task = [], [], []
        for (what, start, _), ex in zip(rows, rendered):
            if what == "task":
                ids, mask = ex.get() if self.pool is not None else ex
                pad = length + 1 - len(ids)
                ids_rows.append(ids + [self.pad] * pad)
                masks.append(mask + [0] * pad)
            else:
                ids_rows.append(self.stream[start: start + length + 1].astype(np.int64).tolist())
                masks.append([1] * length)
            task.append(what == "task")
        return _Batch(torch.tensor(ids_rows), torch.tensor(masks, dtype=torch.float32), torch.tensor(task))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total = mask.sum()
    return (values * mask).sum() / total if total > 0 else values.sum() * 0.0


def train_mix(model, sampler: MixSampler, steps: int, lr: float, cfg: LongZooConfig, teacher=None,
              desc: str = "target-long", seconds: float = 0.0) -> dict:
    """Continue training ``model`` on the mix; with a ``teacher``, distil (forward KL) instead of fitting labels.

    ``seconds > 0`` replaces ``steps``: training runs for that wall-clock budget, with the cosine learning-rate
    schedule laid over elapsed time, and the number of steps taken is reported."""
    device = next(model.parameters()).device
    amp = device.type == "cuda"
    torch.manual_seed(cfg.seed)
    opt = adamw(model.parameters(), lr, weight_decay=0.1)
    timed = seconds > 0
    warmup = 50 if timed else min(50, max(1, steps // 10))
    model.train()
    losses, running, t0 = [], None, time.perf_counter()
    task_running = None  # the completion loss alone (label training), for the log
    bar = tqdm(total=None if timed else steps, desc=desc, unit="step", dynamic_ncols=True)
    step = 0
    while (time.perf_counter() - t0 < seconds) if timed else step < steps:
        # timed runs: the cosine over elapsed / budget, after the same warm-up steps
        progress = (time.perf_counter() - t0) / seconds if timed else None
        set_lr(opt, warmup_cosine(step, steps, lr, warmup, 0.1, progress=progress))
        b = sampler.next()
        ids, bmask, is_task = b.ids.to(device), b.mask.to(device), b.is_task.to(device)
        x, y = ids[:, :-1], ids[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits  # [B, L, V]
        logits = logits.float()
        if teacher is None:
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(bmask)  # [B, L]
            code = _masked_mean(ce[~is_task], bmask[~is_task])
            task = _masked_mean(ce[is_task], bmask[is_task])
            loss = (1 - cfg.task_weight) * code + cfg.task_weight * task
            tv = float(task.detach())
            task_running = tv if task_running is None else 0.95 * task_running + 0.05 * tv
        else:
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                p_log = teacher(input_ids=x).logits.float().log_softmax(-1)
            kl = F.kl_div(logits.log_softmax(-1), p_log, log_target=True, reduction="none").sum(-1)  # [B, L]
            keep = torch.where(is_task[:, None], (y != sampler.pad).float(), torch.ones_like(bmask))
            # every position, plus the task completions again (the answers a RAG drafter must copy are a tiny
            # share of the positions, and they are what RAPID's acceptance depends on)
            loss = _masked_mean(kl, keep) + cfg.task_weight * _masked_mean(kl[is_task], bmask[is_task])
        value = optimizer_step(opt, loss, model.parameters(), 1.0)
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % cfg.log_every == 0 or step == steps - 1:
            losses.append(round(running, 4))
            bar.set_postfix(loss=f"{running:.3f}", L=b.ids.shape[1] - 1,
                            **({"task": f"{task_running:.3f}"} if task_running is not None else {}))
        step += 1
        bar.update(1)
    bar.close()
    sampler.close()
    model.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "final_loss": running,
            "final_task_loss": task_running, "losses": losses, "device": str(device)}


def eval_tasks(model, tok, lengths, n: int, seed: int = 12345) -> dict:
    """Greedy accuracy per (task, length) on fresh seeded rows (the tasks' own scoring), target reading the full
    context, each row an ``ar`` request through ``run.Run`` (no EOS stop: the completion budget decides); 'repo' is
    left out (first-line exact match is near zero for models this small)."""
    target = LoadedModel(model, tok, "")
    out: dict = {}
    for length in lengths:
        for kind in TRAIN_TASKS:
            rows = make_tasks(kind, length, n, seed, tok)
            hits = 0
            for row in rows:
                budget = len(_encode(tok, row["completion"])) + 4
                req = replace(prepare(_prompt(tok, row), target=target, method="ar", max_new_tokens=budget),
                              eos_ids=frozenset())  # no EOS stop
                hits += score(row, tok.decode(Run(req, text=False).run(), skip_special_tokens=True))
            out[f"{kind}@{length}"] = hits / len(rows)
    return out


def _shrunk_draft(base_draft, intermediate: int):
    """The zoo draft with its MLP cut to the first ``intermediate`` units (structured pruning as initialisation)."""
    from transformers import LlamaForCausalLM

    cfg = base_draft.config.__class__.from_dict(base_draft.config.to_dict())
    cfg.intermediate_size = intermediate
    student = LlamaForCausalLM(cfg)
    state = base_draft.state_dict()
    for name, tensor in student.state_dict().items():
        src = state[name]
        if src.shape != tensor.shape:  # gate/up: [inter, hidden] rows; down: [hidden, inter] columns
            src = src[:intermediate] if "down_proj" not in name else src[:, :intermediate]
        tensor.copy_(src)
    return student


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def build_long_zoo(cfg: LongZooConfig, log=print, stream: np.ndarray | None = None) -> dict:
    """Train and write target-long (and draft-long); ``stream`` overrides the code corpus (tests)."""

    set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    started = time.perf_counter()
    base, out = Path(cfg.base), Path(cfg.out)
    tok = load_tokenizer(base / "target")
    start = Path(cfg.init_target) if cfg.init_target else base / "target"
    target = _load(start)
    if stream is None:
        stream = (read_array(Path(cfg.stream_file), "--stream-file") if cfg.stream_file
                  else stdlib_train_stream(tok))
    log(f"code stream: {len(stream):,} tokens; lengths {cfg.lengths}; {cfg.steps} steps of {cfg.batch_size} rows")
    manifest: dict = {"command": cfg.command, "config": jsonable(cfg)}
    if cfg.init_target and (start.parent / "long.json").is_file():  # the earlier stage this one continues
        manifest["previous_stage"] = read_json(start.parent / "long.json", f"corrupt zoo {start.parent}")
    if (base / "zoo.json").is_file():  # the base zoo's manifest travels with the pair (zoo info reads it here)
        manifest["base_zoo"] = read_json(base / "zoo.json", f"corrupt zoo {base}")
    if cfg.eval_base and cfg.eval_n:
        manifest["base_accuracy"] = eval_tasks(target.eval(), tok, cfg.eval_lengths, cfg.eval_n)
        log(f"base target accuracy: {manifest['base_accuracy']}")
    if cfg.steps > 0 or cfg.seconds > 0:
        sampler = MixSampler(tok, stream, cfg, salt=1, tok_dir=base / "target")
        manifest["target_long"] = train_mix(target.to(device), sampler, cfg.steps, cfg.lr, cfg, seconds=cfg.seconds)
    else:  # steps = 0: keep the starting checkpoint as the target (e.g. to distil only a new draft from it)
        manifest["target_long"] = {"steps": 0, "kept": str(start)}
    target.to("cpu")
    target.config.max_position_embeddings = cfg.max_positions
    if cfg.eval_n:
        manifest["target_long"]["accuracy"] = eval_tasks(target, tok, cfg.eval_lengths, cfg.eval_n)
        log(f"target-long accuracy: {manifest['target_long']['accuracy']}")
    target.to(torch.float16).to(torch.float32)  # the weights target-long ships (float16): what the draft distils from
    student = None
    if cfg.draft_steps > 0 or cfg.draft_seconds > 0:
        student = _load(cfg.init_draft) if cfg.init_draft else _shrunk_draft(_load(base / "draft"),
                                                                                 cfg.draft_intermediate)
        student.config.max_position_embeddings = cfg.max_positions
        sampler = MixSampler(tok, stream, cfg, salt=2, tok_dir=base / "target")
        manifest["draft_long"] = train_mix(student.to(device), sampler, max(1, cfg.draft_steps), cfg.draft_lr, cfg,
                                           teacher=None if cfg.draft_labels else target.to(device),
                                           desc="draft-long" + ("" if cfg.draft_labels else " (distil)"),
                                           seconds=cfg.draft_seconds)
        manifest["draft_long"]["objective"] = "labels" if cfg.draft_labels else "distillation from target-long"
        student.to("cpu")
        target.to("cpu")
        manifest["draft_long"]["intermediate_size"] = cfg.draft_intermediate
    manifest.update(build_seconds=round(time.perf_counter() - started, 1), torch_threads=torch.get_num_threads(),
                    machine=platform.machine(), python=platform.python_version())
    # nothing is written before every phase succeeded; each model directory lands whole, long.json (the marker of
    # a complete long zoo) last
    for name, model in (("target-long", target), ("draft-long", student)):
        if model is not None:
            with atomic_build(out / name, overwrite=True, required="config.json") as tmp:
                _save_model(model, tok, tmp)
    write_json(out / "long.json", manifest, indent=2)
    total = sum(p.stat().st_size for p in out.glob("*/*.safetensors"))
    log(f"bundled weights under {out}: {total / 2**20:.2f} MiB" + (" (OVER the 48 MiB budget)"
                                                                  if total > BUNDLE_LIMIT_BYTES else ""))
    return manifest
