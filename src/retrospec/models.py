"""Loading Hugging Face causal LMs from local directories, the bundled zoo, and compatibility checks.

Any checkpoint directory that ``AutoModelForCausalLM.from_pretrained`` understands works (config.json + weights +
tokenizer files); nothing is ever downloaded (``local_files_only=True``). Models are loaded in float32 on the CPU
by default, whatever dtype they were saved in (the zoo is stored in float16 to stay small).

Loaded models are cached by (resolved path, dtype, device), so repeated API calls with the same paths reuse them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import RetrospecError

ZOO_DIR = Path(__file__).parent / "zoo"


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with a causal-LM head
    tokenizer: Any  # a transformers tokenizer, or None
    path: str

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.model.config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return frozenset(ids)


def zoo_path(name: str) -> Path:
    """Path of a bundled zoo model ('target' or 'draft')."""
    path = ZOO_DIR / name
    if not (path / "config.json").exists():
        raise RetrospecError(f"bundled zoo model '{name}' is missing at {path}; rebuild it with 'retrospec zoo build'")
    return path


_CACHE: dict[tuple[str, str, str], LoadedModel] = {}


def _check_dir(path: Path, role: str) -> None:
    if not path.exists():
        raise RetrospecError(f"{role} model directory not found: {path}")
    if not path.is_dir():
        raise RetrospecError(f"{role} model path is not a directory: {path}")
    if not (path / "config.json").exists():
        raise RetrospecError(f"{role} model directory has no config.json (not a Hugging Face checkpoint): {path}")


def load_model(src, *, role: str = "target", tokenizer=None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load (or wrap) a causal LM. ``src``: a directory path, a ``LoadedModel``, or a transformers model."""
    if isinstance(src, LoadedModel):
        return src
    if isinstance(src, torch.nn.Module):
        if tokenizer is None:
            name = getattr(src, "name_or_path", "") or ""
            tokenizer = _load_tokenizer(Path(name)) if name and Path(name).is_dir() else None
        return LoadedModel(src.eval(), tokenizer, str(getattr(src, "name_or_path", "<in-memory model>")))
    path = Path(os.fspath(src)).expanduser()
    _check_dir(path, role)
    key = (str(path.resolve()), str(dtype), str(device))
    if key in _CACHE:
        return _CACHE[key]
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # keep load reports and progress bars off the user's terminal
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as exc:  # corrupt weights, unknown architecture, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetrospecError(f"could not load {role} model from {path}: {first}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model = model.to(device).eval()
    loaded = LoadedModel(model, tokenizer if tokenizer is not None else _load_tokenizer(path), str(path))
    _CACHE[key] = loaded
    return loaded


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise RetrospecError(f"could not load tokenizer from {path}: {str(exc).splitlines()[0]}") from exc


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from the target's (token ids would mean different things)."""
    if target.vocab_size != draft.vocab_size:
        raise RetrospecError(
            f"draft and target vocabularies differ: target has {target.vocab_size} output tokens, "
            f"draft has {draft.vocab_size} ({draft.path})"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise RetrospecError(f"draft tokenizer differs from the target's ({draft.path} vs {target.path})")
