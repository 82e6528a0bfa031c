"""What the attention implementations share: ``hybrid_mask_block``, the q x q block of a 4D mask when every prefix
column is visible (the rule in ``hybrid_tree``'s docstring), and ``switch`` / ``restore`` of a model's attention
implementation through the public ``set_attn_implementation``. Imports nothing else from ``attention``.
"""

from __future__ import annotations

import torch


def hybrid_mask_block(attention_mask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The mask's tree block [mb, mh, q, q] when the hybrid split applies, else None. attention_mask [mb, mh, q, L]
    (mb in {1, b}, mh in {1, h}); query [b, h, q, d]; key [b, kvh, L, d]."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4:
        return None
    b, h, q = query.shape[:3]
    kvh, length = key.shape[1], key.shape[2]
    mb, mh, mq, ml = attention_mask.shape
    if not (1 < q < length) or h % kvh or mq != q or ml != length or mb not in (1, b) or mh not in (1, h):
        return None
    prefix = attention_mask[..., : length - q]  # [mb, mh, q, L - q] view
    if attention_mask.dtype == torch.bool:
        visible = bool(prefix.all())
    elif attention_mask.is_floating_point():
        visible = not bool(prefix.any())  # additive: exactly 0 everywhere (NaN and -0.0 handled: NaN is "any")
    else:
        return None
    return attention_mask[..., length - q:] if visible else None  # [mb, mh, q, q] view


def switch(model: torch.nn.Module, name: str, accept: tuple[str, ...] = ("sdpa",)) -> bool:
    """Set ``model``'s attention implementation to the registered ``name`` (public ``set_attn_implementation``)
    when its current one is in ``accept`` (or already ``name``); False, and nothing changed, otherwise."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == name:
        return True
    if current not in accept or not hasattr(model, "set_attn_implementation"):
        return False
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError, AttributeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == name


def restore(model: torch.nn.Module, name: str) -> None:
    """Back to ``sdpa`` if ``name`` is the model's attention implementation; otherwise nothing changes."""
    if getattr(model.config, "_attn_implementation", None) == name:
        model.set_attn_implementation("sdpa")
