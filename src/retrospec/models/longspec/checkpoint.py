"""Saving and loading a LongSpec draft block, tied to the target it was built for.

A block directory holds ``block.safetensors`` (the block's own weights only: the target's embedding and head are
shared, never saved) and ``longspec.json``::

    {"format": "retrospec-longspec", "version": 1,
     "block": {"window", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "hidden_act", "rms_norm_eps"},
     "target": {"config_hash", "weights_digest", "fingerprint", "hidden_size", "vocab_size", "path"},
     "files": {"block.safetensors": size in bytes}}

Invariants:
- ``save_longspec`` writes into ``.<name>.tmp-<pid>`` next to the destination and renames it into place when both
  files are complete, so an interrupted save never leaves a directory at the destination.
- ``load_longspec`` refuses (one ``RetrospecError`` line each) a missing or incomplete directory, an unknown format
  or version, and a block built for another target: other hidden or vocabulary size, or another identity
  (``retrieval.store.model_identity``: config hash + weights digest). The block's queries were trained against that
  target's keys and its embedding / head.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import RetrospecError
from .block import LongSpecDraft, as_module

FORMAT = "retrospec-longspec"
VERSION = 1
META_FILE = "longspec.json"
WEIGHTS_FILE = "block.safetensors"
_ARCH_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_act",
              "rms_norm_eps")


def _target_meta(target, path: str | None) -> dict:
    from ...retrieval.store import model_identity  # lazy: retrieval sits above models

    model = as_module(target)
    path = path or getattr(target, "path", None) or getattr(model, "name_or_path", "") or "<in-memory model>"
    return model_identity(model) | {"hidden_size": int(model.config.hidden_size),
                                    "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
                                    "path": str(path)}


def save_longspec(draft: LongSpecDraft, target, out_dir: str | Path, *, target_path: str | None = None,
                  overwrite: bool = False) -> Path:
    """Write ``draft``'s weights and ``longspec.json`` (block config + ``target``'s identity) to ``out_dir``."""
    from safetensors.torch import save_file

    dest = Path(out_dir)
    if not draft.uses(target):
        raise RetrospecError("this LongSpec block is not bound to the given target (its embedding / head are another "
                             "model's); save it with the target it was built for")
    if dest.exists() and not overwrite and (not dest.is_dir() or any(dest.iterdir())):
        raise RetrospecError(f"{dest} already exists; choose another directory or pass overwrite=True")
    cfg = draft.config
    meta = {"format": FORMAT, "version": VERSION,
            "block": {"window": draft.window, "model_type": cfg.model_type, "head_dim": draft.head_dim}
            | {k: getattr(cfg, k) for k in _ARCH_KEYS},
            "target": _target_meta(target, target_path)}
    from ...retrieval.store import atomic_build  # lazy: retrieval sits above models

    with atomic_build(dest, overwrite=True, required=META_FILE) as tmp:  # refusal of an existing dest: above
        state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        meta["files"] = {WEIGHTS_FILE: (tmp / WEIGHTS_FILE).stat().st_size}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def read_meta(path: str | Path) -> dict:
    """``longspec.json`` of a block directory, checked for format, version and file sizes."""
    path = Path(path)
    if not path.is_dir():
        raise RetrospecError(f"LongSpec block directory not found: {path}")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise RetrospecError(f"not a LongSpec block directory (no {META_FILE}): {path}")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RetrospecError(f"corrupt LongSpec block {path}: {META_FILE} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RetrospecError(f"corrupt LongSpec block {path}: {META_FILE} is not a LongSpec block description")
    if meta.get("version") != VERSION:
        raise RetrospecError(f"LongSpec block {path} has format version {meta.get('version')}; this retrospec reads "
                             f"version {VERSION}")
    for name, size in (meta.get("files") or {WEIGHTS_FILE: None}).items():
        f = path / name
        if not f.is_file() or (size is not None and f.stat().st_size != size):
            raise RetrospecError(f"corrupt LongSpec block {path}: {name} is missing or has another size than recorded")
    return meta


def load_longspec(path: str | Path, target) -> LongSpecDraft:
    """The block saved at ``path``, bound to ``target`` (a transformers causal LM or a ``LoadedModel``), on the
    target's device and dtype. A block built for another target is refused (one line)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_meta(path)
    want, block_cfg = meta.get("target") or {}, meta.get("block") or {}
    have = _target_meta(target, None)
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if want.get(key) != have[key]:
            raise RetrospecError(f"LongSpec block {path} was built for a target with {what} {want.get(key)} "
                                 f"({want.get('path')}); the running target's is {have[key]}")
    if want.get("fingerprint") != have["fingerprint"]:
        raise RetrospecError(f"LongSpec block {path} was built for another target ({want.get('path')}, fingerprint "
                             f"{want.get('fingerprint')}); the running target has fingerprint {have['fingerprint']}; "
                             f"train a block for this target")
    window = block_cfg.get("window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise RetrospecError(f"corrupt LongSpec block {path}: window {window!r} is not a positive integer")
    draft = LongSpecDraft.for_target(target, window=window)
    try:
        state = load_file(str(path / WEIGHTS_FILE))
        draft.load_state_dict(state, strict=True)
    except Exception as exc:  # unreadable file, missing / unexpected / misshapen tensors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetrospecError(f"corrupt LongSpec block {path}: could not load {WEIGHTS_FILE} ({first})") from None
    return draft.eval()
