"""A LongSpec draft block's call as one ahead-of-time compiled program: a drafted level without per-operation dispatch.

Why: with its linears in 4 bits a block call is ~100 small operator calls (norms, rotary, masks, two attentions,
residual adds, SiLU) around nine small matmuls, and right after a target step, whose forward has evicted the
block's code and data from the caches, each of them costs more: the first drafted token of a step costs about twice
a later one. Compiled like a decoder layer (``fastpath.compiled``, AOTInductor), the call is a few fused loops around
the same matmul kernels and two calls of the attention kernel:

    block (x [T, H], cos [T, d], sin [T, d], ring keys / values [1, kv_heads, C, d], allowed [T, L] bool,
           target keys / values [1, kv_heads, C', d], cross bias [T, S], norm weights, linear weights) -> x [T, H]
      rmsnorm -> q / k / v -> rotary -> the rows' keys and values written into the ring buffers at [L - T, L)
      -> attention over the first L slots where ``allowed`` -> x + o_proj
      -> rmsnorm -> cross q -> rotary -> attention over the target's first S positions (bias: 0 seen, -inf not)
      -> x + o_proj -> rmsnorm -> silu(gate) * up -> x + down

The block's embedding lookup, its rotary table rows and its head (``LongSpecDraft.head``: the draft vocabulary's rows
in their own measured format) stay outside: one operator call each. It serves what drafting calls, ``DraftState``'s
``speculate``: one sequence, the ring and tentative keys in a ``KeyBuffer``, the target's cache read in place from its
buffers (``KVCache.last_buffers``), every cached position visible. Anything else, training and blocks that read
target features, runs the block's own modules.

A draft's arithmetic changes what it proposes, never the output (the rules read q as the draft made it), so the
program need not be bitwise the eager block: it is kept where it is within ``compiled.ROUNDED_TOLERANCE`` of the
block's own ``run`` on probes (one row, a chain, a tree), and faster here (timed at one row right after a sweep of
64 MiB of other memory, as after a target step, interleaved; the verdict cached beside the program), and takes levels
up to the widest one it was also faster for over a 4,096-position cache (wide levels over long caches may favour
the block's own attention on some machines). When:
``RETROSPEC_COMPILE`` as for the target's layers (``auto``: blocks of hidden size at least
``compiled.AUTO_MIN_HIDDEN``; ``on``: any), for float32 blocks on the CPU without target features. A failed
compile leaves the block's own modules with one warning.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..kv import KeyBuffer
from . import aot
from .compiled import AUTO_MIN_HIDDEN, ROUNDED_TOLERANCE, Proj, _side_by_side, _take, compile_mode, rotary_heads, \
    timed_verdict

SWEEP_BYTES = 64 << 20  # memory read between timed calls: a target step's worth of weights leaves the caches cold
WIDTHS, LONG = (2, 4, 8, 16), 4096  # level widths timed over a long cache (``_timed``'s "max_rows")


class _Block(torch.nn.Module):
    """The block's call (module docstring) for one signature: projections, head shapes, norms' eps, scaling."""

    def __init__(self, projs: tuple[Proj, ...], heads: int, kv_heads: int, head_dim: int, eps: tuple[float, ...],
                 intermediate: int, scaling: float):
        super().__init__()
        self.projs, self.heads, self.kv_heads, self.head_dim = projs, heads, kv_heads, head_dim
        self.eps, self.intermediate, self.scaling = eps, intermediate, scaling

    def forward(self, x, cos, sin, kbuf, vbuf, allowed, tk, tv, cross, n1, n2, n3, *ts):
        t, length = allowed.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v, o, cq, co, gate, up, down = self.projs
        parts = _take(self.projs, ts)
        signed = torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), dim=-1)  # [T, d]: rotate_half's signs folded in
        hx = F.rms_norm(x, (x.shape[-1],), n1, self.eps[0])  # [T, H]
        qkv = _side_by_side((q, k, v), parts[:3], hx).view(t, h + 2 * kvh, d)
        qkv = rotary_heads(qkv, cos, signed, h, kvh)  # [T, h + 2 kvh, d]: q, k rotated
        kbuf[0, :, length - t: length] = qkv[:, h: h + kvh].transpose(0, 1)
        vbuf[0, :, length - t: length] = qkv[:, h + kvh:].transpose(0, 1)
        bias = torch.where(allowed, 0.0, float("-inf"))  # [T, L]
        x = x + o.apply(torch.ops.retrospec.attention(qkv, kbuf, vbuf, bias, h, self.scaling), parts[3])
        hx = F.rms_norm(x, (x.shape[-1],), n2, self.eps[1])
        qc = rotary_heads(cq.apply(hx, parts[4]).view(t, h, d), cos, signed, h, 0)  # [T, h, d]
        x = x + co.apply(torch.ops.retrospec.attention(qc, tk, tv, cross, h, self.scaling), parts[5])
        hx = F.rms_norm(x, (x.shape[-1],), n3, self.eps[2])
        g, u = _side_by_side((gate, up), parts[6:8], hx).split(self.intermediate, dim=-1)  # [T, I] each
        return x + down.apply(F.silu(g) * u, parts[8])


class BlockProgram:
    """The compiled call of one block (its runner and weight arguments): ``LongSpecDraft.run``'s drafting case (one
    sequence, its keys and the target's cache in ``KeyBuffer``s, every cached position visible, no feature)."""

    def __init__(self, run: Callable, args: list[torch.Tensor], signature: tuple):
        self.run, self.args, self.signature = run, args, signature  # signature: (projections, the rest), its key
        self.max_rows: int | None = None  # the widest level it takes (None: any; ``build`` sets what it measured)

    def takes(self, rows: int) -> bool:
        """Whether a level of ``rows`` tokens runs here (wider ones run the block's modules)."""
        return self.max_rows is None or rows <= self.max_rows

    def __call__(self, block, ids, positions, own_allowed, past, past_allowed, target):
        """``run``'s results (logits [1, L, K], the new keys and values [1, kv_heads, L, d], outputs [1, L, H]) for
        ``ids`` [1, L] at ``positions`` [1, L]; ``past`` and ``target``: ``KeyBuffer``s (the new keys are written
        into ``past`` at [filled, filled + L)), ``past_allowed`` [1, L, filled] (or pieces along the last axis)."""
        n = ids.shape[1]
        x = block.embed_tokens(ids)[0]  # [L, H]
        cos, sin = (t[0] for t in block.rope(x, positions))  # [L, d]
        pieces = past_allowed if isinstance(past_allowed, tuple) else (past_allowed,)
        allowed = torch.cat([*pieces, own_allowed], dim=-1)[0]  # [L, filled + L]
        cross = x.new_zeros(n, target.filled)  # [L, S]: every cached position seen
        out = self.run([x, cos, sin, past.k, past.v, allowed, target.k, target.v, cross, *self.args])[0][None]
        end = past.filled + n
        return block.head(out), past.k[:, :, past.filled:end], past.v[:, :, past.filled:end], out


def wanted(block) -> bool:
    return unwanted(block) is None


def _unfit(block) -> str | None:
    """Why no program can serve ``block`` whatever ``RETROSPEC_COMPILE`` says (its dtype, device, target features)."""
    if block.norm1.weight.dtype != torch.float32 or block.norm1.weight.device.type != "cpu":
        return "a block in another dtype than float32 or off the CPU"
    return "a block that reads target features" if block.features else None


def unwanted(block) -> str | None:
    """Why ``block`` is left to its modules before any compile (``RETROSPEC_COMPILE``, its dtype or device, target
    features), or None when it is wanted compiled."""
    unfit = _unfit(block)
    if unfit is not None:
        return unfit
    m = compile_mode()
    if m == "on" or (m == "auto" and block.config.hidden_size >= AUTO_MIN_HIDDEN):
        return None
    return "RETROSPEC_COMPILE=off" if m == "off" else \
        f"hidden size below {AUTO_MIN_HIDDEN} (RETROSPEC_COMPILE=on compiles it)"


def _signature(block) -> tuple[tuple[Proj, ...], tuple, list[torch.Tensor]] | None:
    """(projections, the program's other signature, weight arguments), or None where a part is not expressible."""
    attn, cross, mlp = block.self_attn, block.cross_attn, block.mlp
    mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, cross.q_proj, cross.o_proj, mlp.gate_proj,
            mlp.up_proj, mlp.down_proj]
    projs = tuple(Proj.of(m) for m in mods)
    norms = (block.norm1, block.norm2, block.norm3)
    act = getattr(block.config, "hidden_act", "silu")
    if any(p is None for p in projs) or act not in ("silu", "swish") or any(
            getattr(n, "weight", None) is None for n in norms):
        return None
    eps = tuple(float(getattr(n, "variance_epsilon", getattr(n, "eps", 1e-6))) for n in norms)
    sig = (block.num_heads, block.num_kv_heads, block.head_dim, eps, mlp.down_proj.in_features, float(block.scaling))
    args = [n.weight for n in norms] + [t for m in mods for t in Proj.tensors(m)]
    return projs, sig, args


def _example(block, args: list[torch.Tensor], rows: int = 2) -> list[torch.Tensor]:
    """Inputs of distinct sizes per dynamic dimension (export would tie equal ones)."""
    hidden, kvh, d = block.config.hidden_size, block.num_kv_heads, block.head_dim
    allowed = torch.ones(rows, 29, dtype=torch.bool).tril(27)
    return [torch.randn(rows, hidden), torch.randn(rows, d), torch.randn(rows, d),
            *(torch.randn(1, kvh, 37, d) for _ in "kv"), allowed, *(torch.randn(1, kvh, 53, d) for _ in "kv"),
            torch.zeros(rows, 45), *args]


def _runner(program: _Block, example: list[torch.Tensor], name: str, progress=None):
    rows = aot.rows_dim()
    cap, length = torch.export.Dim("capacity", min=2), torch.export.Dim("length", min=2)
    tcap, tlen = torch.export.Dim("target_capacity", min=2), torch.export.Dim("target_length", min=1)
    dims = ({0: rows}, {0: rows}, {0: rows}, {2: cap}, {2: cap}, {0: rows, 1: length}, {2: tcap}, {2: tcap},
            {0: rows, 1: tlen}, None, None, None, tuple(None for _ in example[12:]))
    return aot.runner(program, example, name, dims, progress, what="the draft block")


def _probe(block, rows: int, filled: int, target_len: int, gen: torch.Generator, tree: bool = False):
    """Inputs of one drafting call: ids [1, T], positions, a ring of ``filled`` random keys with room for the rows,
    the rows' own mask (a chain: row r sees rows 0..r; ``tree``: rows 0 and 1 siblings, row 2 below row 0), the
    target's cache of ``target_len`` positions (capacity to spare)."""
    kvh, d, vocab = block.num_kv_heads, block.head_dim, block.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (1, rows), generator=gen)
    positions = torch.arange(target_len, target_len + rows)[None]
    ring = KeyBuffer(*(torch.randn(1, kvh, filled + rows + 3, d, generator=gen) for _ in "kv"), filled)
    past_allowed = torch.rand(1, rows, filled, generator=gen) < 0.7
    own = torch.ones(rows, rows, dtype=torch.bool).tril()[None]
    if tree:
        own[0, 1, 0] = own[0, 2, 1] = False
    target = KeyBuffer(*(torch.randn(1, kvh, target_len + 7, d, generator=gen) for _ in "kv"), target_len)
    return ids, positions, own, ring, past_allowed, target


def _eager(block, ids, positions, own, ring, past_allowed, target):
    """The block's own modules on the same call (the target's cache as views: a call no program takes)."""
    views = (target.k[:, :, :target.filled], target.v[:, :, :target.filled])
    return block.run(ids, positions, own, ring, past_allowed, views)


def _checked(block, program: BlockProgram) -> str | None:
    """Why the program must not be used (None: it passes): logits, outputs and written keys within
    ``ROUNDED_TOLERANCE`` (relative to the largest magnitude) of the block's own run, for one row, a chain and a
    tree."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows, filled, target_len, tree in ((1, 40, 31, False), (3, 52, 17, False), (3, 45, 23, True)):
            call = _probe(block, rows, filled, target_len, gen, tree)
            ref_ring = KeyBuffer(call[3].k.clone(), call[3].v.clone(), filled)
            ours = program(block, *call)
            ref = _eager(block, *call[:3], ref_ring, *call[4:])
            for o, r in ((ours[0], ref[0]), (ours[3], ref[3]), (call[3].k, ref_ring.k), (call[3].v, ref_ring.v)):
                if o.shape != r.shape or not torch.isfinite(o).all():
                    return "the compiled block's results have another shape or are not finite"
                if (o - r).abs().max() > ROUNDED_TOLERANCE * max(1.0, r.abs().max().item()):
                    return f"the compiled block differs from the block by {(o - r).abs().max().item():.2g}"
    return None


def _timed(block, program: BlockProgram, reps: int = 9) -> dict:
    """{"eager_ms", "compiled_ms"}: median ms of a one-row drafting call over a 512-key ring and 512 cached positions,
    each timed right after a sweep of ``SWEEP_BYTES`` (as after a target step), the block's own and the program's in
    turn; "max_rows": the widest level up to which the program was also faster over ``LONG`` cached positions (many
    rows over a long cache may favour the block's own attention)."""
    call = _probe(block, 1, 512, 512, torch.Generator().manual_seed(1))
    sweep = torch.ones(SWEEP_BYTES // 4)

    def pair(call, cold: bool, reps: int) -> tuple[float, float]:
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for rep in range(reps + 1):
            for name, fn in (("eager", lambda: _eager(block, *call)), ("compiled", lambda: program(block, *call))):
                if cold:
                    sweep.add_(1.0)
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times["eager"]), statistics.median(times["compiled"])

    with torch.inference_mode():
        eager_ms, compiled_ms = pair(call, True, reps)
        max_rows = 1
        for rows in WIDTHS:
            eager, compiled = pair(_probe(block, rows, 512, LONG, torch.Generator().manual_seed(rows)), False, 5)
            if compiled > eager:
                break
            max_rows = rows
    return {"eager_ms": eager_ms, "compiled_ms": compiled_ms, "max_rows": max_rows}


def program_for(block, progress=None) -> tuple[BlockProgram | None, str | None]:
    """``block``'s compiled call, compiled (or loaded from the cache) and checked against the block's own run, and
    None; or (None, why not). Not timed (``build`` is). Never raises."""
    unfit = _unfit(block)
    if unfit is not None:
        return None, unfit
    found = _signature(block)
    if found is None:
        return None, "a part the program does not express"
    projs, sig, args = found
    try:
        if kernels.attention() is None:
            return None, "the attention kernel could not be built here"
        run = _runner(_Block(projs, *sig), _example(block, args), aot.key("longspec-block", (projs, sig)), progress)
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower, a full disk: the block still runs
        warnings.warn(f"the draft block was not compiled ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                      "drafting runs its modules", RuntimeWarning, stacklevel=3)
        return None, f"compile failed: {type(exc).__name__}"
    program = BlockProgram(run, args, (projs, sig))
    why = _checked(block, program)
    return (None, why) if why is not None else (program, None)


def build(block, progress=None) -> tuple[BlockProgram | None, dict]:
    """The compiled call of ``block`` (a LongSpec block as drafting runs it) when wanted, expressible, correct and
    faster here; else (None, why). Never raises: any failure leaves the block's own modules."""
    why = unwanted(block)
    if why is not None:
        return None, {"compiled": False, "why": why}
    t0 = time.perf_counter()
    program, why = program_for(block, progress)
    if program is None:
        return None, {"compiled": False, "why": why}
    verdict = timed_verdict(aot.key("longspec-block-verdict", program.signature), lambda: _timed(block, program),
                            keys=("eager_ms", "compiled_ms", "max_rows"))
    info = {"compiled": verdict["compiled_ms"] < verdict["eager_ms"], **verdict,
            "seconds": round(time.perf_counter() - t0, 2)}
    if not info["compiled"]:
        info["why"] = "not faster than the block's own modules here"
        return None, info
    program.max_rows = int(verdict["max_rows"])
    return program, info
