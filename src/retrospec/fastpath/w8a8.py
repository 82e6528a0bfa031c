"""Decoder layers in the ``w8a8`` format: compiled programs around fbgemm's integer matmuls.

The ``w8a8`` format (``weight_only``) quantizes each activation row to int8 as it enters a projection and multiplies
in integers; fbgemm's prepacked kernels (``weight_only.prepack_w8a8``) do that at nearly the same cost for 1 to 16
rows, so a verification costs about a plain step. Those kernels take packed weights that ``torch.export`` cannot
trace, so a layer is not one program around them (as ``fastpath.compiled`` builds for the other formats) but five,
called between the four matmuls (rows T dynamic, float32):

    norm_scale  x [T, H], norm weight            -> rows [T, H] / their scales, scales [T, 1]
    (qkv matmul)
    rotary      y [T, (h + 2 kvh) d], scales, cos, signed sin [, bias] -> [T, h + 2 kvh, d]  (rotated q, k; then v)
    (attention: ``fastpath.compiled``'s program or the engine's)
    scale       a [T, h d]                       -> rows / scales, scales
    (o matmul)
    mid         x, y, scales, norm weight [, bias] -> x + o, its normed rows / scales, scales
    (gate + up matmul, joined)
    act         y, scales [, bias]               -> silu(gate) * up, as rows / scales, scales
    (down matmul)
    out         x, y, scales [, bias]            -> x + down

Each step computes what the lean loop's ``WeightOnlyLinear`` does (rows divided by ``weight_only.row_scales``, the
integer matmul, the result times the row scales, plus the bias), fused with the norms and activations around it;
the fused norms round differently from ATen's, and an activation that lands on a rounding boundary can then take
the other int8 value, so the programs are checked against the lean loop within ``TOLERANCE`` and, like every
program, bitwise for row invariance (``fastpath.compiled.build``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weight_only import WeightOnlyLinear, row_scales
from . import aot

TOLERANCE = 1e-2  # relative, against the lean loop: a few activations may round to the neighbouring int8 value


def rotary_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, heads + 2 kv_heads, d] -> the same with the q and k heads rotated (as ``lean._rope``; signed sin)."""
    d = qkv.shape[-1]
    qk = qkv[:, : heads + kv_heads]  # [T, h + kvh, d]
    turned = torch.cat((qk[..., d // 2:], qk[..., : d // 2]), dim=-1)  # = qk.roll(d / 2, -1), lowered plainly
    qk = qk * cos[:, None] + turned * sin[:, None]
    return torch.cat((qk, qkv[:, heads + kv_heads:]), dim=1)


def _scaled(y, s, bias):  # the matmul's float result: integer sums (with the weight scale) times the row scales
    y = y * s
    return y + bias[0] if bias else y


class _NormScale(torch.nn.Module):
    ROWS_IN, FIXED = 1, None

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x, norm_w):
        h = F.rms_norm(x, (x.shape[-1],), norm_w, self.eps)
        s = row_scales(h)
        return h / s, s


class _Rotary(torch.nn.Module):
    ROWS_IN, FIXED = 4, 4

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, y, s, cos, sin, *bias):
        qkv = _scaled(y, s, bias).view(y.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
        return rotary_heads(qkv, cos, sin, self.heads, self.kv_heads)


class _Scale(torch.nn.Module):
    ROWS_IN, FIXED = 1, None

    def forward(self, a):
        s = row_scales(a)
        return a / s, s


class _Mid(torch.nn.Module):
    ROWS_IN, FIXED = 3, 4

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x, y, s, norm_w, *bias):
        x = x + _scaled(y, s, bias)
        h = F.rms_norm(x, (x.shape[-1],), norm_w, self.eps)
        s2 = row_scales(h)
        return x, h / s2, s2


class _Act(torch.nn.Module):
    ROWS_IN, FIXED = 2, 2

    def __init__(self, intermediate: int):
        super().__init__()
        self.intermediate = intermediate

    def forward(self, y, s, *bias):
        g, u = _scaled(y, s, bias).split(self.intermediate, dim=-1)
        m = F.silu(g) * u
        s3 = row_scales(m)
        return m / s3, s3


class _Out(torch.nn.Module):
    ROWS_IN, FIXED = 3, 3

    def forward(self, x, y, s, *bias):
        return x + _scaled(y, s, bias)


def _program(module: torch.nn.Module, example: list[torch.Tensor], signature: tuple, progress):
    """The runner of one step: its first ``ROWS_IN`` inputs carry the rows (dynamic), then weights; the ``FIXED``
    positional inputs before ``*bias`` (None: no ``*bias``)."""
    rows = aot.rows_dim()
    dims = [*({0: rows} for _ in range(module.ROWS_IN)), *(None for _ in example[module.ROWS_IN:])]
    if module.FIXED is not None and len(example) > module.FIXED:  # *bias given: its dims as one tuple
        dims = [*dims[:module.FIXED], tuple(dims[module.FIXED:])]
    name = aot.key("w8a8:" + type(module).__name__.strip("_").lower(), signature)
    return aot.runner(module, example, name, tuple(dims), progress)


def layer_programs(lean, layers, progress=None) -> tuple[list, list] | None:
    """(pre, post) per layer as ``fastpath.compiled.CompiledLayers`` takes them (``run(list) -> list`` and its
    tensors), or None where a layer is not all ``w8a8`` with joined q/k/v and gate/up projections, or this build has
    no fbgemm kernels."""
    linear = getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)
    if linear is None:
        return None
    pre, post = [], []

    def program(module, example, signature):  # equal layers share one runner (``aot.runner`` keeps them loaded)
        return _program(module, example, signature, progress)

    for layer, pieces in zip(layers, lean.layers):
        mods = [*pieces.qkv_modules, layer.self_attn.o_proj, *pieces.mlp_modules, layer.mlp.down_proj]
        if len(mods) != 4 or pieces.q_norm is not None or not all(
                type(m) is WeightOnlyLinear and m.fmt == "w8a8" for m in mods):
            return None
        packed = [m.packed() for m in mods]
        if any(p is None for p in packed):
            return None
        (w1, eps1), (w2, eps2) = pieces.norm_params
        if w1 is None or w2 is None:
            return None
        qkv, o, gu, down = mods
        bias = [[] if m.bias is None else [m.bias] for m in mods]
        h, kvh, d, hidden = lean.heads, lean.kv_heads, lean.head_dim, w1.shape[0]
        t = 2
        x, s = torch.randn(t, hidden), torch.rand(t, 1) + 0.5
        cos, sin = torch.randn(t, d), torch.randn(t, d)
        y_qkv, y_o = torch.randn(t, qkv.out_features), torch.randn(t, o.out_features)
        y_gu, y_down = torch.randn(t, gu.out_features), torch.randn(t, down.out_features)
        norm_scale = program(_NormScale(eps1), [x, w1], (hidden, eps1))
        rotary = program(_Rotary(h, kvh, d), [y_qkv, s, cos, sin, *bias[0]], (h, kvh, d, len(bias[0])))
        scale = program(_Scale(), [torch.randn(t, o.in_features)], (o.in_features,))
        mid = program(_Mid(eps2), [x, y_o, s, w2, *bias[1]], (hidden, eps2, len(bias[1])))
        act = program(_Act(down.in_features), [y_gu, s, *bias[2]], (down.in_features, len(bias[2])))
        out = program(_Out(), [x, y_down, s, *bias[3]], (hidden, len(bias[3])))

        def run_pre(args, p=packed[0], norm_scale=norm_scale, rotary=rotary, b=bias[0]):
            x, cos, sin, w = args  # [T, H], [T, d], [T, d], the norm weight
            rows, s = norm_scale([x, w])
            return rotary([linear(rows, 1.0, 128, p), s, cos, sin, *b])

        def run_post(args, p=packed, scale=scale, mid=mid, act=act, out=out, b=bias):
            x, a, w = args  # [T, H], [T, heads * d], the norm weight
            rows, s = scale([a])
            x, rows, s = mid([x, linear(rows, 1.0, 128, p[1]), s, w, *b[1]])
            rows, s = act([linear(rows, 1.0, 128, p[2]), s, *b[2]])
            return out([x, linear(rows, 1.0, 128, p[3]), s, *b[3]])

        pre.append((run_pre, [w1]))
        post.append((run_post, [w2]))
    return pre, post
