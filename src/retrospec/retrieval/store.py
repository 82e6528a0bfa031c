"""Datastore directories: ``meta.json``, identity fingerprints, atomic builds and load-time compatibility checks.

A datastore is one directory; ``meta.json`` says what it is and what it was built for::

    {"format": "retrospec-datastore", "version": 1, "kind": "suffix" | "dense" | "rag",
     "tokenizer": {"fingerprint", "vocab_size", "eos_id", "source"},
     "target":    {"fingerprint", "config_hash", "weights_digest", "rounded", "dtype", "path", "layer",
                   "hidden_size"}   # dense only
     "params": {...build parameters...}, "corpus": {...description...}, "counts": {...},
     "files": {name: size in bytes}, "build": {"seconds", "peak_rss_mb", "created"}}

Invariants:
- A build goes through ``atomic.atomic_build`` and writes ``meta.json`` last: an interrupted build never leaves a
  directory at the destination (and never one with a ``meta.json`` whose files are missing).
- ``load_meta`` refuses a directory whose ``meta.json`` is missing, unreadable or lacks a section its kind reads,
  whose format/version/kind is not what the caller expects, or whose data files are missing or have another size
  than recorded.
- ``check_compatible`` refuses a store built for another tokenizer (vocabulary fingerprint or size) and, for dense
  stores, another target model (``identity.same_model``: the recorded target or a bfloat16/float16 copy of it; and
  hidden size): token ids or hidden states would mean different things. Every refusal is one ``RetrospecError`` line
  that says what to rebuild.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import META_FILE
from ..errors import RetrospecError
from ..identity import head_rows, model_identity, same_model, tokenizer_fingerprint
from ..models.files import read_description

FORMAT = "retrospec-datastore"
VERSION = 1
KINDS = ("suffix", "dense", "rag")  # rag: Speculative RAG passage index (retrospec.speculative_rag.index)
# how a kind is named, and what needs it (for the wrong-kind refusal)
_KIND_NAMES = {"suffix": "suffix store", "dense": "dense store", "rag": "RAG passage index"}
_KIND_NEEDS = {"suffix": "method 'rest' needs a suffix store (retrospec datastore build --kind suffix)",
               "dense": "method 'dresd' needs a dense store (retrospec datastore build --kind dense)",
               "rag": "a RAG passage index is needed (retrospec rag index)"}


def output_vocab_size(model: torch.nn.Module) -> int:
    return head_rows(model)


def tokenizer_meta(tokenizer, vocab_size: int, eos_id: int, source: str = "") -> dict:
    return {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": int(vocab_size), "eos_id": int(eos_id),
            "source": source}


def target_meta(model: torch.nn.Module, path: str, layer: int = -1) -> dict:
    return model_identity(model) | {"path": path, "layer": layer, "hidden_size": int(model.config.hidden_size)}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def write_meta(tmp: Path, meta: dict[str, Any], started: float, extra_files: dict | None = None) -> dict:
    """Write ``extra_files`` (name -> writer(path), e.g. an ID store's generations), record file sizes and build
    statistics, then write ``meta.json`` (the last file of a build)."""
    for name, write in (extra_files or {}).items():
        write(tmp / name)
    meta = dict(meta)
    meta["format"], meta["version"] = FORMAT, VERSION
    meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != META_FILE}
    meta["build"] = dict(meta.get("build", {})) | {
        "seconds": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    part = tmp / (META_FILE + ".part")
    part.write_text(json.dumps(meta, indent=2) + "\n")
    part.replace(tmp / META_FILE)
    return meta


def load_meta(path: str | Path, kind: str | None = None) -> dict:
    path = Path(path)
    absent = f"not a retrospec datastore (no meta.json; incomplete or interrupted build?): {path}"
    meta = read_description(path, META_FILE, FORMAT, VERSION, "datastore", absent=absent,
                            upgrade="; rebuild it with 'retrospec datastore build'")
    if meta.get("kind") not in KINDS:
        raise RetrospecError(f"corrupt datastore {path}: unknown kind {meta.get('kind')!r}")
    if kind is not None and meta["kind"] != kind:
        needs = _KIND_NEEDS.get(kind, f"a {kind} store is needed")
        raise RetrospecError(f"datastore {path} is a {_KIND_NAMES[meta['kind']]}; {needs}")
    _check_sections(meta, path)
    return meta


# the sections of meta.json each kind reads (an object each), and the entries of them it reads
_SECTIONS = {"suffix": {"tokenizer": ("eos_id",)}, "dense": {"tokenizer": ("eos_id",), "params": (), "target": ()},
             "rag": {"embedder": ("name",)}}


def _check_sections(meta: dict, path: Path) -> None:
    """Every section the store's kind reads is an object holding the entries it reads; ``counts``, ``params``,
    ``target`` and ``tokenizer`` are objects where present; ``tokenizer.eos_id`` is an integer."""
    need = _SECTIONS[meta["kind"]]
    for section in [*need, *(s for s in ("counts", "params", "target", "tokenizer") if s not in need)]:
        value = meta.get(section)
        if value is None and section not in need:
            continue
        if value is None:
            raise RetrospecError(f"corrupt datastore {path}: {META_FILE} has no {section!r} object")
        if not isinstance(value, dict):
            raise RetrospecError(f"corrupt datastore {path}: {META_FILE} records {section!r} as "
                                 f"{type(value).__name__}, not an object")
        missing = [k for k in need.get(section, ()) if k not in value]
        if missing:
            raise RetrospecError(f"corrupt datastore {path}: {META_FILE} {section!r} has no {missing[0]!r}")
    eos = (meta.get("tokenizer") or {}).get("eos_id")
    if "eos_id" in (meta.get("tokenizer") or {}) and (type(eos) is not int or eos < 0):
        raise RetrospecError(f"corrupt datastore {path}: {META_FILE} records eos_id {eos!r}, not a token id")


def check_compatible(meta: dict, path: str | Path, *, model: torch.nn.Module | None, tokenizer=None) -> None:
    """Refuse a store built for another tokenizer or (dense) another target model. One clear line per refusal."""
    tok = meta.get("tokenizer") or {}
    fp = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    if fp is not None and tok.get("fingerprint") is not None:
        if fp != tok["fingerprint"]:
            raise RetrospecError(
                f"datastore {path} was built with another tokenizer (vocabulary fingerprint {tok['fingerprint']}, "
                f"from {tok.get('source') or '?'}); the running tokenizer's is {fp}; rebuild the store for this target")
    elif model is not None and tok.get("vocab_size") is not None and tok["vocab_size"] != output_vocab_size(model):
        raise RetrospecError(
            f"datastore {path} was built for a vocabulary of {tok['vocab_size']} tokens; the target has "
            f"{output_vocab_size(model)} output tokens; rebuild the store with this target's tokenizer")
    max_id = (meta.get("counts") or {}).get("max_token_id")
    if model is not None and max_id is not None and max_id >= output_vocab_size(model):
        raise RetrospecError(f"datastore {path} holds token id {max_id}, outside the target's vocabulary of "
                             f"{output_vocab_size(model)}; rebuild the store with this target's tokenizer")
    if meta["kind"] == "dense" and model is not None:
        want = meta.get("target") or {}
        have = model_identity(model)
        hidden = int(model.config.hidden_size)
        if want.get("hidden_size") is not None and want["hidden_size"] != hidden:
            raise RetrospecError(f"dense datastore {path} holds hidden states of size {want['hidden_size']} "
                                 f"(target {want.get('path')}); the running target's are {hidden}; rebuild it")
        if not same_model(want, model):
            raise RetrospecError(
                f"dense datastore {path} was built for another target model ({want.get('path')}, fingerprint "
                f"{want.get('fingerprint')}); the running target has fingerprint {have['fingerprint']}; rebuild it "
                f"with 'retrospec datastore build --kind dense --target <this model>'")
