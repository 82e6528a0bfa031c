"""Model and tokenizer identity: fingerprints recorded in every built artefact and checked at load (bottom rank).

``model_identity`` hashes what a model computes (config without volatile keys, per-tensor RMS digest of the
weights) and keeps the per-tensor RMS values, so that an artefact built for one model is refused for another
whatever its path. ``same_model`` is the check every loader makes: the recorded fingerprint is the model's, or the
model, held in a lower precision than float32, could be the recorded one rounded to it (a bfloat16 or float16 copy of
a float32 model: every tensor's RMS within the dtype's unit roundoff u of the recorded one, since rounding each weight
by at most a relative u moves an RMS by at most u). Artefacts written before 2026-11-27 record no RMS values: they
accept exact matches only. ``tokenizer_fingerprint`` hashes the vocabulary.

Invariants: the fingerprint is exact (one model, one dtype); ``same_model`` accepts the model and its lower-precision
copies, never a model with another config or another tensor list; identities are cached weakly per model object.
Imports nothing from retrospec.
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
    """``config_hash``, ``weights_digest`` (per-tensor RMS, 4 significant digits), their ``fingerprint``, and
    ``weights_rms`` (the RMS of every parameter, sorted by name, 7 significant digits) for ``same_model``."""
    if model in _MODEL_IDS:
        return _MODEL_IDS[model]
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _sha(json.dumps(cfg, sort_keys=True, default=str))
    with torch.no_grad():
        params = sorted(model.named_parameters())
        rms = [p.detach().double().pow(2).mean().sqrt().item() for _, p in params]
    weights = _sha("|".join(f"{name}:{tuple(p.shape)}:{r:.4g}" for (name, p), r in zip(params, rms)))
    ident = {"config_hash": config_hash, "weights_digest": weights, "fingerprint": _sha(config_hash + weights),
             "weights_rms": [float(f"{r:.7g}") for r in rms]}
    _MODEL_IDS[model] = ident
    return ident


def _unit_roundoff(model: torch.nn.Module) -> float:
    """The largest relative rounding error of the model's floating-point parameter dtypes (half their epsilon:
    2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32)."""
    return max((torch.finfo(p.dtype).eps / 2 for p in model.parameters() if p.is_floating_point()),
               default=2.0 ** -24)


def same_model(recorded: dict | None, model: torch.nn.Module) -> bool:
    """Whether ``recorded`` (an identity an artefact stored: ``fingerprint``, maybe ``config_hash`` and
    ``weights_rms``) is ``model``'s, or ``model`` could be that model rounded to its own precision."""
    if not recorded or recorded.get("fingerprint") is None:
        return False
    have = model_identity(model)
    if recorded["fingerprint"] == have["fingerprint"]:
        return True
    u = _unit_roundoff(model)
    if u <= 2.0 ** -24:  # a float32 (or wider) model: only its exact fingerprint
        return False
    want = recorded.get("weights_rms")
    if recorded.get("config_hash") != have["config_hash"] or not isinstance(want, list) \
            or len(want) != len(have["weights_rms"]):
        return False
    tol = u * 1.01 + 1e-7  # 1 %: the float64 sums themselves; 1e-7: the 7 recorded digits
    try:
        return all(abs(float(a) - b) <= tol * max(abs(float(a)), b) + 1e-12 for a, b in zip(want, have["weights_rms"]))
    except (TypeError, ValueError):  # a corrupt list: not a match
        return False
