"""Saving and loading a LongSpec draft block, tied to the target it was built for.

A block directory holds ``block.safetensors`` (the block's own weights only: the target's embedding and head are
shared, never saved) and ``longspec.json``::

    {"format": "retrospec-longspec", "version": 1,
     "block": {"window", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "hidden_act", "rms_norm_eps", "draft_vocab" (K, when drafting over a subset),
               "features" (the target layers a feature-reading block fuses, when it has them)},
     "target": {"config_hash", "weights_digest", "fingerprint", "rounded", "dtype", "hidden_size", "vocab_size",
                "path"},
     "files": {"block.safetensors": size in bytes, "draft_vocab.json": size (with a draft vocabulary)},
     "storage": "float32" | "float16" | "bfloat16" | "int8"}

``storage`` (also in the safetensors metadata): a float dtype, or ``"int8"`` (``models.quant``; lossy); absent
(older saves): the block's own dtype. ``load_longspec`` casts to the target's dtype; the drafter stays lossless
whatever the storage (the target verifies every token), only the acceptance rate can change.

Invariants:
- ``save_longspec`` builds the directory atomically (``atomic.atomic_build``): an interrupted save leaves nothing.
- ``load_longspec`` refuses (one ``RetrospecError`` line each) a missing or incomplete directory, an unknown format,
  version or storage, tensors that do not match the recorded storage, and a block built for another target: other
  hidden or vocabulary size, or another identity (``identity.same_model``: a bfloat16 or float16 copy of the target
  it was built for is accepted). The block's queries were trained against that target's keys and its embedding /
  head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...atomic import atomic_build
from ...errors import RetrospecError
from ...identity import model_identity, same_model
from .. import quant
from ..files import first_line, read_description, read_json, read_tensors
from ..loading import as_module
from .block import LongSpecDraft

FORMAT = "retrospec-longspec"
VERSION = 1
META_FILE = "longspec.json"
WEIGHTS_FILE = "block.safetensors"
VOCAB_FILE = "draft_vocab.json"  # present when the block drafts over a vocabulary subset (``set_vocab``)
MANIFEST_FILE = "manifest.json"  # written by ``train.longspec`` (not read here except to copy it on repack)
# ``storage`` names -> the dtype a file holds (int8: ``quant.pack_int8``)
STORAGES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, quant.INT8: torch.int8}
_ARCH_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_act",
              "rms_norm_eps")


def _target_meta(target, path: str | None) -> dict:
    model = as_module(target)
    path = path or getattr(target, "path", None) or getattr(model, "name_or_path", "") or "<in-memory model>"
    return model_identity(model) | {"hidden_size": int(model.config.hidden_size),
                                    "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
                                    "path": str(path)}


def _stored_state(draft: LongSpecDraft, storage: str | None) -> tuple[dict[str, torch.Tensor], str | None]:
    """(the tensors ``block.safetensors`` holds for ``storage``, the storage name recorded)."""
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    if storage is None:  # the block's own dtype, named when it is one of the float storages
        dtype = next(iter(state.values())).dtype if state else None
        return state, next((name for name, d in STORAGES.items() if d == dtype and name != quant.INT8), None)
    if storage == quant.INT8:
        return quant.pack_int8(state), storage
    return {k: v.to(STORAGES[storage]).contiguous() if v.is_floating_point() else v for k, v in state.items()}, storage


def save_longspec(draft: LongSpecDraft, target, out_dir: str | Path, *, target_path: str | None = None,
                  overwrite: bool = False, storage: str | None = None) -> Path:
    """Write ``draft``'s weights and ``longspec.json`` (block config + ``target``'s identity) to ``out_dir``;
    ``storage``: None (the block's own dtype, exact) or one of ``STORAGES``."""
    from safetensors.torch import save_file

    dest = Path(out_dir)
    if storage is not None and storage not in STORAGES:
        raise RetrospecError(f"unknown LongSpec storage {storage!r}; choose one of {', '.join(STORAGES)}")
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
    with atomic_build(dest, overwrite=True, required=META_FILE) as tmp:  # refusal of an existing dest: above
        state, stored = _stored_state(draft, storage)
        save_file(state, str(tmp / WEIGHTS_FILE),
                  metadata={"format": FORMAT} | ({"storage": stored} if stored else {}))
        (tmp / WEIGHTS_FILE).chmod(0o644)  # safetensors may create it owner-only; a block is shipped and shared
        meta["files"] = {WEIGHTS_FILE: (tmp / WEIGHTS_FILE).stat().st_size}
        if draft.vocab is not None:  # the draft vocabulary's target ids (FR-Spec rows of the shared head)
            (tmp / VOCAB_FILE).write_text(json.dumps(draft.vocab.tolist()) + "\n")
            meta["files"][VOCAB_FILE] = (tmp / VOCAB_FILE).stat().st_size
            meta["block"]["draft_vocab"] = int(draft.vocab.numel())
        if draft.features:  # the target layers its feature fuses (the block's weights assume them)
            meta["block"]["features"] = list(draft.features)
        if stored:
            meta["storage"] = stored
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def read_meta(path: str | Path) -> dict:
    """``longspec.json`` of a block directory, checked for format, version, file sizes and storage."""
    path = Path(path)
    meta = read_description(path, META_FILE, FORMAT, VERSION, "LongSpec block", required=(WEIGHTS_FILE,),
                            absent=f"not a LongSpec block directory (no {META_FILE}): {path}")
    storage = meta.get("storage")
    if storage is not None and storage not in STORAGES:
        raise RetrospecError(f"corrupt LongSpec block {path}: unknown storage {storage!r} in {META_FILE} (this "
                             f"retrospec reads {', '.join(STORAGES)})")
    for section in ("block", "target"):
        if not isinstance(meta.get(section), dict):
            raise RetrospecError(f"corrupt LongSpec block {path}: {META_FILE} has no {section!r} object")
    return meta


def load_longspec(path: str | Path, target) -> LongSpecDraft:
    """The block saved at ``path``, bound to ``target`` (a transformers causal LM or a ``LoadedModel``), on the
    target's device and dtype. A block built for another target is refused (one line)."""
    path = Path(path)
    meta = read_meta(path)
    want, block_cfg = meta["target"], meta["block"]
    have = _target_meta(target, None)
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if want.get(key) != have[key]:
            raise RetrospecError(f"LongSpec block {path} was built for a target with {what} {want.get(key)} "
                                 f"({want.get('path')}); the running target's is {have[key]}")
    if not same_model(want, as_module(target)):
        raise RetrospecError(f"LongSpec block {path} was built for another target ({want.get('path')}, fingerprint "
                             f"{want.get('fingerprint')}); the running target has fingerprint {have['fingerprint']}; "
                             f"train a block for this target")
    corrupt = f"corrupt LongSpec block {path}"
    for key in ("window", "intermediate_size"):
        value = block_cfg.get(key)
        if (key == "window" or value is not None) and (type(value) is not int or value < 1):
            raise RetrospecError(f"{corrupt}: {key} {value!r} is not a positive integer")
    features = block_cfg.get("features")
    if features is not None and (not isinstance(features, list) or not all(type(i) is int for i in features)):
        raise RetrospecError(f"{corrupt}: features {features!r} is not a list of layer indices")
    draft = LongSpecDraft.for_target(target, window=block_cfg["window"],
                                     intermediate_size=block_cfg.get("intermediate_size"), features=features)
    storage = meta.get("storage")
    state = read_tensors(path / WEIGHTS_FILE, corrupt)  # a truncated or corrupt file: one line
    try:
        if storage == quant.INT8:
            state = quant.unpack_int8(state, dtype=torch.float32)  # float32, then rounded once into the draft's dtype
        elif quant.is_packed(state):
            raise RetrospecError(f"{WEIGHTS_FILE} holds int8 tensors but {META_FILE} records storage "
                                 f"{storage or 'unset'}")
        draft.load_state_dict(state, strict=True)
    except RetrospecError as exc:
        raise RetrospecError(f"{corrupt}: {exc}") from None
    except Exception as exc:  # missing / unexpected / misshapen tensors
        raise RetrospecError(f"{corrupt}: could not load {WEIGHTS_FILE} ({first_line(exc)})") from None
    if block_cfg.get("draft_vocab") is not None:
        try:
            ids = json.loads((path / VOCAB_FILE).read_text())
            if not isinstance(ids, list) or len(ids) != block_cfg["draft_vocab"] or not all(
                    isinstance(i, int) for i in ids):
                raise ValueError("not a list of as many integer ids as recorded")
            draft.set_vocab(ids)
        except (OSError, ValueError, RetrospecError) as exc:
            raise RetrospecError(f"{corrupt}: {VOCAB_FILE}: {exc}") from None
    return draft.eval()


def repack_longspec(src: str | Path, target, out: str | Path, storage: str) -> dict:
    """Load the block at ``src`` against ``target`` and save it to ``out`` (a new directory) with ``storage``; a
    ``manifest.json`` next to ``src``'s weights is copied with a ``"packed": {"from", "storage"}`` entry. Returns
    {"bytes_before", "bytes_after" (of ``block.safetensors``), "storage_before", "storage_after",
    "max_abs_error" (largest weight difference between the two blocks as loaded, in the target's dtype)}."""

    src, out = Path(src), Path(out)
    if storage not in STORAGES:
        raise RetrospecError(f"unknown LongSpec storage {storage!r}; choose one of {', '.join(STORAGES)}")
    if out.exists():
        raise RetrospecError(f"{out} already exists; choose another --out")
    meta = read_meta(src)
    has_manifest = (src / MANIFEST_FILE).is_file()
    manifest = read_json(src / MANIFEST_FILE, f"corrupt LongSpec block {src}") if has_manifest else None
    block = load_longspec(src, target)
    with atomic_build(out, required=META_FILE) as tmp:
        save_longspec(block, target, tmp, target_path=(meta.get("target") or {}).get("path"), storage=storage,
                      overwrite=True)
        if manifest is not None:
            manifest["packed"] = {"from": str(src), "storage": storage}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    packed = load_longspec(out, target)
    return {"bytes_before": (src / WEIGHTS_FILE).stat().st_size, "bytes_after": (out / WEIGHTS_FILE).stat().st_size,
            "storage_before": meta.get("storage"), "storage_after": storage,
            "max_abs_error": quant.max_abs_difference(block.state_dict(), packed.state_dict())}
