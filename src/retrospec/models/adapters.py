"""LoRA adapters as models: a directory with peft's ``adapter_config.json`` + ``adapter_model.safetensors`` (or,
packed, ``adapter_model.int8.safetensors``) and our ``retrospec_adapter.json`` loads wherever a model directory does
(``load_model``), as its base with the adapter merged in. ``smollm2-135m-rag-drafter`` (Speculative RAG's drafter,
``train/rag_drafter.py``) is one, bundled packed to int8.

``retrospec_adapter.json``::

    {"base": "smollm2-135m" | "/path/to/base",
     "base_identity": {"config_hash", "weights_digest", "fingerprint", "rounded", "dtype"},  # identity.model_identity
     "storage": "int8"}  # optional; absent: peft's own adapter_model.safetensors (float16 from our trainer)

``pack_adapter`` rewrites peft's file as ``adapter_model.int8.safetensors`` (``models.quant``: int8, one absmax
scale per output row; lossy, error <= scale / 2 per LoRA weight); at load it is dequantised to float32 and handed to
peft before the merge. The int8 file has another name on purpose: peft alone can never read int8 codes as weights.

Invariants: the merged model is a private copy — the cached base (which may be serving as a target or verifier at
the same time) is never modified. A base whose identity differs from the recorded one is refused with one line:
the adapter's deltas would be added to weights they were not trained against.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch

from ..atomic import atomic_build
from ..errors import RetrospecError
from ..identity import model_identity, same_model
from . import quant
from .files import first_line, read_json, read_tensors

ADAPTER_META = "retrospec_adapter.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
INT8_WEIGHTS = "adapter_model.int8.safetensors"


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def write_adapter_meta(directory: Path, base, base_name: str) -> None:
    meta = {"base": base_name, "base_identity": model_identity(base.model)}
    (directory / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_adapter(path: Path, *, dtype: torch.dtype, device, load_model):
    """(model, tokenizer): the adapter at ``path`` merged into a copy of its base, loaded by ``load_model`` (passed
    in by ``loading.load_model``: this module never imports ``loading``)."""
    meta_file = path / ADAPTER_META
    try:
        meta = json.loads(meta_file.read_text())
        base_src = meta["base"]
        if not isinstance(base_src, str) or not base_src:
            raise TypeError("base is not a model name or path")
    except (OSError, ValueError, KeyError, TypeError):
        raise RetrospecError(f"{path} looks like a LoRA adapter but has no readable {ADAPTER_META} "
                             "(which base model it was trained on)") from None
    base_path = Path(base_src).expanduser()
    if not base_path.is_absolute() and not base_path.exists() and (path / base_src).exists():
        base_src = str(path / base_src)
    # float32 whatever ``dtype``: the merge W + BA is rounded once, at the end
    base = load_model(base_src, role="adapter base", dtype=torch.float32, device=device)
    want = meta.get("base_identity") or {}
    if not isinstance(want, dict):
        raise RetrospecError(f"corrupt adapter {path}: {ADAPTER_META} records base_identity as "
                             f"{type(want).__name__}, not an object")
    if want.get("fingerprint") is not None and not same_model(want, base.model):
        raise RetrospecError(f"adapter {path} was trained on another {base_src} (fingerprint {want['fingerprint']}); "
                             f"the loaded base has fingerprint {model_identity(base.model)['fingerprint']}")
    storage = meta.get("storage")
    if storage not in (None, quant.INT8):
        raise RetrospecError(f"adapter {path}: unknown storage {storage!r} in {ADAPTER_META} (this retrospec reads "
                             f"{quant.INT8} or none: peft's own file)")
    try:
        if storage == quant.INT8:
            model = _peft_from_int8(copy.deepcopy(base.model), path)
        else:
            from peft import PeftModel

            model = PeftModel.from_pretrained(copy.deepcopy(base.model), str(path), is_trainable=False)
        model = model.merge_and_unload()
    except Exception as exc:  # missing or corrupt adapter weights, target modules absent from the base
        raise RetrospecError(f"could not load adapter {path} onto {base_src}: {first_line(exc)}") from exc
    return model.to(dtype).eval(), base.tokenizer


def _peft_from_int8(model, path: Path):
    """``model`` wrapped by peft with the int8 adapter at ``path`` loaded (dequantised to float32)."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    state = quant.unpack_int8(load_file(str(path / INT8_WEIGHTS)), dtype=torch.float32)
    config = PeftConfig.from_pretrained(str(path))
    config.inference_mode = True
    config.base_model_name_or_path = getattr(model, "name_or_path", None)  # (peft warns when they differ)
    peft_model = get_peft_model(model, config)
    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise RetrospecError(f"{INT8_WEIGHTS} does not match adapter_config.json ({len(missing)} adapter weights "
                             f"missing, {len(result.unexpected_keys)} unexpected)")
    return peft_model


def pack_adapter(src: str | Path, out: str | Path, storage: str = quant.INT8) -> dict:
    """Copy the adapter directory ``src`` to a new ``out`` (atomically) with its weights stored as int8
    (``adapter_model.int8.safetensors``, ``"storage": "int8"``, a ``"packed"`` entry in ``manifest.json`` if there
    is one). Returns {"bytes_before", "bytes_after"} of the weights file."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    if storage != quant.INT8:
        raise RetrospecError(f"adapters can be packed to {quant.INT8} only, not {storage!r}")
    if not src.is_dir() or not is_adapter_dir(src) or not (src / ADAPTER_META).is_file():
        raise RetrospecError(f"not a retrospec LoRA adapter directory (adapter_config.json + {ADAPTER_META}): {src}")
    if out.exists():
        raise RetrospecError(f"{out} already exists; choose another output directory")
    meta = read_json(src / ADAPTER_META, f"adapter {src}")
    if meta.get("storage") is not None or not (src / PEFT_WEIGHTS).is_file():
        raise RetrospecError(f"adapter {src} is not stored as peft's {PEFT_WEIGHTS} (storage "
                             f"{meta.get('storage')!r}); pack the original adapter")
    sizes = {"bytes_before": (src / PEFT_WEIGHTS).stat().st_size}
    with atomic_build(out, required=ADAPTER_META) as tmp:
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(PEFT_WEIGHTS), dirs_exist_ok=True)
        packed = quant.pack_int8(read_tensors(src / PEFT_WEIGHTS, f"corrupt adapter {src}"))
        save_file(packed, str(tmp / INT8_WEIGHTS), metadata={"format": "pt", "storage": quant.INT8})
        os.chmod(tmp / INT8_WEIGHTS, 0o644)  # safetensors creates 0600 files; this one may be bundled
        sizes["bytes_after"] = (tmp / INT8_WEIGHTS).stat().st_size
        meta |= {"storage": quant.INT8, "storage_description": quant.INT8_DESCRIPTION}
        (tmp / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")
        manifest_file = tmp / "manifest.json"
        if manifest_file.is_file():
            manifest = read_json(manifest_file, f"adapter {src}")
            manifest["packed"] = {"from": src.name, "storage": quant.INT8} | sizes
            manifest_file.write_text(json.dumps(manifest, indent=1) + "\n")
    return sizes

