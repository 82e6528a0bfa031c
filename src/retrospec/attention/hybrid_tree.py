"""Hybrid tree attention: verify a draft tree over a long KV cache as (unmasked prefix) + (masked tree block).

Why (LongSpec: Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and
Verification", 2025). Tree verification runs one target forward over ``[last token, *tree]`` with a 4D ancestor mask.
Given that mask, transformers' ``sdpa`` path attends through a dense [q, L] mask, and with grouped-query attention it
first copies every key/value head ``num_key_value_groups`` times (``repeat_kv``), because the masked kernels take no
GQA. Yet only the last q x q block of that mask is not "all visible". The paper measures verification attention at
49.9 ms with Hugging Face's masked attention against 12.5 ms with its hybrid kernel, at long context.

What. ``hybrid_tree_attention`` (registered through the public ``AttentionInterface`` under ``ATTN_NAME``) splits the
keys into the cached prefix [0, L - q) and the last q columns [L - q, L) (the tree block: the q query tokens are the
last q cache entries after the cache update, the engine's invariant), and computes

- the prefix part without a mask: the query heads that share a key/value head are packed along the query axis (no
  ``repeat_kv`` copy), one matmul against the prefix keys, its own log-sum-exp ``lse_prefix``;
- the tree part with the mask's own q x q block (bool, or additive float values as given), its ``lse_tree``;
- the merge ``out = w * out_prefix + (1 - w) * out_tree`` with ``w = sigmoid(lse_prefix - lse_tree)``, which is
  the softmax over all L columns split in two (exact up to float summation order).

The softmax scale is the model's ``scaling`` argument (``head_dim ** -0.5`` only when none is given).

Precision. Scores come from a matmul in the input dtype (rounded to it, as in transformers' eager attention); the
softmax statistics and the merge are float32. In float32 the result equals masked sdpa to ~1e-7 (tested at 1e-5);
in bfloat16 it is as close to a float32 reference as eager attention is (a little less close than sdpa's fused
kernel, which never rounds the scores). On CPU the prefix part is compute-bound for q of a few dozen queries (it is
two [rep*q, d] x [d, L] sized matmuls per key/value head).

When (detection, ``hybrid_mask_block``). The hybrid path runs iff all of these hold, and is then exact for *any*
mask, whatever the last q columns hold; otherwise the call goes to transformers' own ``sdpa_attention_forward``
unchanged (same arguments, same result as with ``attn_implementation="sdpa"``):

- a 4D tensor mask of shape [1 or b, 1 or h, q, L] (not a BlockMask), bool (True = visible) or floating (additive);
- 1 < q < L (one query is decoding, q == L is prefill: both stay with sdpa);
- every prefix column [0, L - q) is visible for every query: bool mask all True there, float mask all exactly 0
  there (``not any``: a NaN or a bias counts as masked). This is *checked on every call* rather than trusted from a
  flag: it is one reduction over q x (L - q) mask entries (about 1/d of the attention's own arithmetic), and it makes
  the fast path safe for padded batches, sliding windows, static caches and masks built by anyone else.
- no dropout, and none of the extras sdpa handles or rejects (``position_bias``, ``softcap``, sinks, a paged cache);
  the query heads are a multiple of the key/value heads.

Masks. The engine (``verify.Verifier.score``) passes a 4D additive float mask (0 visible, dtype min hidden) for a
tree; transformers hands a 4D mask to the attention function as is. For a chain (no mask from the engine)
transformers builds the mask itself: ``ATTN_NAME`` is also registered in the public ``AttentionMaskInterface`` with
``sdpa_mask``, so the function receives exactly the bool mask (or ``None`` when sdpa would skip it) that the
``sdpa`` path would get, padding included. A chain is then a tree whose block is causal.

Enabling it (``enable``) sets the model's attention implementation through the public ``set_attn_implementation``;
``disable`` restores ``sdpa``. On CUDA with Triton installed, the tree part runs the Triton kernel
``hybrid_tree_triton.tree_attention_triton`` (same contract as ``tree_attention`` here) whenever the block is a plain
visible / hidden mask (``tree_part``); otherwise, and everywhere without Triton, the PyTorch ``tree_attention``.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import hybrid_tree_triton, prefix_block
from .common import hybrid_mask_block, restore, switch

ATTN_NAME = "retrospec_hybrid_tree"
_EXTRAS = ("position_bias", "softcap", "s_aux", "sinks", "cache")  # handled (or refused) by sdpa: never hybrid


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query over every key, GQA-packed: no ``repeat_kv`` copy.

    query [b, h, q, d]; key [b, kvh, P, d]; value [b, kvh, P, dv] -> out [b, h, q, dv] (float32, normalised),
    lse [b, h, q] (float32, natural log of the softmax denominator, scale included).
    """
    b, h, q, d = query.shape
    kvh = key.shape[1]
    qg = query.reshape(b, kvh, (h // kvh) * q, d)  # [b, kvh, rep*q, d]: head kv*rep + r holds rows r*q .. r*q+q-1
    scores = torch.matmul(qg, key.transpose(-1, -2)).float().mul_(scaling)  # [b, kvh, rep*q, P] (fresh: in place ok)
    peak = scores.amax(-1, keepdim=True)  # [b, kvh, rep*q, 1]
    weights = scores.sub_(peak).exp_()  # [b, kvh, rep*q, P] unnormalised, in (0, 1]
    denom = weights.sum(-1, keepdim=True)  # [b, kvh, rep*q, 1], >= 1
    out = torch.matmul(weights.to(value.dtype), value).float().div_(denom)  # [b, kvh, rep*q, dv]
    lse = (peak + denom.log()).squeeze(-1)  # [b, kvh, rep*q]
    return out.view(b, h, q, -1), lse.view(b, h, q)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of the q tree queries over the q tree keys (the reference for the Triton kernel).

    query [b, h, q, d]; key [b, kvh, q, d]; value [b, kvh, q, dv]; mask [mb, q, q] or [mb, mh, q, q] (mb in {1, b},
    mh in {1, h}), bool (True = visible) or additive float -> out [b, h, q, dv] (float32), lse [b, h, q] (float32).
    A row with nothing visible gets out 0 and lse -inf (it then takes no weight in ``merge_attention``).
    """
    b, h, q, d = query.shape
    kvh = key.shape[1]
    rep = h // kvh
    if mask.ndim == 3:
        mask = mask[:, None]  # [mb, 1, q, q]
    mb, mh = mask.shape[:2]
    qg = query.reshape(b, kvh, rep * q, d)  # [b, kvh, rep*q, d]
    scores = torch.matmul(qg, key.transpose(-1, -2)).float().mul_(scaling)  # [b, kvh, rep*q, q]
    scores = scores.view(b, kvh, rep, q, q)  # [b, kvh, rep, q, q]
    block = mask.reshape(mb, kvh, rep, q, q) if mh == h else mask[:, :, None]  # [mb, kvh|1, rep|1, q, q]
    if block.dtype == torch.bool:
        scores.masked_fill_(~block, float("-inf"))
    else:
        scores.add_(block.float())
    lse = torch.logsumexp(scores, -1, keepdim=True)  # [b, kvh, rep, q, 1]; -inf for an empty row
    probs = scores.sub_(lse.masked_fill(lse == float("-inf"), 0.0)).exp_()  # [b, kvh, rep, q, q]; 0 in an empty row
    out = torch.matmul(probs.view(b, kvh, rep * q, q).to(value.dtype), value).float()  # [b, kvh, rep*q, dv]
    return out.view(b, h, q, -1), lse.view(b, h, q)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the parts: out_* [b, h, q, dv], lse_* [b, h, q].

    ``w = sigmoid(lse_a - lse_b)`` is the share of the softmax mass on set a; returns [b, h, q, dv] (float32).
    """
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # [b, h, q, 1]; 1 where lse_b = -inf (set b empty)
    return torch.lerp(out_b, out_a, w)  # out_b + w * (out_a - out_b) = w * out_a + (1 - w) * out_b


@functools.cache
def _triton_importable() -> bool:
    return hybrid_tree_triton.available()


def use_triton(query: torch.Tensor) -> bool:
    """Whether the tree part runs the Triton kernel: on CUDA tensors, when Triton is installed."""
    return query.is_cuda and _triton_importable()


def binary_block(block: torch.Tensor) -> torch.Tensor | None:
    """The tree block [mb, 1, q, q] as the kernel's bool mask [mb, q, q] (True = visible), or None when the block
    is not a plain visible / hidden mask (an additive bias: the PyTorch path keeps it exact). A float entry counts as
    hidden at or below half the dtype's minimum (its softmax weight is exactly 0), as visible at exactly 0."""
    if block.shape[1] != 1:
        return None
    if block.dtype == torch.bool:
        return block[:, 0]
    hidden = block <= torch.finfo(block.dtype).min / 2
    if not bool((hidden | (block == 0)).all()):
        return None
    return ~hidden[:, 0]


def tree_part(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block: torch.Tensor,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_attention``, dispatched to the Triton kernel (``hybrid_tree_triton``, same contract) when
    ``use_triton`` holds and the block is a plain mask; out [b, h, q, dv] float32, lse [b, h, q]."""
    mask = binary_block(block) if use_triton(query) else None  # [mb, q, q] bool or None
    if mask is None:
        return tree_attention(query, key, value, block, scaling)
    out, lse = hybrid_tree_triton.tree_attention_triton(query, key, value, mask, scaling)
    return out.float(), lse


def _hybrid_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """query [b, h, q, d]; key/value [b, kvh, L, d|dv]; block [mb, mh, q, q] -> [b, q, h, dv] in query's dtype."""
    q, length = query.shape[2], key.shape[2]
    cut = length - q
    out_p, lse_p = prefix_attention(query, key[:, :, :cut], value[:, :, :cut], scaling)  # [b, h, q, dv], [b, h, q]
    out_t, lse_t = tree_part(query, key[:, :, cut:], value[:, :, cut:], block, scaling)  # same shapes
    out = merge_attention(out_p, lse_p, out_t, lse_t)  # [b, h, q, dv] float32
    return out.to(query.dtype).transpose(1, 2).contiguous()  # [b, q, h, dv], what attention interfaces return


def hybrid_tree_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """``AttentionInterface`` function: hybrid when ``hybrid_mask_block`` applies, else transformers' ``sdpa``.

    query [b, h, q, d]; key/value [b, kvh, L, d] (after the cache update) -> ([b, q, h, d], None).
    """
    block = None
    if not dropout and not any(kwargs.get(k) is not None for k in _EXTRAS):
        block = hybrid_mask_block(attention_mask, query, key)  # [mb, mh, q, q] or None
    if block is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _hybrid_forward(query, key, value, block, scale), None


AttentionInterface.register(ATTN_NAME, hybrid_tree_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # the function sees the masks sdpa would see


def enable(model: torch.nn.Module) -> bool:
    """Use hybrid tree attention in ``model`` (public ``set_attn_implementation``); False if unsupported.

    Accepted from ``sdpa`` or ``prefix_block`` (both compute the same attention); any other implementation is left
    alone, since the fallback is ``sdpa``.
    """
    return switch(model, ATTN_NAME, accept=("sdpa", prefix_block.ATTN_NAME))


def disable(model: torch.nn.Module) -> None:
    """Back to ``sdpa`` if hybrid tree attention is on; otherwise nothing changes."""
    restore(model, ATTN_NAME)
