"""Model and tokenizer identity: fingerprints recorded in every built artefact and checked at load (bottom rank).

``model_identity`` hashes what a model computes (config without volatile keys, per-tensor RMS digest of the
weights: the ``fingerprint``), so that an artefact built for one model is refused for another whatever its path, and
records ``rounded``: exact digests of the weights rounded to bfloat16 and to float16 (every bit of every tensor).
``same_model`` is the check every loader makes: the recorded fingerprint is the model's, or one of the two is held in
16 bits and the other, rounded to that dtype, is bit for bit the same (a bfloat16 copy of a float32 model, either
way round: rounding to nearest even is one function on every device). A fine-tune, however small, changes those
bits. Artefacts written before 2026-11-27 record no ``rounded`` digests: they accept exact matches only.
``tokenizer_fingerprint`` hashes the vocabulary. ``target_record`` is what an artefact built *for* a target records
of it (a corpus of its outputs, a draft distilled for it): its identity, output vocabulary size, hidden size, the
tokenizer's fingerprint and where it was loaded from.

Invariants: the fingerprint is exact (one model, one dtype); two float32 identities match only exactly; a bfloat16
and a float16 copy of one model do not match each other (double rounding); identities are cached weakly per model
object. Imports nothing from retrospec.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import torch

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


ROUNDED = (torch.bfloat16, torch.float16)  # the 16-bit dtypes an identity records exact digests for


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rounded_digest(config_hash: str, params: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> str:
    """SHA-256 over every parameter rounded to ``dtype`` (other-typed tensors as they are), bit for bit."""
    h = hashlib.sha256(config_hash.encode())
    for name, p in params:
        t = (p.detach().to(dtype) if p.is_floating_point() else p.detach()).contiguous().cpu()
        h.update(f"|{name}:{tuple(t.shape)}:{t.dtype}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def model_identity(model: torch.nn.Module) -> dict:
    """``config_hash``, ``weights_digest`` (per-tensor RMS, 4 significant digits), their ``fingerprint``, and for
    ``same_model``: ``rounded`` ({dtype name: digest of the weights rounded to it} for bfloat16 and float16) and
    ``dtype`` (the coarsest floating-point dtype among the parameters)."""
    if model in _MODEL_IDS:
        return _MODEL_IDS[model]
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _sha(json.dumps(cfg, sort_keys=True, default=str))
    with torch.no_grad():
        params = sorted(model.named_parameters())
        stats = [f"{name}:{tuple(p.shape)}:{p.detach().double().pow(2).mean().sqrt().item():.4g}"
                 for name, p in params]
        rounded = {_dtype_name(d): _rounded_digest(config_hash, params, d) for d in ROUNDED}
    weights = _sha("|".join(stats))
    ident = {"config_hash": config_hash, "weights_digest": weights, "fingerprint": _sha(config_hash + weights),
             "rounded": rounded, "dtype": _coarsest_dtype(model)}
    _MODEL_IDS[model] = ident
    return ident


def derive(model: torch.nn.Module, source: dict, fmt: str) -> dict:
    """Record that ``model`` is ``source`` (an identity) held in the weight format ``fmt`` (``int8``, ``int4``):
    its identity is the source's, with ``format`` added, so what was built for the source accepts it."""
    ident = {**source, "format": fmt}
    _MODEL_IDS[model] = ident
    return ident


def _coarsest_dtype(model: torch.nn.Module) -> str:
    """The name of the floating-point parameter dtype with the largest epsilon (``float32`` when there is none)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} or {torch.float32}
    return _dtype_name(max(dtypes, key=lambda d: torch.finfo(d).eps))


def same_model(recorded: dict | None, model: torch.nn.Module) -> bool:
    """Whether ``recorded`` (an identity an artefact stored: ``fingerprint``, maybe ``rounded`` and ``dtype``) is
    ``model``'s: both float32 (or wider), the same fingerprint and the same weights rounded to bfloat16; one of them
    in 16 bits, the other rounded to that dtype bit for bit the same. A record without ``rounded`` (written before
    2026-11-27): the same fingerprint."""
    if not isinstance(recorded, dict) or recorded.get("fingerprint") is None:
        return False
    have = model_identity(model)
    same_fingerprint = recorded["fingerprint"] == have["fingerprint"]
    want = recorded.get("rounded")
    if not isinstance(want, dict):
        return same_fingerprint
    coarse = {recorded.get("dtype", "float32"), have["dtype"]} & {_dtype_name(d) for d in ROUNDED}
    if not coarse:  # two float32 identities: the digest catches what 4 digits of RMS cannot (a small fine-tune)
        return same_fingerprint and want.get("bfloat16") == have["rounded"]["bfloat16"]
    return any(want.get(d) is not None and want.get(d) == have["rounded"][d] for d in coarse)


def head_rows(model: torch.nn.Module) -> int:
    """Rows of a causal LM's output head (its vocabulary), whatever the head's weight format."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)
    return int(rows if rows is not None else head.weight.shape[0])


def portable_path(path) -> str | None:
    """How an artefact records where its model came from, without the machine's layout: a named model's converted
    checkpoint (``<cache_home>/models/<name>``) as its name, a path inside the working directory relative to it, any
    other path as given (None stays None). Artefacts built on one machine and loaded on another then name the same
    model, and no bundled file holds a home directory."""
    if path is None:
        return None
    from .paths import cache_home

    p = Path(str(path)).expanduser()
    if not p.is_absolute():
        return str(path)
    try:
        resolved = p.resolve()
        models = (cache_home() / "models").resolve()
        if resolved.parent == models:
            return resolved.name
        return str(resolved.relative_to(Path.cwd().resolve()))
    except (OSError, ValueError):
        return str(path)


def target_record(model: torch.nn.Module, tokenizer=None, path: str | None = None) -> dict:
    """``model_identity(model)`` plus ``vocab_size`` (rows of the output head), ``hidden_size``, ``model_type``,
    ``tokenizer_fingerprint`` (None without a tokenizer) and ``path`` (``portable_path``): the record ``same_model``
    and a vocabulary check read back."""
    cfg = model.config
    return model_identity(model) | {
        "vocab_size": head_rows(model),
        "hidden_size": int(cfg.hidden_size), "model_type": getattr(cfg, "model_type", None),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "path": portable_path(path)}
