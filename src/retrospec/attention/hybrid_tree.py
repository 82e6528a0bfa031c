"""Hybrid tree attention: verify a draft tree over a long KV cache as (unmasked prefix) + (masked tree block).

Why (LongSpec: Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and
Verification", 2025). With a 4D ancestor mask, transformers' ``sdpa`` path attends through a dense [q, L] mask and,
with grouped-query attention, first copies every key/value head (``repeat_kv``), though only the last q x q block
is not all visible. The paper measures 49.9 ms with Hugging Face's masked attention against 12.5 ms hybrid.

What. ``hybrid_tree_attention`` (registered through the public ``AttentionInterface`` as ``ATTN_NAME``) splits the
keys into the cached prefix [0, L - q) and the tree block [L - q, L) (the q queries are the last q cache entries,
the engine's invariant), and computes
- the prefix part without a mask, query heads sharing a key/value head packed along the query axis (no
  ``repeat_kv``), with its log-sum-exp ``lse_prefix``;
- the tree part with the mask's own q x q block (bool, or additive float), with ``lse_tree``;
- ``out = w * out_prefix + (1 - w) * out_tree``, ``w = sigmoid(lse_prefix - lse_tree)``: the softmax over all L
  columns split in two (exact up to float summation order). Scale: the model's ``scaling`` (else head_dim ** -0.5).

Precision: scores are a matmul in the input dtype (as in eager attention); softmax statistics and the merge are
float32. In float32 it equals masked sdpa to ~1e-7 (tested at 1e-5).

When (``common.hybrid_mask_block``): the hybrid path runs iff all of these hold, and is then exact for *any* mask;
otherwise the call goes unchanged to transformers' ``sdpa_attention_forward``:
- a 4D tensor mask [1 or b, 1 or h, q, L] (not a BlockMask), bool (True = visible) or floating (additive);
- 1 < q < L (decoding and prefill stay with sdpa);
- every prefix column is visible for every query (bool all True, float all exactly 0: a NaN or bias counts as
  masked), *checked on every call*: one reduction over q x (L - q) entries, which keeps the path safe for padded
  batches, sliding windows, static caches and anyone else's masks;
- no dropout, none of the extras sdpa handles (``position_bias``, ``softcap``, sinks, a paged cache), and the query
  heads a multiple of the key/value heads.

Masks: the engine passes a 4D additive float mask for a tree. For a chain transformers builds the mask: ``ATTN_NAME``
is also registered in ``AttentionMaskInterface`` with ``sdpa_mask``, so the function gets exactly sdpa's mask.

``enable`` / ``disable`` switch the model through the public ``set_attn_implementation``. On CUDA, when Triton is
installed and its kernel passed ``triton_ready``'s self-check on that device and dtype, the tree part runs
``hybrid_tree_triton.tree_attention_triton`` for a plain visible / hidden block (``tree_part``); otherwise the PyTorch
``tree_attention``. A model's config may carry ``MIN_LENGTH`` (set by the engine from a measured crossover): below
that many keys the call goes to sdpa.
"""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import hybrid_tree_triton, prefix_block
from .common import hybrid_mask_block, restore, switch

ATTN_NAME = "retrospec_hybrid_tree"
MIN_LENGTH = "retrospec_hybrid_min_length"  # config attribute: fewer keys than this -> sdpa (absent: 0)
_EXTRAS = ("position_bias", "softcap", "s_aux", "sinks", "cache")  # handled (or refused) by sdpa: never hybrid


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of every query over every key, GQA-packed (no ``repeat_kv`` copy). query [b, h, q, d];
    key [b, kvh, P, d]; value [b, kvh, P, dv] -> out [b, h, q, dv] (float32), lse [b, h, q] (float32, scale in)."""
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
    """Masked attention of the q tree queries over the q tree keys (the Triton kernel's reference).

    query [b, h, q, d]; key [b, kvh, q, d]; value [b, kvh, q, dv]; mask [mb, (mh,) q, q] (mb in {1, b}, mh in
    {1, h}), bool or additive -> out [b, h, q, dv], lse [b, h, q] (float32); an empty row: out 0, lse -inf.
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
    """Attention over two disjoint key sets from the parts (out_* [b, h, q, dv], lse_* [b, h, q]): ``w = sigmoid(lse_a
    - lse_b)`` is set a's share of the softmax mass. Float32 out, whatever the parts' dtypes (the Triton kernel writes
    its out in the query's dtype: a bfloat16 part beside a float32 one once failed in ``lerp`` on the GPU)."""
    w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)  # [b, h, q, 1]; 1 where lse_b = -inf (b empty)
    return torch.lerp(out_b.float(), out_a.float(), w)  # out_b + w * (out_a - out_b) = w * out_a + (1 - w) * out_b


def triton_self_check(device: torch.device, dtype: torch.dtype, head_dim: int = 64, value_dim: int | None = None
                      ) -> bool:
    """Whether the Triton kernel runs on ``device`` in ``dtype`` at these head sizes and equals ``tree_attention`` on
    a random GQA tree with an empty row (the cases the verifier sends); any failure is False."""
    if not hybrid_tree_triton.available():
        return False
    gen = torch.Generator().manual_seed(0)
    q, h, kvh = 9, 4, 2
    query, key = (torch.randn(1, n, q, head_dim, generator=gen).to(device, dtype) for n in (h, kvh))
    value = torch.randn(1, kvh, q, value_dim or head_dim, generator=gen).to(device, dtype)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]  # the root's 8 descendants, two branches
    mask = torch.eye(q, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p + 1] if p >= 0 else mask[0]
    mask[4] = False  # a row that sees nothing: out 0, lse -inf
    mask = mask[None].to(device)  # [1, q, q]
    try:
        out, lse = hybrid_tree_triton.tree_attention_triton(query, key, value, mask, 0.125)
        ref_out, ref_lse = tree_attention(query, key, value, mask, 0.125)
    except Exception as exc:  # no driver, a compiler error, an unsupported dtype: the PyTorch path stays
        warnings.warn(f"Triton tree kernel unusable on {device} ({dtype}): {type(exc).__name__}: {exc}; "
                      "using the PyTorch tree part", RuntimeWarning, stacklevel=2)
        return False
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ok = bool(torch.allclose(out.float(), ref_out, atol=tol, rtol=tol) and torch.equal(lse.isinf(), ref_lse.isinf())
              and torch.allclose(lse[~lse.isinf()], ref_lse[~ref_lse.isinf()], atol=tol, rtol=tol))
    if not ok:
        warnings.warn(f"Triton tree kernel differs from the PyTorch reference on {device} ({dtype}); using the "
                      "PyTorch tree part", RuntimeWarning, stacklevel=2)
    return ok


@functools.cache
def triton_ready(device: torch.device, dtype: torch.dtype, head_dim: int = 64, value_dim: int | None = None) -> bool:
    """``triton_self_check``, once per device, dtype and head sizes."""
    return triton_self_check(device, dtype, head_dim, value_dim)


def use_triton(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the tree part runs the Triton kernel: on CUDA tensors, when the kernel passed its self-check there at
    these head sizes."""
    return query.is_cuda and triton_ready(query.device, query.dtype, query.shape[-1], value.shape[-1])


def binary_block(block: torch.Tensor) -> torch.Tensor | None:
    """The tree block [mb, 1, q, q] as the kernel's bool mask [mb, q, q], or None unless every entry is visible (0)
    or hidden (<= half the dtype's minimum: softmax weight exactly 0); a bias stays on the exact PyTorch path."""
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
    mask = binary_block(block) if use_triton(query, value) else None  # [mb, q, q] bool or None
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
    query [b, h, q, d]; key/value [b, kvh, L, d] (after the cache update) -> ([b, q, h, d], None)."""
    block = None
    min_length = getattr(getattr(module, "config", None), MIN_LENGTH, 0)
    if not dropout and key.shape[2] >= min_length and not any(kwargs.get(k) is not None for k in _EXTRAS):
        block = hybrid_mask_block(attention_mask, query, key)  # [mb, mh, q, q] or None
    if block is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _hybrid_forward(query, key, value, block, scale), None


AttentionInterface.register(ATTN_NAME, hybrid_tree_attention)
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # the function sees the masks sdpa would see


def enable(model: torch.nn.Module) -> bool:
    """Use hybrid tree attention in ``model``, from ``sdpa`` or ``prefix_block`` only; False if unsupported."""
    return switch(model, ATTN_NAME, accept=("sdpa", prefix_block.ATTN_NAME))


def disable(model: torch.nn.Module) -> None:
    """Back to ``sdpa`` if hybrid tree attention is on; otherwise nothing changes."""
    restore(model, ATTN_NAME)
