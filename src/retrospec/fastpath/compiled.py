"""Each decoder layer's work as ahead-of-time compiled programs: the step without per-operation dispatch.

Why: with the matmuls near their kernels' speed, a one-token step of a 30-layer model is ~2,000 small operator
calls (norms, rotary, casts, residual adds, SiLU, attention), 2-7 us each on a 2-core CPU: 40-50 % of a 4-bit step.
Compiled with AOTInductor (PyTorch's own ahead-of-time compiler: ``torch.export`` + ``aoti_compile_and_package``),
each part is a few fused C++ loops around the same matmul kernels, called from a C++ runner with no Python per
operation:

    pre   (x [T, H], cos [T, d], signed_sin [T, d], layer weights) -> qkv [T, heads + 2 kv_heads, d]
          rmsnorm -> q/k/v projections -> rotary over the q and k heads (the lean loop's, ``fastpath.lean``)
    attn  (qkv, key / value buffers [1, kv_heads, C, d], bias [T, L]) -> [T, heads * d]
          softmax(q k^T * scaling + bias) v over the first L cached positions, as broadcast products and sums
    post  (x [T, H], attention output [T, heads * d], layer weights) -> x [T, H]
          x + o_proj(a) -> rmsnorm -> silu(gate) * up -> x + down

The cache update stays the engine's (``kv.cache``); attention runs the program where it passed its checks, else the
engine's own (``prefix_block``). The weights are inputs, not constants: one program serves every layer of the same
shapes and formats, and no weight is copied. T is dynamic (1 .. ``MAX_ROWS``); the prefill (T = L) keeps the engine's
attention.

Exactness: a chain's row i in ``attn`` is computed over all L keys with the later ones at -inf, which adds exact
zeros to sums whose order is fixed by key position, so it equals the one-row call over the keys it sees; a draft
tree's rows, whose visible keys are not a prefix, run one by one over exactly their keys (``CompiledLayers.attend``).
Where the engine verifies row-exactly (``fastpath.rows``), a k-token verification through the programs is then
bitwise k one-token steps through them, and every lossless method token-identical to ``ar`` in that format.

When it is used (``RETROSPEC_COMPILE``: ``auto``, the default; ``on``; ``off``): ``auto`` compiles for float32
activations and models of at least ``AUTO_MIN_LAYERS`` layers and hidden size ``AUTO_MIN_HIDDEN`` (a compile takes
about half a minute per program once per machine, model shape and format; smaller models do not repay it), ``on``
for any model the lean loop runs. Programs are cached under ``cache_home()/compiled/``, keyed by machine, torch
version, threads and the program's signature; loading a cached one takes milliseconds. The engine keeps the
programs only where they pass, on probes of the model's own first layer: (1) each equals the lean loop's (the
engine's attention) within ``TOLERANCE`` (relative), (2) a T-row call's rows are bitwise the one-row calls' (layers:
where the engine verifies row-exactly; attention: always), (3) they are faster here (timed, interleaved; the verdict
is cached beside the programs). A failed compile (no C++ compiler, an unsupported op) falls back to the lean loop
with one warning.
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

from ..atomic import write_text_atomic
from ..errors import RetrospecError
from ..paths import cache_home
from ..weight_only import GROUP, WeightOnlyLinear
from . import aot, integer
from .linear import KernelLinear
from .aot import MAX_ROWS

MODES = ("auto", "on", "off")
AUTO_MIN_LAYERS, AUTO_MIN_HIDDEN = 8, 256  # ``auto`` compiles models at least this deep and wide
TOLERANCE = 1e-4  # relative max difference allowed against the lean loop (fused float32 norms may round differently)


def compile_mode() -> str:
    m = os.environ.get("RETROSPEC_COMPILE", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise RetrospecError(f"RETROSPEC_COMPILE must be one of {', '.join(MODES)}, got {m!r}")
    return m


@dataclass(frozen=True)
class Proj:
    """One projection as the programs compute it: ``kind`` linear (float ``mm``/``addmm`` on ``weight.t()``), ``f32``
    (``KernelLinear``: ``kernels.f32``'s operator on the weight as it is) or a weight-only format (``int4``,
    ``int8``: its kernel on bfloat16 rows, cast back; ``w4a8``: its operator on the float32 rows; ``w8a8`` layers run
    ``fastpath.integer``'s programs instead, and ``Proj`` only names them in the speed verdict's key)."""

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
        if type(module) is WeightOnlyLinear:
            return Proj(module.fmt, module.in_features, module.out_features, module.bias is not None)
        return None

    @staticmethod
    def tensors(module: torch.nn.Module) -> list[torch.Tensor]:
        if type(module) in (torch.nn.Linear, KernelLinear):
            ts = [module.weight]
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


class _Pre(torch.nn.Module):
    """rmsnorm -> projections (q/k/v, or one joined q+k+v) -> rotary; see the module docstring."""

    def __init__(self, projs: tuple[Proj, ...], heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.projs, self.heads, self.kv_heads, self.head_dim, self.eps = projs, heads, kv_heads, head_dim, eps

    def forward(self, x, cos, sin, norm_w, *ts):
        t, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        hx = F.rms_norm(x, (x.shape[-1],), norm_w, self.eps)  # [T, H]
        outs = [p.apply(hx, w) for p, w in zip(self.projs, _take(self.projs, ts))]
        qkv = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [T, (h + 2 kvh) d]
        return integer.rotary_heads(qkv.view(t, h + 2 * kvh, d), cos, sin, h, kvh)  # [T, h + 2 kvh, d]: q, k rotated


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
        if len(self.mlp) == 1:
            g, u = self.mlp[0].apply(hx, parts[1]).split(self.intermediate, dim=-1)
        else:
            g, u = self.mlp[0].apply(hx, parts[1]), self.mlp[1].apply(hx, parts[2])
        return x + self.down.apply(F.silu(g) * u, parts[-1])


class _Attn(torch.nn.Module):
    """Attention of T query rows over the first L cached keys, each row masked by ``bias`` (0 visible, -inf not):
    the scores and the weighted sum as plain broadcast products and sums (fused loops, no BLAS), so a row's result
    depends only on the keys before its last visible one and not on how many rows share the call (a chain's row i,
    whose hidden keys all come after its visible ones, equals the one-row call over those keys; checked at build)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scaling = heads, kv_heads, head_dim, scaling

    def forward(self, qkv, kbuf, vbuf, bias):
        t, length = bias.shape  # bias [T, L]; qkv [T, heads + 2 kv_heads, d] (the pre program's output)
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q = qkv[:, :h].permute(1, 0, 2).reshape(kvh, h // kvh, t, 1, d)  # heads sharing a key/value head
        k = kbuf[0, :, :length].reshape(kvh, 1, 1, length, d)  # kbuf / vbuf [1, kvh, C >= L, d]
        v = vbuf[0, :, :length].reshape(kvh, 1, 1, length, d)
        scores = (q * k).sum(-1) * self.scaling + bias  # [kvh, rep, T, L]
        probs = scores.softmax(-1)
        out = (probs.unsqueeze(-1) * v).sum(-2)  # [kvh, rep, T, d]
        return out.permute(2, 0, 1, 3).reshape(t, h * d)


def _runner(program: torch.nn.Module, example: list[torch.Tensor], name: str, progress=None):
    """``aot.runner`` with the dynamic dimensions of ``_Pre``, ``_Post`` and ``_Attn``."""
    rows = aot.rows_dim()
    if isinstance(program, _Attn):
        cap, length = torch.export.Dim("capacity", min=2), torch.export.Dim("length", min=2)
        dims = ({0: rows}, {2: cap}, {2: cap}, {0: rows, 1: length})
    else:
        lead = 2 if isinstance(program, _Post) else 3  # the row-carrying inputs; then a norm weight and *tensors
        dims = (*({0: rows} for _ in range(lead)), None, tuple(None for _ in example[lead + 1:]))
    return aot.runner(program, example, name, dims, progress)


@dataclass
class CompiledLayers:
    """Per decoder layer: the runners of its programs and their weight arguments (equal layers share runners);
    ``attn``: the attention program (one for all layers), None where the engine's own attention runs."""

    pre: list  # [(run, [norm_w, *projection tensors])]
    post: list
    heads: int
    kv_heads: int
    row_exact: bool  # the engine verifies row-exactly: a draft tree's rows then attend one by one (``attend``)
    attn: object = None
    describe: dict | None = None

    def run_qkv(self, i: int, x, cos, sin) -> torch.Tensor:
        """x [T, H], cos / signed sin [T, d] -> [T, heads + 2 kv_heads, d]: rotated q and k heads, then v."""
        run, args = self.pre[i]
        return run([x, cos, sin, *args])[0]

    def split(self, qkv: torch.Tensor):
        """-> q [1, heads, T, d], k / v [1, kv_heads, T, d]: views laid out as the lean loop's (so the engine's
        attention reads the same strides and gives the same bits)."""
        qkv = qkv.unsqueeze(0).transpose(1, 2)  # [1, heads + 2 kv_heads, T, d]
        h, kvh = self.heads, self.kv_heads
        return qkv[:, :h], qkv[:, h: h + kvh], qkv[:, h + kvh:]

    def run_pre(self, i: int, x, cos, sin):
        return self.split(self.run_qkv(i, x, cos, sin))

    def run_post(self, i: int, x, a):
        run, args = self.post[i]
        return run([x, a, *args])[0]

    def attend(self, qkv, layer_cache, keys, values, bias=None, visible=None) -> torch.Tensor:
        """The attention program over a layer's cache -> [T, heads * d]. ``bias`` [T, L] (0 / -inf) masks rows in one
        call (a chain: row i's hidden keys all follow its visible ones); with ``visible`` [T, L] bool (a draft tree,
        verified row-exactly) each row runs alone over exactly the keys it sees, gathered in cache order, as the
        one-token step along its path reads them. keys / values [1, kvh, L, d]: the layer's cache after the update."""
        buffers = getattr(layer_cache, "buffers", None)
        if visible is None:
            kb, vb = buffers() if buffers is not None else (keys.contiguous(), values.contiguous())
            return self.attn([qkv, kb, vb, bias])[0]
        rows = []
        for i in range(qkv.shape[0]):
            seen = visible[i].nonzero()[:, 0]  # [n] increasing: the prefix, then the node's ancestors and itself
            rows.append(self.attn([qkv[i:i + 1], keys.index_select(2, seen), values.index_select(2, seen),
                                   torch.zeros(1, seen.numel(), dtype=qkv.dtype)])[0])
        return torch.cat(rows)


def chain_bias(rows: int, length: int, dtype=torch.float32) -> torch.Tensor:
    """[rows, length] additive mask of a chain whose rows are the last ``rows`` of ``length`` cached positions."""
    bias = torch.zeros(rows, length, dtype=dtype)
    if rows > 1:
        bias[:, length - rows:].masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu_(1), float("-inf"))
    return bias


def wanted(n_layers: int, hidden: int) -> bool:
    m = compile_mode()
    return m == "on" or (m == "auto" and n_layers >= AUTO_MIN_LAYERS and hidden >= AUTO_MIN_HIDDEN)


def _format(lean) -> str | None:
    return getattr(lean.layers[0].qkv_modules[0], "fmt", None)


def layer_programs(lean, layers, progress=None) -> tuple[list, list] | None:
    """(pre, post) per layer (runner, tensors), or None where a layer has a part the programs do not express
    (``w8a8`` layers: ``fastpath.integer``'s programs around fbgemm's matmuls)."""
    if _format(lean) == "w8a8":
        return integer.layer_programs(lean, layers, progress)
    pre, post = [], []
    for layer, pieces in zip(layers, lean.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if pieces.q_norm is not None or pieces.norm_params[0][0] is None or pieces.norm_params[1][0] is None:
            return None
        qkv, gu = pieces.qkv_modules, pieces.mlp_modules
        mods = [*qkv, attn.o_proj, *gu, mlp.down_proj]
        projs = [Proj.of(m) for m in mods]
        if any(p is None for p in projs):
            return None
        (w1, eps1), (w2, eps2) = pieces.norm_params
        nq = len(qkv)
        pre_sig = (tuple(projs[:nq]), lean.heads, lean.kv_heads, lean.head_dim, eps1)
        post_sig = (projs[nq], tuple(projs[nq + 1:-1]), projs[-1], mlp.down_proj.in_features, eps2)
        pre_args = [w1] + [t for m in qkv for t in Proj.tensors(m)]
        post_args = [w2] + [t for m in [attn.o_proj, *gu, mlp.down_proj] for t in Proj.tensors(m)]
        hidden, rows = w1.shape[0], 2
        x = torch.randn(rows, hidden)
        cos, sin = torch.randn(rows, lean.head_dim), torch.randn(rows, lean.head_dim)  # distinct: never one input twice
        a = torch.randn(rows, lean.heads * lean.head_dim)
        pre.append((_runner(_Pre(*pre_sig), [x, cos, sin, *pre_args], aot.key("pre", pre_sig), progress), pre_args))
        post.append((_runner(_Post(*post_sig), [x, a, *post_args], aot.key("post", post_sig), progress), post_args))
    return pre, post


def attention_program(lean, scaling: float, progress=None):
    """The runner of ``_Attn`` for ``lean``'s head shapes."""
    sig = (lean.heads, lean.kv_heads, lean.head_dim, float(scaling))
    qkv = torch.randn(3, lean.heads + 2 * lean.kv_heads, lean.head_dim)
    kbuf, vbuf = (torch.randn(1, lean.kv_heads, 40, lean.head_dim) for _ in "kv")
    return _runner(_Attn(*sig), [qkv, kbuf, vbuf, chain_bias(3, 24)], aot.key("attn", sig), progress)


def _checked(lean, compiled: CompiledLayers, row_exact: bool) -> str | None:
    """Why the programs must not be used (None: they pass): equality with the lean loop within ``TOLERANCE`` on the
    first layer (``integer.TOLERANCE`` for the integer formats' layers), and bitwise row invariance where the engine
    verifies row-exactly."""
    tolerance = integer.TOLERANCE if _format(lean) in integer.FORMATS else TOLERANCE
    gen = torch.Generator().manual_seed(0)
    hidden = lean.layers[0].norm_params[0][0].shape[0]
    t, d = 3, lean.head_dim
    x = torch.randn(t, hidden, generator=gen)
    angle = torch.randn(t, d // 2, generator=gen)
    cos = torch.cat([angle.cos()] * 2, -1)
    sin = torch.cat([-angle.sin(), angle.sin()], -1)
    a = torch.randn(t, lean.heads * d, generator=gen)
    with torch.inference_mode():
        ours = [*compiled.run_pre(0, x, cos, sin), compiled.run_post(0, x, a)]
        ref = [*lean.pre_eager(lean.layers[0], x, cos[None, None], sin[None, None]), lean.post_eager(lean.layers[0], x, a)]
        for o, r in zip(ours, ref):
            if o.shape != r.shape or not torch.isfinite(o).all():
                return "a compiled part's output has another shape or is not finite"
            if (o - r).abs().max() > tolerance * max(1.0, r.abs().max().item()):
                return f"a compiled part differs from the lean loop by {(o - r).abs().max().item():.2g}"
        if row_exact:
            one = [[*compiled.run_pre(0, x[i:i + 1], cos[i:i + 1], sin[i:i + 1]),
                    compiled.run_post(0, x[i:i + 1], a[i:i + 1])] for i in range(t)]
            for j, whole in enumerate(ours):
                rows = torch.cat([one[i][j] for i in range(t)], dim=-2)
                if not torch.equal(rows, whole):
                    return "a compiled part's rows depend on how many rows share the call"
    return None


def _attention_checked(lean, run, scaling: float) -> str | None:
    """Why the attention program must not be used (None: it passes): within ``TOLERANCE`` of the engine's one-row
    attention, and a chain's row i bitwise the one-row call over the keys it sees (at lengths around vector widths)."""
    from ..attention.prefix_block import _one_row

    gen = torch.Generator().manual_seed(1)
    h, kvh, d = lean.heads, lean.kv_heads, lean.head_dim
    kbuf, vbuf = (torch.randn(1, kvh, 80, d, generator=gen) for _ in "kv")
    with torch.inference_mode():
        for rows, length in ((1, 37), (3, 40), (5, 50), (8, 73)):
            qkv = torch.randn(rows, h + 2 * kvh, d, generator=gen)
            whole = run([qkv, kbuf, vbuf, chain_bias(rows, length)])[0]  # [rows, h * d]
            for i in range(rows):
                seen = length - rows + i + 1
                one = run([qkv[i:i + 1], kbuf, vbuf, torch.zeros(1, seen)])[0]
                if not torch.equal(one[0], whole[i]):
                    return "the attention program's rows depend on how many rows share the call"
                q = qkv[i:i + 1, :h].transpose(0, 1).unsqueeze(0)  # [1, h, 1, d]
                ref = _one_row(q, kbuf[:, :, :seen], vbuf[:, :, :seen], scaling).reshape(1, -1)
                if (ref - one).abs().max() > TOLERANCE * max(1.0, ref.abs().max().item()):
                    return "the attention program differs from the engine's attention"
    return None


def _attention_timed(lean, run, scaling: float, length: int = 512, reps: int = 7) -> tuple[float, float]:
    """Median ms of one layer's one-row attention over ``length`` cached keys: (the engine's, the program)."""
    from ..attention.prefix_block import _one_row

    h, kvh, d = lean.heads, lean.kv_heads, lean.head_dim
    kbuf, vbuf = (torch.randn(1, kvh, length + 64, d) for _ in "kv")
    qkv = torch.randn(1, h + 2 * kvh, d)
    q, bias = qkv[:, :h].transpose(0, 1).unsqueeze(0), torch.zeros(1, length)
    k, v = kbuf[:, :, :length], vbuf[:, :, :length]
    calls = {"eager": lambda: _one_row(q, k, v, scaling), "compiled": lambda: run([qkv, kbuf, vbuf, bias])}
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 100)
    return statistics.median(times["eager"]), statistics.median(times["compiled"])


def _timed(lean, compiled: CompiledLayers, reps: int = 7) -> tuple[float, float]:
    """Median ms of every layer's pre + post for one row: (lean loop, compiled), interleaved."""
    hidden = lean.layers[0].norm_params[0][0].shape[0]
    x = torch.randn(1, hidden)
    cos, sin = torch.ones(1, lean.head_dim), torch.zeros(1, lean.head_dim)
    a = torch.randn(1, lean.heads * lean.head_dim)

    def eager():
        for layer in lean.layers:
            lean.pre_eager(layer, x, cos[None, None], sin[None, None])
            lean.post_eager(layer, x, a)

    def fast():
        for i in range(len(lean.layers)):
            compiled.run_pre(i, x, cos, sin)
            compiled.run_post(i, x, a)

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name, fn in (("eager", eager), ("compiled", fast)):
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times["eager"]), statistics.median(times["compiled"])


def build(lean, decoder, row_exact: bool, progress=None) -> tuple[CompiledLayers | None, dict]:
    """The compiled layers for ``lean`` (``fastpath.lean.LeanDecoder``) when wanted, compiled, correct and faster
    here; else (None, why). Never raises: any failure falls back to the lean loop."""
    layers = decoder.layers[: len(lean.layers)]
    first = lean.layers[0].norm_params[0][0]
    if not wanted(len(lean.layers), first.shape[0] if first is not None else 0):
        why = "RETROSPEC_COMPILE=off" if compile_mode() == "off" else (
            f"smaller than {AUTO_MIN_LAYERS} layers of hidden size {AUTO_MIN_HIDDEN} (RETROSPEC_COMPILE=on compiles it)")
        return None, {"compiled": False, "why": why}
    if lean.embed.weight.dtype != torch.float32:
        return None, {"compiled": False, "why": "activations in a dtype other than float32"}
    t0 = time.perf_counter()
    try:
        parts = layer_programs(lean, layers, progress)
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower, a full disk: the lean loop still runs
        warnings.warn(f"the decoder layers were not compiled ({type(exc).__name__}: {str(exc).splitlines()[0][:200]});"
                      " running the lean loop", RuntimeWarning, stacklevel=3)
        return None, {"compiled": False, "why": f"compile failed: {type(exc).__name__}"}
    if parts is None:
        return None, {"compiled": False, "why": "a layer the programs do not express"}
    compiled = CompiledLayers(pre=parts[0], post=parts[1], heads=lean.heads, kv_heads=lean.kv_heads,
                              row_exact=row_exact)
    why = _checked(lean, compiled, row_exact)
    if why is not None:
        return None, {"compiled": False, "why": why}
    scalings = {float(layer.attn.scaling) for layer in lean.layers}
    attn, attn_why = None, None
    if len(scalings) != 1:
        attn_why = "layers of different attention scalings"
    else:
        try:
            attn = attention_program(lean, scalings.pop(), progress)
        except Exception as exc:  # the layers stay compiled; the engine's attention runs
            attn_why = f"compile failed: {type(exc).__name__}"
        else:
            attn_why = _attention_checked(lean, attn, float(lean.layers[0].attn.scaling))
    verdict_path = cache_home() / "compiled" / f"{aot.key('verdict', _verdict_sig(lean, layers[0]))}.json"
    verdict = None
    if verdict_path.exists():
        try:
            verdict = json.loads(verdict_path.read_text())
        except (OSError, ValueError):
            verdict = None
    if verdict is None or "attention_eager_ms" not in verdict:
        eager_ms, compiled_ms = _timed(lean, compiled)
        verdict = {"eager_ms": round(eager_ms, 3), "compiled_ms": round(compiled_ms, 3)}
        if attn is not None and attn_why is None:
            a_eager, a_compiled = _attention_timed(lean, attn, float(lean.layers[0].attn.scaling))
            verdict.update(attention_eager_ms=round(a_eager, 4), attention_compiled_ms=round(a_compiled, 4))
        else:
            verdict.update(attention_eager_ms=None, attention_compiled_ms=None)
        write_text_atomic(verdict_path, json.dumps(verdict))
    info = {"compiled": verdict["compiled_ms"] < verdict["eager_ms"], **verdict,
            "seconds": round(time.perf_counter() - t0, 2)}
    if not info["compiled"]:
        info["why"] = "not faster than the lean loop here"
        return None, info
    if attn_why is None and verdict["attention_compiled_ms"] is not None \
            and verdict["attention_compiled_ms"] >= verdict["attention_eager_ms"]:
        attn_why = "not faster than the engine's attention here"
    info["attention"] = "compiled" if attn_why is None else f"the engine's ({attn_why})"
    compiled.attn = attn if attn_why is None else None
    compiled.describe = info
    return compiled, info


def _verdict_sig(lean, first: torch.nn.Module) -> tuple:
    layer = lean.layers[0]
    return (len(lean.layers), lean.heads, lean.kv_heads, lean.head_dim, layer.norm_params[0][0].shape[0],
            tuple(repr(Proj.of(m)) for m in [*layer.qkv_modules, layer.attn.o_proj, *layer.mlp_modules,
                                             first.mlp.down_proj]))
