"""Decoder layers in the ``w8a8`` format: compiled programs around fbgemm's integer matmuls.

``w8a8`` quantizes activation rows to int8 as they enter a projection and multiplies in integers, at nearly the same
cost for 1 to 8 rows, so a verification costs little more than a plain step, through fbgemm's prepacked kernels
(``weight_only.prepack_w8a8``; each row divided by its scale here, the scale applied after). fbgemm's packed weights
cannot be traced by ``torch.export``, so a layer is not one program around them (as ``fastpath.compiled`` builds for
the other formats, ``w4a8``'s operator included) but a few small ones called between the four matmuls (rows T
dynamic, float32; s: the row scales):

    norm    x [T, H], norm weight               -> rows [T, H], s [T, 1]
    (qkv matmul)
    rotary  y [T, (h + 2 kvh) d], s, cos, signed sin [, bias] -> [T, h + 2 kvh, d]  (rotated q, k; then v)
    (the keys and values into the cache; ``kernels.attention``)
    scale   a [T, h d]                          -> a / s, s
    (o matmul)
    mid     x, y, s, norm weight [, bias]       -> x + o, its normed rows, s
    (gate + up matmul, joined)
    act     y, s [, bias]                       -> silu(gate) * up, s
    (down matmul)
    out     x, y, s [, bias]                    -> x + down

Each step computes what the lean loop's ``WeightOnlyLinear`` does, fused with the norms and activations around it;
the fused norms round differently from ATen's, and an activation that lands on a rounding boundary can then take
the other int8 value, so the programs are checked against the lean loop within ``TOLERANCE`` and, like every
program, bitwise for row invariance (``fastpath.compiled.build``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weight_only import WeightOnlyLinear, row_scales
from . import aot

FORMATS = ("w8a8", "w4a8")  # formats whose activations are quantized to int8 (``w8a8``: this module's programs)
TOLERANCE = 1e-2  # relative, against the lean loop: a few activations may round to the neighbouring int8 value


def rotary_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, heads + 2 kv_heads, d] -> the same with the q and k heads rotated (as ``lean._rope``; signed sin)."""
    d = qkv.shape[-1]
    qk = qkv[:, : heads + kv_heads]  # [T, h + kvh, d]
    turned = torch.cat((qk[..., d // 2:], qk[..., : d // 2]), dim=-1)  # = qk.roll(d / 2, -1), lowered plainly
    qk = qk * cos[:, None] + turned * sin[:, None]
    return torch.cat((qk, qkv[:, heads + kv_heads:]), dim=1)


class _Step(torch.nn.Module):
    """One program: its first ``rows_in`` inputs carry rows (dynamic), the rest are fixed. A matmul's result comes
    with its row scales (``TAKES_SCALE``: right after the row inputs), and rows leave divided by theirs."""

    ROWS, TAKES_SCALE = 1, False  # row-carrying inputs besides a scale; whether a matmul result's scale comes in
    NAMED = 1  # inputs named in ``forward`` before ``*args`` (the rest arrive as one tuple)

    def __init__(self, *params):
        super().__init__()
        self.params = params
        self.rows_in = self.ROWS + int(self.TAKES_SCALE)

    @staticmethod
    def result(y, args):
        """(the matmul's float result times its row scales; the args after that scale)."""
        return y * args[0], args[1:]

    @staticmethod
    def rows(h) -> tuple:
        """What enters the next matmul: (h / s, s)."""
        s = row_scales(h)
        return h / s, s


def _biased(y, bias: tuple):
    return y + bias[0] if bias else y


class _Norm(_Step):
    NAMED = 2

    def forward(self, x, norm_w):
        return self.rows(F.rms_norm(x, (x.shape[-1],), norm_w, self.params[0]))


class _Rotary(_Step):
    ROWS, TAKES_SCALE = 3, True  # y, cos, sin

    def forward(self, y, *args):
        heads, kv_heads, head_dim = self.params
        y, (cos, sin, *bias) = self.result(y, args)
        qkv = _biased(y, bias).view(y.shape[0], heads + 2 * kv_heads, head_dim)
        return rotary_heads(qkv, cos, sin, heads, kv_heads)


class _Scale(_Step):
    def forward(self, a):
        return self.rows(a)


class _Mid(_Step):
    ROWS, TAKES_SCALE, NAMED = 2, True, 2  # x, y

    def forward(self, x, y, *args):
        y, (norm_w, *bias) = self.result(y, args)
        x = x + _biased(y, bias)
        return x, *self.rows(F.rms_norm(x, (x.shape[-1],), norm_w, self.params[0]))


class _Act(_Step):
    TAKES_SCALE = True

    def forward(self, y, *args):
        y, bias = self.result(y, args)
        g, u = _biased(y, bias).split(self.params[0], dim=-1)
        return self.rows(F.silu(g) * u)


class _Out(_Step):
    ROWS, TAKES_SCALE, NAMED = 2, True, 2  # x, y

    def forward(self, x, y, *args):
        y, bias = self.result(y, args)
        return x + _biased(y, bias)


def _program(module: _Step, example: list[torch.Tensor], progress):
    """The runner of one step (rows dynamic in its first ``rows_in`` inputs; those after its ``NAMED`` ones as the
    one ``*args`` tuple)."""
    rows = aot.rows_dim()
    dims = [*({0: rows} for _ in range(module.rows_in)), *(None for _ in example[module.rows_in:])]
    if len(example) > module.NAMED:
        dims = [*dims[:module.NAMED], tuple(dims[module.NAMED:])]
    signature = (module.params, tuple(tuple(t.shape[1:]) for t in example))
    name = aot.key("w8a8:" + type(module).__name__.strip("_").lower(), signature)
    return aot.runner(module, example, name, tuple(dims), progress)


def layer_programs(lean, layers, scaling: float, progress=None) -> list | None:
    """Every layer's (run, tensors) as ``fastpath.compiled.CompiledLayers.layers`` holds them (``run(list) -> list``:
    the steps above, the cache write and ``kernels.attention`` between them), or None where a layer is not all
    ``w8a8`` with joined q/k/v and gate/up projections, or this build lacks fbgemm's kernel."""
    linear = getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)
    out_layers = []
    for layer, pieces in zip(layers, lean.layers):
        mods = [*pieces.qkv_modules, layer.self_attn.o_proj, *pieces.mlp_modules, layer.mlp.down_proj]
        if len(mods) != 4 or pieces.q_norm is not None or not all(
                type(m) is WeightOnlyLinear and m.fmt == "w8a8" for m in mods):
            return None
        packed = [m.packed() for m in mods]
        (w1, eps1), (w2, eps2) = pieces.norm_params
        if linear is None or any(p is None for p in packed) or w1 is None or w2 is None:
            return None
        mm = [lambda rows, p=p: linear(rows, 1.0, 128, p) for p in packed]  # [T, in] -> [T, out], before the scales
        qkv, o, gu, down = mods
        bias = [[] if m.bias is None else [m.bias] for m in mods]
        h, kvh, d, hidden = lean.heads, lean.kv_heads, lean.head_dim, w1.shape[0]
        t = 2
        x, s = torch.randn(t, hidden), torch.rand(t, 1) + 0.5
        cos, sin = torch.randn(t, d), torch.randn(t, d)
        y_qkv, y_o = torch.randn(t, qkv.out_features), torch.randn(t, o.out_features)
        y_gu, y_down = torch.randn(t, gu.out_features), torch.randn(t, down.out_features)
        # equal layers share one runner (``aot.runner`` keeps them loaded)
        norm = _program(_Norm(eps1), [x, w1], progress)
        rotary = _program(_Rotary(h, kvh, d), [y_qkv, s, cos, sin, *bias[0]], progress)
        scale = _program(_Scale(), [torch.randn(t, o.in_features)], progress)
        mid = _program(_Mid(eps2), [x, y_o, s, w2, *bias[1]], progress)
        act = _program(_Act(down.in_features), [y_gu, s, *bias[2]], progress)
        out = _program(_Out(), [x, y_down, s, *bias[3]], progress)

        def run(args, mm=mm, norm=norm, rotary=rotary, scale=scale, mid=mid, act=act, out=out, b=bias):
            x, cos, sin, kbuf, vbuf, attend, w1, w2 = args  # as ``_Layer`` takes them (``fastpath.compiled``)
            t, length = attend.shape
            rows, s = norm([x, w1])
            qkv = rotary([mm[0](rows), s, cos, sin, *b[0]])[0]  # [T, h + 2 kvh, d]
            kbuf[0, :, length - t: length] = qkv[:, h: h + kvh].transpose(0, 1)
            vbuf[0, :, length - t: length] = qkv[:, h + kvh:].transpose(0, 1)
            rows, s = scale([torch.ops.retrospec.attention(qkv, kbuf, vbuf, attend, h, scaling)])
            x, rows, s = mid([x, mm[1](rows), s, w2, *b[1]])
            rows, s = act([mm[2](rows), s, *b[2]])
            return out([x, mm[3](rows), s, *b[3]])

        out_layers.append((run, [w1, w2]))
    return out_layers
