"""Datastore directories: ``meta.json``, identity fingerprints, atomic builds and load-time compatibility checks.

A datastore is one directory. ``meta.json`` says what it is and what it was built for::

    {"format": "retrospec-datastore", "version": 1, "kind": "suffix" | "dense" | "rag",
     "tokenizer": {"fingerprint", "vocab_size", "eos_id", "source"},
     "target":    {"fingerprint", "config_hash", "weights_digest", "path", "layer", "hidden_size"}   # dense only
     "params": {...build parameters...}, "corpus": {...description...}, "counts": {...},
     "files": {name: size in bytes}, "build": {"seconds", "peak_rss_mb", "created"}}

Invariants:
- A build writes into ``.<name>.tmp-<pid>`` next to the destination and renames it into place only after every
  file and, last of all, ``meta.json`` are complete; an interrupted build therefore never leaves a directory at the
  destination (and never one with a ``meta.json`` whose files are missing).
- ``load_meta`` refuses a directory whose ``meta.json`` is missing or unreadable, whose format/version/kind is not
  what the caller expects, or whose data files are missing or have another size than recorded.
- ``check_compatible`` refuses a store built for another tokenizer (vocabulary fingerprint or size) and, for dense
  stores, another target model (config hash + weights digest, and hidden size): token ids or hidden states would
  mean different things. Every refusal is one ``RetrospecError`` line that says what to rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from ..errors import RetrospecError

FORMAT = "retrospec-datastore"
VERSION = 1
KINDS = ("suffix", "dense", "rag")  # rag: Speculative RAG passage index (retrospec.rag.index)
# how a kind is named, and what needs it (for the wrong-kind refusal)
_KIND_NAMES = {"suffix": "suffix store", "dense": "dense store", "rag": "RAG passage index"}
_KIND_NEEDS = {"suffix": "method 'rest' needs a suffix store (retrospec datastore build --kind suffix)",
               "dense": "method 'dresd' needs a dense store (retrospec datastore build --kind dense)",
               "rag": "a RAG passage index is needed (retrospec rag index)"}
META_FILE = "meta.json"

# config keys that do not change what the model computes
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
                         "_commit_hash", "_attn_implementation_autoset", "_attn_implementation"}


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of the vocabulary (token string -> id); None when there is no tokenizer."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return _sha(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False))


_MODEL_IDS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def model_identity(model: torch.nn.Module) -> dict:
    """``config_hash`` (config without volatile keys) and ``weights_digest`` (per-tensor RMS, 4 significant digits,
    so the same checkpoint loaded in float32 or float16 gets the same digest). Cached per model object."""
    if model in _MODEL_IDS:
        return _MODEL_IDS[model]
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _sha(json.dumps(cfg, sort_keys=True, default=str))
    with torch.no_grad():
        stats = [f"{name}:{tuple(p.shape)}:{p.detach().double().pow(2).mean().sqrt().item():.4g}"
                 for name, p in sorted(model.named_parameters())]
    weights = _sha("|".join(stats))
    ident = {"config_hash": config_hash, "weights_digest": weights, "fingerprint": _sha(config_hash + weights)}
    _MODEL_IDS[model] = ident
    return ident


def output_vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def tokenizer_meta(tokenizer, vocab_size: int, eos_id: int, source: str = "") -> dict:
    return {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": int(vocab_size), "eos_id": int(eos_id),
            "source": source}


def target_meta(model: torch.nn.Module, path: str, layer: int = -1) -> dict:
    return model_identity(model) | {"path": path, "layer": layer, "hidden_size": int(model.config.hidden_size)}


# ---------------------------------------------------------------------------------------------------------------------
# atomic builds


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_build(dest: str | Path, overwrite: bool = False, required: str = META_FILE):
    """Yield a fresh temporary directory next to ``dest``; rename it to ``dest`` when the block completes (and
    wrote ``required``, the file that marks a finished directory: ``meta.json`` for datastores).

    On any exception the temporary directory is removed and ``dest`` is untouched. A process killed mid-build
    leaves only a hidden ``.<name>.tmp-<pid>`` directory, which the next build of the same destination removes.
    """
    dest = Path(dest)
    if dest.exists() and not overwrite:
        if not dest.is_dir() or any(dest.iterdir()):
            raise RetrospecError(f"{dest} already exists; choose another --out or pass --overwrite")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # leftovers of killed builds
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not (tmp / required).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"build of {dest} finished without writing {required}")
    if dest.exists():
        trash = dest.parent / f".{dest.name}.old-{os.getpid()}"
        dest.rename(trash)
        tmp.rename(dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(dest)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def write_meta(tmp: Path, meta: dict[str, Any], started: float) -> dict:
    """Record file sizes and build statistics, then write ``meta.json`` (the last file of a build)."""
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


# ---------------------------------------------------------------------------------------------------------------------
# loading and checking


def load_meta(path: str | Path, kind: str | None = None) -> dict:
    path = Path(path)
    if not path.exists():
        raise RetrospecError(f"datastore not found: {path}")
    if not path.is_dir():
        raise RetrospecError(f"datastore path is not a directory: {path}")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise RetrospecError(f"not a retrospec datastore (no meta.json; incomplete or interrupted build?): {path}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise RetrospecError(f"corrupt datastore {path}: meta.json is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RetrospecError(f"corrupt datastore {path}: meta.json is not a retrospec datastore description")
    if meta.get("version") != VERSION:
        raise RetrospecError(f"datastore {path} has format version {meta.get('version')}; this retrospec reads "
                             f"version {VERSION}; rebuild it with 'retrospec datastore build'")
    if meta.get("kind") not in KINDS:
        raise RetrospecError(f"corrupt datastore {path}: unknown kind {meta.get('kind')!r}")
    if kind is not None and meta["kind"] != kind:
        needs = _KIND_NEEDS.get(kind, f"a {kind} store is needed")
        raise RetrospecError(f"datastore {path} is a {_KIND_NAMES[meta['kind']]}; {needs}")
    for name, size in (meta.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            raise RetrospecError(f"corrupt datastore {path}: file {name} is missing")
        if f.stat().st_size != size:
            raise RetrospecError(f"corrupt datastore {path}: file {name} has {f.stat().st_size} bytes, "
                                 f"meta.json records {size}")
    return meta


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
        if want.get("fingerprint") != have["fingerprint"]:
            raise RetrospecError(
                f"dense datastore {path} was built for another target model ({want.get('path')}, fingerprint "
                f"{want.get('fingerprint')}); the running target has fingerprint {have['fingerprint']}; rebuild it "
                f"with 'retrospec datastore build --kind dense --target <this model>'")
