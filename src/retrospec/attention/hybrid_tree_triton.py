"""Triton kernel for the masked tree part of hybrid tree attention (LongSpec, Yang et al. 2025).

Contract (the same as ``hybrid_tree.tree_attention``, its PyTorch reference and test oracle):
``tree_attention_triton(q_tree, k_tree, v_tree, mask, scaling)`` with q_tree [b, h, q, d], k_tree [b, kvh, q, d],
v_tree [b, kvh, q, dv], mask bool [b or 1, q, q] (True = query i sees tree key j) returns out_tree [b, h, q, dv]
(query's dtype) and lse_tree [b, h, q] (float32, natural log of the softmax denominator, ``scaling`` included).
Grouped-query attention: query head ``hh`` reads key/value head ``hh // (h // kvh)`` (``repeat_kv`` order). A row with
nothing visible gets out 0 and lse -inf, so that ``hybrid_tree.merge_attention`` gives it no weight. One program handles
BLOCK_M query rows of one (batch, head), streaming the tree keys in BLOCK_N blocks with an online softmax (running max
``m_i``, denominator ``l_i``). Two bugs of the seed paper's kernel are avoided: a key is visible iff it is in bounds AND
the mask allows it (the seed used OR), and K and V get their own strides (the seed swapped them, which only works when
both share a layout). Triton is optional and imported lazily (``available()``). On CPU the kernel runs under
``TRITON_INTERPRET=1`` (set before the first call); that is how the tests check it.
"""

from __future__ import annotations

import functools

import torch


def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything on import
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tree_fwd(Q, K, V, M, O, LSE, scale, n_ctx, n_heads, rep,
                 sqb, sqh, sqm, sqd,  # query strides (batch, head, row, dim)
                 skb, skh, skn, skd,  # key strides
                 svb, svh, svn, svd,  # value strides (not the key's: the seed swapped them)
                 smb, smm, smn,  # mask strides (batch stride 0 when one mask serves the whole batch)
                 sob, soh, som, sod,  # output strides
                 slb, slh, slm,  # lse strides
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        bi = pid_bh // n_heads
        hi = pid_bh % n_heads
        kv = hi // rep  # GQA: query head -> key/value head
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        dims_v = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]
        row_in = rows < n_ctx  # [BLOCK_M]

        q_ptr = Q + bi * sqb + hi * sqh + rows[:, None] * sqm + dims[None, :] * sqd
        q = tl.load(q_ptr, mask=row_in[:, None] & (dims[None, :] < HEAD_D), other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the visible scores
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of exp(score - m_i) * v
        for start in range(0, n_ctx, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            col_in = cols < n_ctx
            k_ptr = K + bi * skb + kv * skh + cols[None, :] * skn + dims[:, None] * skd
            k = tl.load(k_ptr, mask=col_in[None, :] & (dims[:, None] < HEAD_D), other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N] float32
            in_bounds = row_in[:, None] & col_in[None, :]  # [BLOCK_M, BLOCK_N]
            m_ptr = M + bi * smb + rows[:, None] * smm + cols[None, :] * smn
            tree = tl.load(m_ptr, mask=in_bounds, other=0) != 0  # [BLOCK_M, BLOCK_N]
            visible = in_bounds & tree  # AND, not OR: out-of-bounds or masked keys never count
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]; -inf while a row has seen nothing
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids (-inf) - (-inf) = nan
            alpha = tl.exp(m_i - m_ref)  # [BLOCK_M]; 0 when m_i = -inf
            p = tl.exp(s - m_ref[:, None])  # [BLOCK_M, BLOCK_N]; 0 where not visible
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptr = V + bi * svb + kv * svh + cols[:, None] * svn + dims_v[None, :] * svd
            v = tl.load(v_ptr, mask=col_in[:, None] & (dims_v[None, :] < HEAD_DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        seen = l_i > 0  # [BLOCK_M]
        out = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]; 0 for an empty row
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
        o_ptr = O + bi * sob + hi * soh + rows[:, None] * som + dims_v[None, :] * sod
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_in[:, None] & (dims_v[None, :] < HEAD_DV))
        tl.store(LSE + bi * slb + hi * slh + rows * slm, lse, mask=row_in)

    return triton, tree_fwd


def tree_attention_triton(q_tree: torch.Tensor, k_tree: torch.Tensor, v_tree: torch.Tensor, mask: torch.Tensor,
                          scaling: float | None = None, block_m: int = 16,
                          block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked tree attention with the Triton kernel; see the module docstring for shapes. Needs ``available()``."""
    triton, kernel = _kernel()
    b, h, q, d = q_tree.shape
    kvh, dv = k_tree.shape[1], v_tree.shape[-1]
    if h % kvh or k_tree.shape != (b, kvh, q, d) or v_tree.shape[:3] != (b, kvh, q):
        raise ValueError(f"shapes: q {tuple(q_tree.shape)}, k {tuple(k_tree.shape)}, v {tuple(v_tree.shape)}")
    if mask.dtype != torch.bool or mask.ndim != 3 or mask.shape[0] not in (1, b) or mask.shape[1:] != (q, q):
        raise ValueError(f"mask must be bool [1 or {b}, {q}, {q}], got {mask.dtype} {tuple(mask.shape)}")
    scale = scaling if scaling is not None else d ** -0.5
    mask8 = mask.to(torch.int8)  # [mb, q, q]
    mask_batch_stride = mask8.stride(0) if mask8.shape[0] > 1 else 0
    out = torch.empty(b, h, q, dv, dtype=q_tree.dtype, device=q_tree.device)  # [b, h, q, dv]
    lse = torch.empty(b, h, q, dtype=torch.float32, device=q_tree.device)  # [b, h, q]
    grid = (triton.cdiv(q, block_m), b * h)
    kernel[grid](q_tree, k_tree, v_tree, mask8, out, lse, float(scale), q, h, h // kvh,
                 *q_tree.stride(), *k_tree.stride(), *v_tree.stride(),
                 mask_batch_stride, mask8.stride(1), mask8.stride(2),
                 *out.stride(), *lse.stride(),
                 HEAD_D=d, HEAD_DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))
    return out, lse
