"""Model and tokenizer identity: fingerprints recorded in every built artefact and checked at load (bottom rank).

``model_identity`` hashes what a model computes (config without volatile keys, per-tensor RMS digest of the
weights) and keeps the per-tensor RMS values, so that an artefact built for one model is refused for another
whatever its path. ``same_model`` is the check every loader makes: the recorded fingerprint is the model's, or one
of the two is held in a lower precision and could be the other rounded to it (a bfloat16 or float16 copy of a float32
model, either way round: every tensor's RMS within the coarser dtype's unit roundoff u, since rounding each weight by
at most a relative u moves an RMS by at most u). Artefacts written before 2026-11-27 record no RMS values (and no
dtype: float32 is assumed); they accept exact matches only. ``tokenizer_fingerprint`` hashes the vocabulary.

Invariants: the fingerprint is exact (one model, one dtype); two float32 identities match only exactly; ``same_model``
accepts the model and its lower-precision copies, never a model with another config or another tensor list;
identities are cached weakly per model object. Imports nothing from retrospec.
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
    """``config_hash``, ``weights_digest`` (per-tensor RMS, 4 significant digits), their ``fingerprint``, and for
    ``same_model``: ``weights_rms`` (the RMS of every parameter, sorted by name, 7 significant digits) and ``dtype``
    (the coarsest floating-point dtype among the parameters)."""
    if model in _MODEL_IDS:
        return _MODEL_IDS[model]
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _sha(json.dumps(cfg, sort_keys=True, default=str))
    with torch.no_grad():
        params = sorted(model.named_parameters())
        rms = [p.detach().double().pow(2).mean().sqrt().item() for _, p in params]
    weights = _sha("|".join(f"{name}:{tuple(p.shape)}:{r:.4g}" for (name, p), r in zip(params, rms)))
    ident = {"config_hash": config_hash, "weights_digest": weights, "fingerprint": _sha(config_hash + weights),
             "weights_rms": [float(f"{r:.7g}") for r in rms], "dtype": _coarsest_dtype(model)}
    _MODEL_IDS[model] = ident
    return ident


def _coarsest_dtype(model: torch.nn.Module) -> str:
    """The name of the floating-point parameter dtype with the largest epsilon (``float32`` when there is none)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} or {torch.float32}
    return str(max(dtypes, key=lambda d: torch.finfo(d).eps)).removeprefix("torch.")


def _unit_roundoff(dtype_name: object) -> float | None:
    """Half the epsilon of a dtype name (2^-8 bfloat16, 2^-11 float16, 2^-24 float32); None for an unknown name."""
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    return torch.finfo(dtype).eps / 2 if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def same_model(recorded: dict | None, model: torch.nn.Module) -> bool:
    """Whether ``recorded`` (an identity an artefact stored: ``fingerprint``, maybe ``config_hash``, ``weights_rms``
    and ``dtype``) is ``model``'s, or one of the two could be the other rounded to its lower precision."""
    if not recorded or recorded.get("fingerprint") is None:
        return False
    have = model_identity(model)
    if recorded["fingerprint"] == have["fingerprint"]:
        return True
    u_recorded = _unit_roundoff(recorded.get("dtype", "float32"))
    if u_recorded is None:  # a corrupt dtype: not a match
        return False
    u = max(_unit_roundoff(have["dtype"]), u_recorded)
    if u <= 2.0 ** -24:  # both float32 (or wider): only the exact fingerprint
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
