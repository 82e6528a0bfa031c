"""Each decoder layer as one ahead-of-time compiled program: the step without per-operation dispatch.

Why: with the matmuls near their kernels' speed, a one-token step of a 30-layer model is ~2,000 small operator
calls (norms, rotary, casts, residual adds, SiLU, attention), 2-7 us each on a 2-core CPU: 40-50 % of a 4-bit step.
Compiled with AOTInductor (PyTorch's own ahead-of-time compiler: ``torch.export`` + ``aoti_compile_and_package``),
a layer is a few fused C++ loops around the same matmul kernels, called once from a C++ runner:

    layer (x [T, H], cos [T, d], signed_sin [T, d], key / value buffers [1, kv_heads, C, d], bias [T, L], weights)
          -> x [T, H]
      rmsnorm -> q/k/v projections -> rotary over the q and k heads (the lean loop's, ``fastpath.lean``)
      -> the rows' keys and values written into the buffers at [L - T, L) (in place: the cache's next positions)
      -> attention over the first L positions (``kernels.attention``; bias: 0 where a row sees a key, -inf not)
      -> x + o_proj(a) -> rmsnorm -> silu(gate) * up -> x + down

It runs every forward over the engine's cache (``kv.cache.BufferLayer``) that already holds positions: a decode
step, a chain, a draft tree (any T up to ``MAX_ROWS``). The prefill and other caches run the lean loop. The weights
are inputs, not constants: one program serves every layer of the same shapes and format, and no weight is copied.

Exactness: the attention operator computes each row over exactly the keys it sees, in cache order, so a row's
result depends on nothing else; where the engine verifies row-exactly (its matmuls row-invariant:
``fastpath.rows``), a k-token verification through the programs, a chain's or a tree's, is then bitwise the
one-token steps along its paths (checked at build), and every lossless method token-identical to ``ar`` in that
format.

When it is used (``RETROSPEC_COMPILE``: ``auto``, the default; ``on``; ``off``): ``auto`` compiles for float32
activations and models of at least ``AUTO_MIN_LAYERS`` layers and hidden size ``AUTO_MIN_HIDDEN`` (a compile takes
about half a minute once per machine, model shape and format; smaller models do not repay it), and draft models of
that hidden size at any depth (called once per drafted token: their per-operation cost weighs more; the engine
measures whether this beats prepacked linears for them, ``engine._programs_pay``), ``on`` for any model the lean
loop runs. Programs are cached under ``cache_home()/compiled/``, keyed by machine, torch version, threads
and the program's signature; loading a cached one takes milliseconds. The engine keeps them only where they pass,
on probes of the model's own first layer: (1) they equal the lean loop within ``TOLERANCE`` (relative; the
weight-only formats, whose activations are rounded, within ``ROUNDED_TOLERANCE``), (2) a T-row call's rows are
bitwise the one-row calls' (where the engine verifies row-exactly), (3) they are faster here (timed, interleaved;
the verdict is cached beside the programs). A failed compile (no C++ compiler, an unsupported op) falls back to the
lean loop with one warning.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..atomic import write_text_atomic
from ..errors import RetrospecError
from ..paths import cache_home
from ..weight_only import GROUP, WeightOnlyLinear, row_scales
from . import aot
from .linear import KernelLinear

MODES = ("auto", "on", "off")
AUTO_MIN_LAYERS, AUTO_MIN_HIDDEN = 8, 256  # ``auto`` compiles models at least this deep and wide
TOLERANCE = 1e-4  # relative max difference allowed against the lean loop (fused float32 norms may round differently)
# the weight-only formats round activations as they enter a matmul (to bfloat16: int8, int4 and a GGUF file's blocks;
# to int8: w8a8, w4a8): a fused norm's last-bit difference may move an activation to the neighbouring rounded value,
# so their programs are checked against the lean loop within a wider tolerance
ROUNDED_TOLERANCE = 1e-2


def compile_mode() -> str:
    m = os.environ.get("RETROSPEC_COMPILE", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise RetrospecError(f"RETROSPEC_COMPILE must be one of {', '.join(MODES)}, got {m!r}")
    return m


@dataclass(frozen=True)
class Proj:
    """One projection as the programs compute it: ``kind`` linear (float ``mm``/``addmm`` on ``weight.t()``), ``f32``
    (``KernelLinear``: ``kernels.f32``'s operator on the weight as it is) or a weight-only format (``int4``,
    ``int8``: its kernel on bfloat16 rows, cast back; ``w4a8``: its operator on the float32 rows; ``w8a8``: each row
    divided by its scale, fbgemm's integer matmul by the layer's handle (``kernels.w8a8``), times the scale)."""

    kind: str
    in_features: int
    out_features: int
    bias: bool

    @staticmethod
    def of(module: torch.nn.Module) -> "Proj | None":
        if type(module) is torch.nn.Linear:
            return Proj("linear", module.in_features, module.out_features, module.bias is not None)
        if type(module) is KernelLinear:
            return Proj("f32", module.in_features, module.out_features, module.bias is not None)
        if type(module) is WeightOnlyLinear and (module.fmt != "w8a8" or module.handle() is not None):
            return Proj(module.fmt, module.in_features, module.out_features, module.bias is not None)
        return None

    @staticmethod
    def tensors(module: torch.nn.Module) -> list[torch.Tensor]:
        if type(module) in (torch.nn.Linear, KernelLinear):
            ts = [module.weight]
        elif module.fmt == "w8a8":
            ts = [module.qweight, module.handle()]
        else:
            ts = [module.qweight, module.scales]
        return ts + ([module.bias] if module.bias is not None else [])

    def width(self) -> int:
        return (1 if self.kind in ("linear", "f32") else 2) + int(self.bias)

    def apply(self, x: torch.Tensor, ts: list[torch.Tensor]) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.kind == "linear":
            return torch.mm(x, ts[0].t()) if not self.bias else torch.addmm(ts[1], x, ts[0].t())
        if self.kind == "f32":
            y = torch.ops.retrospec.f32_mm(x, ts[0])
            return y + ts[1] if self.bias else y
        if self.kind == "w4a8":
            y = torch.ops.retrospec.w4a8_mm(x, ts[0], ts[1])
            return y + ts[2] if self.bias else y
        if self.kind == "w8a8":  # as ``weight_only.w8a8_matmul`` with packed weights
            s = row_scales(x)  # [T, 1]
            y = torch.ops.retrospec.w8a8_mm(x / s, ts[0], ts[1]) * s
            return y + ts[2] if self.bias else y
        rows = x.to(torch.bfloat16)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, ts[0], ts[1])
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, ts[0], GROUP, ts[1])
        y = y.to(x.dtype)
        return y + ts[2] if self.bias else y


def _take(projs: tuple[Proj, ...], ts: tuple[torch.Tensor, ...]) -> list[list[torch.Tensor]]:
    out, i = [], 0
    for p in projs:
        out.append(list(ts[i:i + p.width()]))
        i += p.width()
    return out


def _side_by_side(projs: tuple[Proj, ...], parts: list[list[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """Projections of one input x [T, in] -> [T, sum of outs]: one ``f32_mm_cat`` call where every part is ``f32``
    with a bias in all or none (each column's bits those of its own call), else each part apart, joined."""
    if len(projs) > 1 and all(p.kind == "f32" for p in projs) and len({p.bias for p in projs}) == 1:
        y = torch.ops.retrospec.f32_mm_cat(x, [w[0] for w in parts])
        return y + torch.cat([w[1] for w in parts]) if projs[0].bias else y
    outs = [p.apply(x, w) for p, w in zip(projs, parts)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def rotary_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, heads + 2 kv_heads, d] -> the same with the q and k heads rotated (as ``lean._rope``; signed sin)."""
    d = qkv.shape[-1]
    qk = qkv[:, : heads + kv_heads]  # [T, h + kvh, d]
    turned = torch.cat((qk[..., d // 2:], qk[..., : d // 2]), dim=-1)  # = qk.roll(d / 2, -1), lowered plainly
    qk = qk * cos[:, None] + turned * sin[:, None]
    return torch.cat((qk, qkv[:, heads + kv_heads:]), dim=1)


class _Pre(torch.nn.Module):
    """rmsnorm -> projections (q/k/v, or one joined q+k+v) -> rotary: x [T, H] -> [T, heads + 2 kv_heads, d]."""

    def __init__(self, projs: tuple[Proj, ...], heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.projs, self.heads, self.kv_heads, self.head_dim, self.eps = projs, heads, kv_heads, head_dim, eps

    def forward(self, x, cos, sin, norm_w, *ts):
        t, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        hx = F.rms_norm(x, (x.shape[-1],), norm_w, self.eps)  # [T, H]
        qkv = _side_by_side(self.projs, _take(self.projs, ts), hx)  # [T, (h + 2 kvh) d]
        return rotary_heads(qkv.view(t, h + 2 * kvh, d), cos, sin, h, kvh)  # [T, h + 2 kvh, d]: q, k rotated


class _Post(torch.nn.Module):
    """x + o_proj(a) -> rmsnorm -> silu(gate) * up (one joined projection, or two) -> x + down."""

    def __init__(self, o: Proj, mlp: tuple[Proj, ...], down: Proj, intermediate: int, eps: float):
        super().__init__()
        self.o, self.mlp, self.down, self.intermediate, self.eps = o, mlp, down, intermediate, eps

    def forward(self, x, a, norm_w, *ts):
        projs = (self.o, *self.mlp, self.down)
        parts = _take(projs, ts)
        x = x + self.o.apply(a, parts[0])  # [T, H]
        hx = F.rms_norm(x, (x.shape[-1],), norm_w, self.eps)
        g, u = _side_by_side(self.mlp, parts[1:-1], hx).split(self.intermediate, dim=-1)  # [T, I] each
        return x + self.down.apply(F.silu(g) * u, parts[-1])


class _Layer(torch.nn.Module):
    """``_Pre`` -> the rows' keys / values into the buffers at [L - T, L) -> attention -> ``_Post``."""

    def __init__(self, pre: _Pre, post: _Post, pre_width: int, scaling: float):
        super().__init__()
        self.pre, self.post, self.pre_width, self.scaling = pre, post, pre_width, scaling

    def forward(self, x, cos, sin, kbuf, vbuf, bias, norm1_w, *ts):
        t, length = bias.shape  # x [T, H]; kbuf / vbuf [1, kvh, C >= L, d], written in place
        h, kvh = self.pre.heads, self.pre.kv_heads
        qkv = self.pre(x, cos, sin, norm1_w, *ts[: self.pre_width])  # [T, h + 2 kvh, d]
        kbuf[0, :, length - t: length] = qkv[:, h: h + kvh].transpose(0, 1)
        vbuf[0, :, length - t: length] = qkv[:, h + kvh:].transpose(0, 1)
        a = torch.ops.retrospec.attention(qkv, kbuf, vbuf, bias, h, self.scaling)  # [T, h * d]
        return self.post(x, a, *ts[self.pre_width:])


@dataclass
class CompiledLayers:
    """Per decoder layer: its program's runner and weight arguments (equal layers share a runner)."""

    layers: list  # [(run, [norm_w, *pre tensors, norm_w, *post tensors])]
    describe: dict | None = None

    def run_layer(self, i: int, x, cos, sin, kbuf, vbuf, bias) -> torch.Tensor:
        """Decoder layer i: x [T, H] -> [T, H]; cos / signed sin [T, d]; the rows' keys and values written into
        kbuf / vbuf [1, kv_heads, C, d] at [L - T, L); bias [T, L] (0: the row sees the key; -inf: not)."""
        run, args = self.layers[i]
        return run([x, cos, sin, kbuf, vbuf, bias, *args])[0]


def chain_bias(rows: int, length: int, dtype=torch.float32) -> torch.Tensor:
    """[rows, length] additive mask of a chain whose rows are the last ``rows`` of ``length`` cached positions."""
    bias = torch.zeros(rows, length, dtype=dtype)
    if rows > 1:
        bias[:, length - rows:].masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu_(1), float("-inf"))
    return bias


def wanted(n_layers: int, hidden: int, draft: bool = False) -> bool:
    """Whether ``RETROSPEC_COMPILE`` asks for a model's layers compiled; ``auto``: a draft (called once per drafted
    token, so its per-operation cost weighs more) at any depth, a target of ``AUTO_MIN_LAYERS`` layers or more."""
    m = compile_mode()
    deep = draft or n_layers >= AUTO_MIN_LAYERS
    return m == "on" or (m == "auto" and deep and hidden >= AUTO_MIN_HIDDEN)


def _format(lean) -> str | None:
    return getattr(lean.layers[0].qkv_modules[0], "fmt", None)


def layer_programs(lean, layers, scaling: float, progress=None) -> list | None:
    """Every layer's (runner, tensors) as ``CompiledLayers.layers`` holds them, or None where a layer has a part the
    programs do not express."""
    out = []
    h, kvh, d = lean.heads, lean.kv_heads, lean.head_dim
    kbuf, vbuf = (torch.randn(1, kvh, 40, d) for _ in "kv")
    for layer, pieces in zip(layers, lean.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if pieces.q_norm is not None or pieces.norm_params[0][0] is None or pieces.norm_params[1][0] is None:
            return None
        qkv, gu = pieces.qkv_modules, pieces.mlp_modules
        projs = [Proj.of(m) for m in [*qkv, attn.o_proj, *gu, mlp.down_proj]]
        if any(p is None for p in projs):
            return None
        (w1, eps1), (w2, eps2) = pieces.norm_params
        nq = len(qkv)
        pre_sig = (tuple(projs[:nq]), h, kvh, d, eps1)
        post_sig = (projs[nq], tuple(projs[nq + 1:-1]), projs[-1], mlp.down_proj.in_features, eps2)
        pre_args = [w1] + [t for m in qkv for t in Proj.tensors(m)]
        post_args = [w2] + [t for m in [attn.o_proj, *gu, mlp.down_proj] for t in Proj.tensors(m)]
        program = _Layer(_Pre(*pre_sig), _Post(*post_sig), len(pre_args) - 1, float(scaling))
        rows = 2
        x, cos, sin = torch.randn(rows, w1.shape[0]), torch.randn(rows, d), torch.randn(rows, d)  # distinct inputs
        example = [x, cos, sin, kbuf, vbuf, chain_bias(rows, 24), *pre_args, *post_args]
        name = aot.key("layer", (pre_sig, float(scaling), post_sig))
        out.append((_runner(program, example, name, progress), [*pre_args, *post_args]))
    return out


def _runner(program: _Layer, example: list[torch.Tensor], name: str, progress=None):
    """``aot.runner`` with ``_Layer``'s dynamic dimensions: rows, the buffers' capacity, the attended length."""
    rows = aot.rows_dim()
    cap, length = torch.export.Dim("capacity", min=2), torch.export.Dim("length", min=2)
    dims = ({0: rows}, {0: rows}, {0: rows}, {2: cap}, {2: cap}, {0: rows, 1: length}, None,
            tuple(None for _ in example[7:]))
    return aot.runner(program, example, name, dims, progress)


def _eager_layer(lean, i: int, x, cos, sin, kbuf, vbuf, bias) -> torch.Tensor:
    """What the lean loop computes for layer i (its pre and post, the engine's one-row attention row by row over
    the keys each row sees), writing the buffers as ``_Layer`` does: the reference the programs are checked against."""
    from ..attention.prefix_block import _one_row

    layer, t, length = lean.layers[i], x.shape[0], bias.shape[1]
    q, k, v = lean.pre_eager(layer, x, cos[None, None], sin[None, None])  # [1, h, T, d], [1, kvh, T, d]
    kbuf[:, :, length - t: length], vbuf[:, :, length - t: length] = k, v
    rows = []
    for r in range(t):
        seen = (bias[r] == 0).nonzero()[:, 0]
        rows.append(_one_row(q[:, :, r: r + 1], kbuf.index_select(2, seen), vbuf.index_select(2, seen),
                             layer.attn.scaling).reshape(1, -1))
    return lean.post_eager(layer, x, torch.cat(rows))


def _probe(lean, rows: int, gen: torch.Generator, capacity: int = 64):
    d, hidden = lean.head_dim, lean.layers[0].norm_params[0][0].shape[0]
    x = torch.randn(rows, hidden, generator=gen)
    angle = torch.randn(rows, d // 2, generator=gen)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([-angle.sin(), angle.sin()], -1)
    kbuf, vbuf = (torch.randn(1, lean.kv_heads, capacity, d, generator=gen) for _ in "kv")
    return x, cos, sin, kbuf, vbuf


def _checked(lean, compiled: CompiledLayers, row_exact: bool) -> str | None:
    """Why the programs must not be used (None: they pass), on the first layer: within ``TOLERANCE`` of the lean
    loop (``ROUNDED_TOLERANCE`` for the weight-only formats) for a chain and a tree; and, where the engine verifies
    row-exactly, their rows bitwise the one-row calls over the keys each sees (a tree's gathered as a step along its
    path would find them)."""
    tolerance = ROUNDED_TOLERANCE if _format(lean) is not None else TOLERANCE
    gen = torch.Generator().manual_seed(0)
    t, length = 3, 41
    tree = chain_bias(t, length)
    tree[1, length - 3], tree[2, length - 2] = float("-inf"), float("-inf")  # rows 0, 1 siblings; row 2 under 0
    with torch.inference_mode():
        for bias in (chain_bias(t, length), tree):
            x, cos, sin, kbuf, vbuf = _probe(lean, t, gen)
            ref_k, ref_v = kbuf.clone(), vbuf.clone()
            ours = compiled.run_layer(0, x, cos, sin, kbuf, vbuf, bias)
            ref = _eager_layer(lean, 0, x, cos, sin, ref_k, ref_v, bias)
            if ours.shape != ref.shape or not torch.isfinite(ours).all():
                return "the compiled layer's output has another shape or is not finite"
            for o, r in ((ours, ref), (kbuf, ref_k), (vbuf, ref_v)):
                if (o - r).abs().max() > tolerance * max(1.0, r.abs().max().item()):
                    return f"the compiled layer differs from the lean loop by {(o - r).abs().max().item():.2g}"
            if not row_exact:
                continue
            for r in range(t):
                seen = (bias[r] == 0).nonzero()[:, 0]  # the prefix, the row's ancestors, itself (last)
                k_path, v_path = (b.index_select(2, seen[:-1]) for b in (kbuf, vbuf))
                k_path, v_path = (torch.cat([p, torch.zeros_like(p[:, :, :1])], 2) for p in (k_path, v_path))
                one = compiled.run_layer(0, x[r: r + 1], cos[r: r + 1], sin[r: r + 1], k_path, v_path,
                                         torch.zeros(1, seen.numel()))
                if not torch.equal(one[0], ours[r]):
                    return "a compiled layer's rows depend on how many rows share the call"
    return None


def _timed(lean, compiled: CompiledLayers, length: int = 512, reps: int = 7) -> tuple[float, float]:
    """Median ms of every layer's one-row step over ``length`` cached keys: (the lean loop's, the programs'),
    timed in turn."""
    from ..attention.prefix_block import _one_row

    x, cos, sin, kbuf, vbuf = _probe(lean, 1, torch.Generator().manual_seed(1), length + 64)
    bias = torch.zeros(1, length)
    k, v = kbuf[:, :, :length], vbuf[:, :, :length]

    def eager():
        for layer in lean.layers:
            q, _, _ = lean.pre_eager(layer, x, cos[None, None], sin[None, None])
            lean.post_eager(layer, x, _one_row(q, k, v, layer.attn.scaling).reshape(1, -1))

    def fast():
        for i in range(len(lean.layers)):
            compiled.run_layer(i, x, cos, sin, kbuf, vbuf, bias)

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name, fn in (("eager", eager), ("compiled", fast)):
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times["eager"]), statistics.median(times["compiled"])


def build(lean, decoder, row_exact: bool, progress=None, draft: bool = False) -> tuple[CompiledLayers | None, dict]:
    """The compiled layers for ``lean`` (``fastpath.lean.LeanDecoder``) when wanted (``draft``: a draft model's
    engine, see ``wanted``), compiled, correct and faster here; else (None, why). Never raises: any failure falls
    back to the lean loop."""
    layers = decoder.layers[: len(lean.layers)]
    first = lean.layers[0].norm_params[0][0]
    if not wanted(len(lean.layers), first.shape[0] if first is not None else 0, draft):
        size = f"hidden size below {AUTO_MIN_HIDDEN}" if draft else \
            f"smaller than {AUTO_MIN_LAYERS} layers of hidden size {AUTO_MIN_HIDDEN}"
        why = "RETROSPEC_COMPILE=off" if compile_mode() == "off" else f"{size} (RETROSPEC_COMPILE=on compiles it)"
        return None, {"compiled": False, "why": why}
    if lean.embed.weight.dtype != torch.float32:
        return None, {"compiled": False, "why": "activations in a dtype other than float32"}
    scalings = {float(layer.attn.scaling) for layer in lean.layers}
    if len(scalings) != 1:
        return None, {"compiled": False, "why": "layers of different attention scalings"}
    t0 = time.perf_counter()
    try:
        if kernels.attention() is None:
            return None, {"compiled": False, "why": "the attention kernel could not be built here"}
        programs = layer_programs(lean, layers, scalings.pop(), progress)
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower, a full disk: the lean loop still runs
        warnings.warn(f"the decoder layers were not compiled ({type(exc).__name__}: {str(exc).splitlines()[0][:200]});"
                      " running the lean loop", RuntimeWarning, stacklevel=3)
        return None, {"compiled": False, "why": f"compile failed: {type(exc).__name__}"}
    if programs is None:
        return None, {"compiled": False, "why": "a layer the programs do not express"}
    compiled = CompiledLayers(layers=programs)
    why = _checked(lean, compiled, row_exact)
    if why is not None:
        return None, {"compiled": False, "why": why}
    verdict = timed_verdict(aot.key("verdict", _verdict_sig(lean, layers[0])), lambda: _timed(lean, compiled))
    info = {"compiled": verdict["compiled_ms"] < verdict["eager_ms"], **verdict,
            "seconds": round(time.perf_counter() - t0, 2)}
    if not info["compiled"]:
        info["why"] = "not faster than the lean loop here"
        return None, info
    compiled.describe = info
    return compiled, info


def timed_verdict(name: str, timer, redo: bool = False, keys: tuple[str, ...] = ("eager_ms", "compiled_ms")) -> dict:
    """{"eager_ms", "compiled_ms", ...}: read from ``cache_home()/compiled/<name>.json`` where it has ``keys`` and was
    measured with the kernels as they are (``kernels.sources_digest``), else (or ``redo``) ``timer()`` -> (eager ms,
    compiled ms) or a dict of ``keys``, measured here and saved there."""
    path = cache_home() / "compiled" / f"{name}.json"
    digest = kernels.sources_digest()
    try:
        verdict = json.loads(path.read_text()) if path.exists() and not redo else None
    except (OSError, ValueError):
        verdict = None
    if not isinstance(verdict, dict) or any(k not in verdict for k in keys) or verdict.get("kernels") != digest:
        got = timer()
        verdict = dict(zip(("eager_ms", "compiled_ms"), got)) if isinstance(got, tuple) else dict(got)
        verdict = {k: round(v, 3) if isinstance(v, float) else v for k, v in verdict.items()} | {"kernels": digest}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(verdict))
    return verdict


def _verdict_sig(lean, first: torch.nn.Module) -> tuple:
    layer = lean.layers[0]
    return (len(lean.layers), lean.heads, lean.kv_heads, lean.head_dim, layer.norm_params[0][0].shape[0],
            tuple(repr(Proj.of(m)) for m in [*layer.qkv_modules, layer.attn.o_proj, *layer.mlp_modules,
                                             first.mlp.down_proj]))
