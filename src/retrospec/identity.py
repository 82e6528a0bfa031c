"""Model and tokenizer identity: fingerprints recorded in every built artefact and checked at load (bottom rank).

``model_identity`` hashes what a model computes (config without volatile keys, per-tensor RMS digest of the
weights), so an artefact built for one model is refused for another whatever its path. ``tokenizer_fingerprint``
hashes the vocabulary. Invariants: float32 and float16 loads of one checkpoint get the same identity; identities
are cached weakly per model object. Imports nothing from retrospec.
"""

from __future__ import annotations

import hashlib
import json
import weakref

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


def model_identity(model: torch.nn.Module) -> dict:
    """``config_hash``, ``weights_digest`` (per-tensor RMS, 4 significant digits) and their ``fingerprint``."""
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
