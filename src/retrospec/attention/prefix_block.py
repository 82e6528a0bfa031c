"""Verification attention over a long cached prefix: the prefix unmasked, a small causal block for the new tokens.

Why: verifying gamma draft tokens over a long KV cache should cost about one decode step (both read the whole
cache once). transformers' ``sdpa`` path does not get there on CPU for a multi-token query: it materializes a
[q, cache] mask and, with grouped-query attention, copies every key/value head (``repeat_kv``) before a masked
kernel; at 16K cached tokens that copy dominates the call.

What: ``prefix_block_attention``, registered through the public ``AttentionInterface`` as ``ATTN_NAME``. With no
mask (the name is no registered mask interface, so transformers passes None) and a query shorter than the cache,
the queries are the last ``q`` cache entries (the engine's invariant): every query sees the whole prefix and a
causal q x q block. Query heads sharing a key/value head are packed (no ``repeat_kv``), scored in one matmul, only
the last q x q block is masked, and one softmax normalises prefix and block together. An explicit 4D mask (a draft
tree) takes the same path with the tree's ancestor block when every prefix column is visible (checked per call; a
16-node tree then costs what a 17-token chain does, ~10 % less than ``hybrid_tree``'s two-softmax split), else
``sdpa``. A one-token decode step runs ``_one_row`` (grouped heads packed, no ``repeat_kv`` copy); the prefill goes
to ``sdpa`` with the mask it would have built.

``enable`` / ``disable`` switch through the public ``set_attn_implementation``. Equality with ``sdpa`` is tested.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .common import hybrid_mask_block, restore, switch

ATTN_NAME = "retrospec_prefix_block"
ROW_EXACT = "_retrospec_row_exact"  # a config attribute: True = every query row as its own one-token step


def _one_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """One query position over the keys it sees, as a one-token decode step computes it. query [b, h, 1, d];
    key/value [b, kvh, n, d] (n keys, in cache order) -> [b, h, 1, d]."""
    b, h, _, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    qg = query.reshape(b * kvh, h // kvh, d)  # [b * kvh, rep, d]: heads sharing a key/value head
    # bmm over [b * kvh] (a view of the cache where its strides allow): the same products as a 4D matmul, without
    # its broadcasting machinery (~20 % of this call at 2K cached tokens)
    scores = torch.bmm(qg, key.reshape(b * kvh, n, d).transpose(1, 2)) * scaling  # [b * kvh, rep, n]
    if scores.dtype == torch.float32:
        probs = scores.softmax(-1)  # the same kernel as with dtype=float32, one dispatch less
    else:
        probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    return torch.bmm(probs, value.reshape(b * kvh, n, d)).reshape(b, h, 1, d)


def _row_exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                         visible: torch.Tensor | None = None) -> torch.Tensor:
    """Each of the q query rows computed alone, over exactly the keys a one-token step at its position reads, in the
    same order and with the same operations (``_one_row``): row i of a q-token verification is then bitwise the
    one-token step's, whatever q is. query [b, h, q, d]; key/value [b, kvh, L, d], the q queries the last q cache
    entries; ``visible`` [q, L] bool (a draft tree: a node sees the prefix and its ancestors), default causal.
    -> [b, q, h, d]."""
    q, length = query.shape[2], key.shape[2]
    rows = []
    for i in range(q):
        if visible is None:
            k, v = key[:, :, :length - q + i + 1], value[:, :, :length - q + i + 1]
        else:
            seen = visible[i].nonzero()[:, 0]  # [n] increasing: the prefix, then the node's ancestors and itself
            k, v = key.index_select(2, seen), value.index_select(2, seen)
        rows.append(_one_row(query[:, :, i:i + 1], k, v, scaling))
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous()


def _block_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     block_mask: torch.Tensor | None = None):
    """query [b, h, q, d]; key/value [b, kvh, L, d] with the q queries at positions L - q .. L - 1. The last q x q
    block is causal, or ``block_mask`` [1, 1, q, q] (additive float, or bool True = visible: a draft tree)."""
    b, h, q, d = query.shape
    kvh, length = key.shape[1], key.shape[2]
    rep = h // kvh
    qg = query.reshape(b, kvh, rep * q, d)  # heads sharing a key/value head, stacked along the query axis
    scores = torch.matmul(qg, key.transpose(-1, -2)) * scaling  # [b, kvh, rep * q, L]
    block = scores.view(b, kvh, rep, q, length)[..., length - q:]  # [b, kvh, rep, q, q] view of the new block
    if block_mask is None:
        block.masked_fill_(torch.ones(q, q, dtype=torch.bool, device=query.device).triu_(1), float("-inf"))
    elif block_mask.dtype == torch.bool:
        block.masked_fill_(~block_mask[0, 0], float("-inf"))
    else:
        block.add_(block_mask[0, 0])
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kvh, rep * q, d]
    return out.view(b, h, q, d).transpose(1, 2).contiguous()  # [b, q, h, d]


def prefix_block_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    q, length = query.shape[2], key.shape[2]
    if q == 1 < length and attention_mask is None and not module.training and query.shape[1] % key.shape[1] == 0:
        # a decode step: the same one-row attention, which reads each key/value head once (sdpa's path copies them
        # per query head first: 1.6-2x the time from 2K cached tokens on, equal below); row-exact or not, a single
        # row over the whole cache is exactly this
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return _one_row(query, key, value, scale).transpose(1, 2).contiguous(), None
    if (q < length and getattr(getattr(module, "config", None), ROW_EXACT, False) and not module.training
            and query.shape[0] == 1 and query.shape[1] % key.shape[1] == 0):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        visible = None
        if torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
            rows = attention_mask[0, 0]  # [q, L]
            visible = rows if rows.dtype == torch.bool else rows == 0
        return _row_exact_attention(query, key, value, scale, visible), None
    if attention_mask is None and 1 < q < length and not module.training and query.shape[1] % key.shape[1] == 0:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return _block_attention(module, query, key, value, scale), None
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 4 and 1 < q < length:
        # an explicit 4D mask (a draft tree): when every prefix column is visible, the same single-softmax block
        # attention as a chain with the tree's block mask in place of the causal one; else sdpa
        block = None
        if not dropout and not module.training and attention_mask.shape[:2] == (1, 1) and query.shape[0] == 1:
            block = hybrid_mask_block(attention_mask, query, key)  # [1, 1, q, q] or None
        if block is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return _block_attention(module, query, key, value, scale, block), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is None and 1 < q < length:  # what sdpa_mask would have given sdpa: causal over the cache
        attention_mask = sdpa_mask(batch_size=query.shape[0], q_length=q, kv_length=length,
                                   q_offset=length - q, kv_offset=0, mask_function=causal_mask_function,
                                   allow_is_causal_skip=False, device=query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(ATTN_NAME, prefix_block_attention)


def enable(model: torch.nn.Module) -> bool:
    """Use the prefix + block attention in ``model`` (public ``set_attn_implementation``); False if unsupported."""
    return switch(model, ATTN_NAME)


def disable(model: torch.nn.Module) -> None:
    restore(model, ATTN_NAME)
