"""LoRA adapters as models: a directory with peft's ``adapter_config.json`` + ``adapter_model.safetensors`` and our
``retrospec_adapter.json`` loads wherever a model directory does (``load_model``), as its base with the adapter
merged in. ``smollm2-135m-rag-drafter`` (Speculative RAG's drafter, ``train/rag_drafter.py``) is one.

``retrospec_adapter.json``::

    {"base": "smollm2-135m" | "/path/to/base", "base_identity": {"config_hash", "weights_digest", "fingerprint"}}

Invariants: the merged model is a private copy — the cached base (which may be serving as a target or verifier at
the same time) is never modified. A base whose identity differs from the recorded one is refused with one line:
the adapter's deltas would be added to weights they were not trained against.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..errors import RetrospecError

ADAPTER_META = "retrospec_adapter.json"


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def write_adapter_meta(directory: Path, base, base_name: str) -> None:
    from ..retrieval.store import model_identity

    meta = {"base": base_name, "base_identity": model_identity(base.model)}
    (directory / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_adapter(path: Path, *, dtype: torch.dtype, device, load_model):
    """The adapter at ``path`` merged into a copy of its base; ``load_model`` loads the base (it is cached there)."""
    from ..retrieval.store import model_identity
    from .loading import LoadedModel

    meta_file = path / ADAPTER_META
    try:
        meta = json.loads(meta_file.read_text())
        base_src = meta["base"]
    except (OSError, ValueError, KeyError, TypeError):
        raise RetrospecError(f"{path} looks like a LoRA adapter but has no readable {ADAPTER_META} "
                             "(which base model it was trained on)") from None
    base_path = Path(base_src).expanduser()
    if not base_path.is_absolute() and not base_path.exists() and (path / base_src).exists():
        base_src = str(path / base_src)
    # float32 whatever ``dtype``: the recorded identity is of float32 weights (rounding to bfloat16 changes the
    # digest), and the merge W + BA is rounded once, at the end
    base = load_model(base_src, role="adapter base", dtype=torch.float32, device=device)
    want = (meta.get("base_identity") or {}).get("fingerprint")
    have = model_identity(base.model)["fingerprint"]
    if want is not None and want != have:
        raise RetrospecError(f"adapter {path} was trained on another {base_src} (fingerprint {want}); the loaded base "
                             f"has fingerprint {have}")
    try:
        from peft import PeftModel

        model = PeftModel.from_pretrained(copy.deepcopy(base.model), str(path), is_trainable=False)
        model = model.merge_and_unload()
    except Exception as exc:  # missing or corrupt adapter weights, target modules absent from the base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetrospecError(f"could not load adapter {path} onto {base_src}: {first}") from exc
    return LoadedModel(model.to(dtype).eval(), base.tokenizer, str(path))
