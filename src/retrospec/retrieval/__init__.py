"""Datastores for retrieval drafters: REST's suffix array over tokens and DReSD's dense index over the target's
hidden states. Build and search are separate objects; each store is one directory with a ``meta.json`` that is
checked against the running target and tokenizer when it is opened (see ``store.py``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import RetrospecError
from .dense_index import DenseStore, KeyTransform, build_dense_store
from .store import META_FILE, check_compatible, load_meta
from .suffix_array import SuffixStore, build_suffix_store

__all__ = ["DenseStore", "KeyTransform", "SuffixStore", "build_dense_store", "build_suffix_store", "load_meta",
           "open_store"]

_CACHE: dict[tuple[str, int], SuffixStore | DenseStore] = {}


def open_store(src, kind: str | None = None, *, target=None, tokenizer=None) -> SuffixStore | DenseStore:
    """Open (or reuse) a store (``src``: a directory or an open store) and check it against ``target`` (a
    ``LoadedModel`` or a transformers model) and its tokenizer (or ``tokenizer``). Opened stores are cached per
    (path, meta.json mtime), so a benchmark that builds one drafter per prompt maps the files once."""
    if isinstance(src, (SuffixStore, DenseStore)):
        store = src
        if kind is not None and store.kind != kind:
            load_meta(store.path, kind=kind)  # raises the standard "wrong kind" error
    else:
        if src is None or str(src) == "":
            raise RetrospecError("no datastore given (--datastore DIR)")
        path = Path(src).expanduser()
        meta = load_meta(path, kind=kind)
        if meta["kind"] not in ("suffix", "dense"):
            raise RetrospecError(f"datastore {path} is a RAG passage index (for 'retrospec rag'); rest and dresd "
                                 f"need a suffix or dense store (retrospec datastore build)")
        key = (str(path.resolve()), (path / META_FILE).stat().st_mtime_ns)
        if key not in _CACHE:
            _CACHE[key] = (SuffixStore if meta["kind"] == "suffix" else DenseStore)(path, meta)
        store = _CACHE[key]
    from ..models.loading import LoadedModel, as_module

    if tokenizer is None and isinstance(target, LoadedModel):
        tokenizer = target.tokenizer
    check_compatible(store.meta, store.path, model=as_module(target), tokenizer=tokenizer)
    return store
