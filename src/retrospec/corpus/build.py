"""A corpus of the target's own outputs: batched, sharded, resumable, written atomically, with a manifest.

Drafts and in-domain datastores learn best from text the target itself wrote. ``CorpusBuilder`` asks the target
every prompt row (``corpus.prompts``) at every temperature of the config and writes what it answered:

- work items = (row, temperature) in a fixed order, cut into shards of ``shard_size`` items; shard k is
  ``shard-0000k.jsonl``, one JSON object per item: ``source``, ``chat``, ``temperature``, ``prompt`` (for
  self-instruct and tasks, the instruction the target wrote: for tasks, a task's opening words and its
  continuation), ``prompt_ids``, ``output_ids``, ``finished`` (ended at an end-of-turn / EOS id rather than at
  ``max_new_tokens``);
- a shard is decoded by an *engine* (``CorpusEngine``): by default ``RetrospecEngine``, in batches of ``batch_size``
  sequences (``batched.generate_batch``), rows sorted by prompt length, sampled rows drawing from one generator
  seeded by (seed, shard); or an engine in another interpreter (``bench.vllm_corpus``: vLLM's offline
  ``LLM.generate``, each record sampled with its own seed, ``record_seed``). The manifest records the engine
  (``engine``: name, version, how it seeds), and a corpus resumes only with the engine that began it;
- each shard file, then ``manifest.json``, is written atomically, so a killed build leaves whole shards only; a
  rerun with the same ``--out`` and config skips the shards the manifest lists (an unlisted shard file is generated
  again, identically), and a different config is refused (one line), never mixed in.

Manifest: the config, the target's identity (``target``: ``identity.target_record`` — fingerprint, digests of the
weights rounded to 16 bits, dtype, vocabulary size, tokenizer fingerprint, path — plus layer and parameter counts),
per-source and per-temperature counts, prompt and output tokens, seconds, and the shards written.

Reading (``read_corpus``, ``check_corpus``): a manifest or shard line that is not JSON, or a record without its token
ids, is one ``RetrospecError`` line naming the file and the line. A corpus is read *for* a target only if that target
wrote it (``identity.same_model``: a bfloat16 or float16 copy of the same weights is the same target) and every token
id lies inside the target's vocabulary; a manifest written before the identity was recorded is checked on what it
does record (model type, vocabulary and hidden size, layers, parameters), the token ids always.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ..atomic import write_text_atomic
from ..batched import generate_batch
from ..chat import build_chat_prompt, end_of_turn_ids, render
from ..config import SamplingConfig
from ..errors import RetrospecError
from ..identity import head_rows, portable_path, same_model, target_record, tokenizer_fingerprint
from ..models.files import read_json, read_jsonl
from ..models.loading import as_module
from .prompts import WRITTEN, PromptRow

MANIFEST = "manifest.json"
INSTRUCTION_TOKENS = 96  # the most a self-written instruction may take
MARK = "\x00RETROSPEC-USER\x00"


@dataclass(frozen=True)
class Job:
    """One sequence an engine generates: the prompt's ids, how to sample (temperature, top-p), the most new tokens,
    and the record's own seed (``record_seed``; engines that seed per request use it, ``RetrospecEngine`` draws
    from the shard's generator instead)."""
    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int


def record_seed(seed: int, item: int, phase: int) -> int:
    """A record's own 63-bit seed: from the config's seed, the item's index in the whole build and the phase (0: the
    instruction a self-instruct / tasks row writes first, 1: the reply). The same for the same item whatever
    shard, batch or order it is generated in, so a shard generated again (resume) is the same."""
    digest = hashlib.blake2b(f"{seed}/{item}/{phase}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CorpusEngine(Protocol):
    """What writes a corpus's outputs: ``generate`` answers every job, in order (token ids, the stopping EOS id
    included when one was produced); ``record`` is what the manifest keeps (``name``, ``version``, ``seeding``)."""

    name: str

    def start(self) -> None:
        """Get ready (load a model): called before the first shard is timed, only when a shard is to be written."""

    def record(self) -> dict: ...

    def generate(self, jobs: list[Job], batch_size: int, eos: frozenset[int],
                 generator: torch.Generator) -> list[list[int]]: ...


class RetrospecEngine:
    """The default engine: ``batched.generate_batch`` on the loaded target, in this process. Jobs run in the order
    given, in batches of ``batch_size`` cut within each run of equal sampling settings; sampled rows draw from the
    shard's generator in that order (a shard generated again draws the same)."""

    name = "retrospec"
    seeding = ("per shard: one generator seeded seed * 1000003 + shard, drawn by every sampled row of the shard in "
               "batch order")

    def __init__(self, model, pad_id: int):
        self.model, self.pad = model, pad_id

    def start(self) -> None:
        pass  # the target is loaded already

    def record(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("retrospec")
        except PackageNotFoundError:
            ours = None
        return {"name": self.name, "version": ours, "torch": torch.__version__, "seeding": self.seeding}

    def generate(self, jobs: list[Job], batch_size: int, eos: frozenset[int],
                 generator: torch.Generator) -> list[list[int]]:
        out: list[list[int]] = []
        k = 0
        while k < len(jobs):
            run = k + 1  # jobs[k:run]: one batch, equal settings
            while run < len(jobs) and run - k < batch_size and (jobs[run].sampling, jobs[run].max_new_tokens) == (
                    jobs[k].sampling, jobs[k].max_new_tokens):
                run += 1
            res = generate_batch(self.model, [j.prompt_ids for j in jobs[k:run]],
                                 max_new_tokens=jobs[k].max_new_tokens, eos_ids=eos, pad_id=self.pad,
                                 sampling=jobs[k].sampling, generator=generator)
            out += res.tokens
            k = run
        return out


@dataclass
class CorpusConfig:
    sources: str  # the --sources spec (recorded)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    top_p: float = 0.95  # sampled temperatures only
    max_new_tokens: int = 256
    batch_size: int = 32
    shard_size: int = 128
    seed: int = 0
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted in the manifest)

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def target_identity(target) -> dict:
    """What the manifest records of the target (a ``LoadedModel``): ``identity.target_record`` plus its layer and
    parameter counts (what manifests recorded before the identity was)."""
    model = target.model
    return target_record(model, target.tokenizer, str(target.path)) | {
        "layers": int(model.config.num_hidden_layers), "parameters": int(sum(p.numel() for p in model.parameters()))}


# what a manifest must hold to be resumed: the totals a build adds to
_TOTALS = {"shards": dict, "by_source": dict, "by_temperature": dict, "prompt_tokens": (int, float),
           "output_tokens": (int, float), "skipped_long": (int, float), "seconds": (int, float), "target": dict}


def self_instruct_prefix(tokenizer) -> list[int]:
    """The chat template rendered up to where the user's message starts (Magpie)."""
    text = render(tokenizer, [{"role": "user", "content": MARK}], name="the target")
    head = text.split(MARK)[0]
    if head == text:
        raise RetrospecError("the target's chat template hides the user message; self-instruct cannot use it")
    return list(tokenizer(head, add_special_tokens=False)["input_ids"])


class CorpusBuilder:
    def __init__(self, target, rows: list[PromptRow], out: str | Path, cfg: CorpusConfig,
                 engine: CorpusEngine | None = None):
        if not rows:
            raise RetrospecError("no prompt rows to generate from")
        if cfg.batch_size < 1 or cfg.shard_size < 1 or cfg.max_new_tokens < 1:
            raise RetrospecError("--batch-size, --shard-size and --max-new-tokens must be >= 1")
        if any(t < 0 for t in cfg.temperatures) or not cfg.temperatures:
            raise RetrospecError("temperatures must be >= 0 (0 = greedy)")
        if not 0 < cfg.top_p <= 1:
            raise RetrospecError(f"top_p must be in (0, 1], got {cfg.top_p}")
        tok = target.tokenizer
        if tok is None:
            raise RetrospecError(f"target {target.path} has no tokenizer; a corpus needs text prompts")
        if any(r.chat for r in rows):
            render(tok, [{"role": "user", "content": "x"}], name=f"target {target.path}")  # a chat template exists
        self.target, self.rows, self.cfg, self.out = target, rows, cfg, Path(out)
        self.items = [(i, t) for i in range(len(rows)) for t in cfg.temperatures]  # (row, temperature)
        self.eos = target.eos_ids() | end_of_turn_ids(tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.engine = engine if engine is not None else RetrospecEngine(target.model, self.pad)

    def _manifest(self) -> dict:
        path = self.out / MANIFEST
        if self.out.exists() and not self.out.is_dir():
            raise RetrospecError(f"--out must be a directory, but {self.out} is a file")
        if path.is_file():
            m = read_json(path, f"corrupt corpus {self.out}")
            bad = next((k for k, kind in _TOTALS.items() if not isinstance(m.get(k), kind)), None)
            if bad is not None:
                raise RetrospecError(f"corrupt corpus {self.out}: {MANIFEST} has no {bad!r}; remove the directory or "
                                     "choose another --out")
            engine = m.get("engine")
            began = engine.get("name") if isinstance(engine, dict) else RetrospecEngine.name  # unrecorded: ours
            if began != self.engine.name:
                raise RetrospecError(f"{self.out} holds a corpus generated by the {began} engine; resume it with "
                                     f"--engine {began} (this run uses {self.engine.name})")
            if "engine" not in m:
                m["engine"] = self.engine.record()
            was, now = m["target"], target_identity(self.target)
            if m.get("config_key") != self.cfg.key() or portable_path(was.get("path")) != now["path"]:
                raise RetrospecError(f"{self.out} holds a corpus built with another config or target; choose "
                                     "another --out (or rerun with the same arguments to resume)")
            if was.get("dtype", now["dtype"]) != now["dtype"]:  # one corpus, one precision of the target
                raise RetrospecError(f"{self.out} holds a corpus of the target in {was['dtype']}; resume it with "
                                     f"--dtype {was['dtype']} (this run loads it in {now['dtype']})")
            if was.get("fingerprint") is not None and not same_model(was, self.target.model):
                raise RetrospecError(f"{self.out} holds a corpus of another model at {now['path']} (fingerprint "
                                     f"{was['fingerprint']}, now {now['fingerprint']}); choose another --out")
            return m
        if self.out.is_dir() and any(p for p in self.out.iterdir() if not p.name.startswith(".")):
            raise RetrospecError(f"{self.out} exists and is not a corpus directory; choose another --out")
        return {"config": asdict(self.cfg), "config_key": self.cfg.key(), "target": target_identity(self.target),
                "engine": self.engine.record(), "rows": len(self.rows), "items": len(self.items), "shards": {},
                "by_source": {}, "by_temperature": {}, "prompt_tokens": 0, "output_tokens": 0, "skipped_long": 0, "seconds": 0.0}

    def _encode(self, row: PromptRow, instruction: str | None = None) -> tuple[str, list[int]]:
        tok = self.target.tokenizer
        text = instruction if instruction is not None else row.text
        if row.chat:
            return text, build_chat_prompt(tok, [{"role": "user", "content": text}]).prompt_ids
        return text, list(tok(text, add_special_tokens=False)["input_ids"])

    def _instructions(self, openers: list[tuple[int, str]], gen: torch.Generator) -> list[str]:
        """One user instruction written by the target (sampled at temperature 1, top-p 0.95) from each (item, opener):
        the chat template up to the user's turn, then the opener's words ("" = Magpie's unseeded instruction)."""
        tok = self.target.tokenizer
        prefix, sampling = self_instruct_prefix(tok), SamplingConfig(temperature=1.0, top_p=0.95)
        starts = [list(tok(o, add_special_tokens=False)["input_ids"]) if o else [] for _, o in openers]
        jobs = [Job(prefix + s, sampling, INSTRUCTION_TOKENS, record_seed(self.cfg.seed, item, 0))
                for (item, _), s in zip(openers, starts)]
        written = self.engine.generate(jobs, self.cfg.batch_size, self.eos, gen)
        return [tok.decode(s + t, skip_special_tokens=True).strip() for s, t in zip(starts, written)]

    def run_shard(self, index: int, items: list[tuple[int, float]]) -> list[dict]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
        first = index * self.cfg.shard_size  # the index of items[0] in the whole build
        openers = [(first + o, self.rows[i].text) for o, (i, _) in enumerate(items) if self.rows[i].source in WRITTEN]
        written = iter(self._instructions(openers, gen) if openers else ())
        prepared = []  # (item order, row, temperature, prompt text, prompt ids)
        for order, (i, temp) in enumerate(items):
            row = self.rows[i]
            text, ids = self._encode(row, next(written) if row.source in WRITTEN else None)
            if text.strip() and 0 < len(ids) <= self.cfg.max_prompt_tokens:
                prepared.append((order, row, temp, text, ids))
        # by temperature, then by prompt length within one (batches pad little)
        prepared.sort(key=lambda p: (p[2], len(p[4])))
        jobs = [Job(ids, SamplingConfig(temperature=t, top_p=self.cfg.top_p if t > 0 else 1.0),
                    self.cfg.max_new_tokens, record_seed(self.cfg.seed, first + order, 1))
                for order, _, t, _, ids in prepared]
        outputs = self.engine.generate(jobs, self.cfg.batch_size, self.eos, gen) if jobs else []
        records = {order: {"source": row.source, "chat": row.chat, "temperature": t, "prompt": text,
                           "prompt_ids": ids, "output_ids": toks, "finished": bool(toks) and toks[-1] in self.eos}
                   for (order, row, t, text, ids), toks in zip(prepared, outputs)}
        return [records[o] for o in sorted(records)]

    def build(self, progress: bool = True) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest()
        if not (self.out / MANIFEST).is_file():  # a corpus directory from now on: a kill after shard 0 resumes
            write_text_atomic(self.out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        shards = [self.items[k:k + self.cfg.shard_size] for k in range(0, len(self.items), self.cfg.shard_size)]
        # done = listed in the manifest (written after its shard file); a shard file without its manifest entry
        # (killed between the two renames) is generated again: the same seed gives the same records
        todo = [k for k in range(len(shards))
                if f"{k:05d}" not in manifest["shards"] or not (self.out / f"shard-{k:05d}.jsonl").is_file()]
        if todo:
            self.engine.start()
            was, now = manifest["engine"].get("seeding"), self.engine.record().get("seeding")
            if was is not None and now is not None and was != now and not str(was).startswith("mixed"):
                # resumed where the engine seeds otherwise (vLLM on a GPU, then on its CPU build): say so, per shard
                manifest["engine"]["seeding"] = f"mixed: shards before {todo[0]:05d}: {was}; from it on: {now}"
        # the bar is closed on a failure too: its last line ends before the error's
        with tqdm(total=len(self.items), initial=len(self.items) - sum(len(shards[k]) for k in todo),
                  desc="corpus", unit="seq", disable=not progress, dynamic_ncols=True) as bar:
            for k in todo:
                t0 = time.perf_counter()
                records = self.run_shard(k, shards[k])
                text = "".join(json.dumps(r) + "\n" for r in records)
                write_text_atomic(self.out / f"shard-{k:05d}.jsonl", text)
                out_tokens = sum(len(r["output_ids"]) for r in records)
                manifest["shards"][f"{k:05d}"] = {"items": len(shards[k]), "records": len(records),
                                                  "output_tokens": out_tokens,
                                                  "seconds": round(time.perf_counter() - t0, 2)}
                manifest["skipped_long"] += len(shards[k]) - len(records)
                manifest["prompt_tokens"] += sum(len(r["prompt_ids"]) for r in records)
                manifest["output_tokens"] += out_tokens
                manifest["seconds"] = round(manifest["seconds"] + time.perf_counter() - t0, 2)
                for r in records:
                    for key, val in (("by_source", r["source"]), ("by_temperature", str(r["temperature"]))):
                        slot = manifest[key].setdefault(val, {"records": 0, "output_tokens": 0})
                        slot["records"] += 1
                        slot["output_tokens"] += len(r["output_ids"])
                manifest["complete"] = len(manifest["shards"]) == len(shards)
                write_text_atomic(self.out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                bar.update(len(shards[k]))
                bar.set_postfix_str(f"{manifest['output_tokens']:,} tokens")
        return manifest


def read_manifest(path: str | Path) -> dict:
    """The manifest of the corpus directory ``path`` (one line for a directory without one, or a corrupt one)."""
    d = Path(path)
    if not (d / MANIFEST).is_file():
        raise RetrospecError(f"{path} is not a corpus directory (no {MANIFEST})")
    return read_json(d / MANIFEST, f"corrupt corpus {path}")


def read_corpus(path: str | Path, target=None) -> list[dict]:
    """Every record of a corpus directory, in shard order (a complete or partial build). With ``target`` (what the
    records are read for): ``check_corpus``."""
    d = Path(path)
    manifest = read_manifest(d)
    where = f"corrupt corpus {path}"
    shards = sorted(d.glob("shard-*.jsonl"))
    if not shards and "packed" in manifest:
        raise RetrospecError(f"{path} is a packed corpus; unpack it first: retrospec corpus unpack {path} --out DIR")
    out = []
    for f in shards:
        for number, record in read_jsonl(f, where):
            for key in ("prompt_ids", "output_ids"):
                ids = record.get(key)
                if not isinstance(ids, list) or not all(type(t) is int for t in ids) or (ids and min(ids) < 0):
                    raise RetrospecError(f"{where}: {f.name} line {number}: {key!r} is not a list of token ids")
            out.append(record)
    if target is not None:
        check_corpus(path, out, target, manifest)
    return out


# what manifests written before the identity was recorded say of the target, and how to read it off a model
_LEGACY = {"model_type": lambda m: m.config.model_type, "hidden_size": lambda m: int(m.config.hidden_size),
           "layers": lambda m: int(m.config.num_hidden_layers),
           "parameters": lambda m: int(sum(p.numel() for p in m.parameters()))}


def check_corpus(path: str | Path, records: list[dict], target, manifest: dict | None = None,
                 name: str | None = None) -> None:
    """Refuse (one ``RetrospecError`` line) a corpus ``target`` did not write: its manifest's identity is another
    model's (``identity.same_model``) or tokenizer's; for a manifest without an identity, what it records differs
    from the target's; and in every case a token id of ``records`` outside the target's vocabulary. ``name``: how
    the user named the target (default its path)."""
    manifest = read_manifest(path) if manifest is None else manifest
    model = as_module(target)
    name = name or getattr(target, "path", None) or getattr(model, "name_or_path", None) or "the target"
    vocab = head_rows(model)
    was = manifest.get("target")
    if was is not None and not isinstance(was, dict):
        raise RetrospecError(f"corrupt corpus {path}: {MANIFEST} records its target as {type(was).__name__}")
    was = was or {}
    fix = f"generate a corpus with 'retrospec corpus generate --target {name}'"
    if was.get("fingerprint") is not None:
        if not same_model(was, model):
            raise RetrospecError(f"corpus {path} was generated by another model ({was.get('path')}, fingerprint "
                                 f"{was['fingerprint']}), not by the target {name}; {fix}")
        theirs, ours = was.get("tokenizer_fingerprint"), tokenizer_fingerprint(getattr(target, "tokenizer", None))
        if theirs is not None and ours is not None and theirs != ours:
            raise RetrospecError(f"corpus {path} was generated with another tokenizer (fingerprint {theirs}) than the "
                                 f"target {name}'s ({ours}); {fix}")
    for key, read in {"vocab_size": lambda m: vocab, **_LEGACY}.items():
        if was.get(key) is not None and was[key] != read(model):
            raise RetrospecError(f"corpus {path} was generated by another model ({was.get('path')}: {key} "
                                 f"{was[key]}, the target {name}'s is {read(model)}); {fix}")
    top = max((max(r[k]) for r in records for k in ("prompt_ids", "output_ids") if r.get(k)), default=-1)
    if top >= vocab:
        raise RetrospecError(f"corpus {path} holds token id {top}, outside the vocabulary of the target {name} "
                             f"({vocab} tokens); it was generated by another model; {fix}")
