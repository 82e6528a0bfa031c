"""Attention-only timings for tree verification over a long cache (``python -m retrospec.bench.hybrid_timing``).

Per cache length L and attention shape, with random tensors (no model weights, no model forward):

- ``decode``: one query over L + 1 keys, transformers' ``sdpa_attention_forward`` without a mask (what a decode step
  costs per layer);
- ``masked``: the q = 1 + tree-size verification queries over L + q keys through ``sdpa_attention_forward`` with the
  full [q, L + q] additive ancestor mask, as transformers runs a tree forward (``repeat_kv`` + masked kernel);
- ``hybrid``: ``attention.hybrid_tree`` on the same inputs (its mask check included);
- ``chain``: ``attention.prefix_block`` with q queries and no mask (a chain of the same length: prefix + causal
  block), for comparison.

``triton_row`` (CUDA, Triton installed; not part of this command's table): the hybrid split with the Triton tree
kernel (``attention.hybrid_tree_triton``) on the same kind of inputs, its ms and its max |triton - masked|.

Shapes: ``smollm2`` = SmolLM2-135M (9 heads, 3 key/value heads, head dim 64), ``llama8b`` = Llama-3.1-8B (32, 8, 128).
The tree is given as nodes per depth (``--tree 4,16,16``: 4 children of the root, 16 nodes at depth 2 and 16 at
depth 3, each attached to a node of the level above in turn); q counts the root too. Each time is the median of the
repetitions (``--reps``, fewer when a case exceeds ``--budget-s``). ``max_diff`` is the largest |hybrid - masked|,
so a fast path that is wrong shows. Not a test: no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import types
from pathlib import Path

import torch

from ..fastpath import device_clock
from ..types import DraftTree
from ..verify import PrefillMemo, Verifier

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # heads, key/value heads, head dim


def tree_parents(widths: list[int]) -> list[int]:
    """Parents (-1 = root) of a tree with ``widths[k]`` nodes at depth k + 1, attached round-robin."""
    parents: list[int] = []
    above = [-1]
    for width in widths:
        level = []
        for i in range(width):
            level.append(len(parents))
            parents.append(above[i % len(above)])
        above = level
    return parents


def verification_mask(parents: list[int], cached: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, q, cached + q] additive mask over [cache, root, *tree], as ``verify.Verifier.score`` builds it."""
    from ..tree import ancestor_mask

    n = len(parents)
    block = torch.zeros(1 + n, 1 + n, dtype=torch.bool)  # [q, q]
    block[:, 0] = True
    block[1:, 1:] = ancestor_mask(torch.tensor(parents, dtype=torch.long))
    allowed = torch.cat([torch.ones(1 + n, cached, dtype=torch.bool), block], dim=1)  # [q, cached + q]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def time_call(fn, device: torch.device, reps: int, budget_s: float) -> float:
    """Median milliseconds of ``fn()`` over up to ``reps`` calls (at least 3) after one warm-up call."""
    clock = device_clock(device)
    fn()
    times: list[float] = []
    start = clock()
    while len(times) < reps and (len(times) < 3 or clock() - start < budget_s):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def measure(shape: str, length: int, parents: list[int], device: torch.device, dtype: torch.dtype, reps: int,
            budget_s: float, chain: bool = True, seed: int = 0) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..attention import hybrid_tree, prefix_block

    heads, kv_heads, dim = SHAPES[shape]
    q = 1 + len(parents)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    scaling = dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(seed)
    key = torch.randn(1, kv_heads, length + q, dim, generator=gen, device=device, dtype=dtype)  # [1, kvh, L+q, d]
    value = torch.randn(1, kv_heads, length + q, dim, generator=gen, device=device, dtype=dtype)  # [1, kvh, L+q, d]
    query = torch.randn(1, heads, q, dim, generator=gen, device=device, dtype=dtype)  # [1, h, q, d]
    mask = verification_mask(parents, length, dtype).to(device)  # [1, 1, q, L+q]
    k1, v1 = key[:, :, : length + 1], value[:, :, : length + 1]  # [1, kvh, L+1, d] views: decode reads L + 1 keys

    calls = {  # timed in this order
        "decode": lambda: sdpa_attention_forward(module, query[:, :, :1], k1, v1, None, scaling=scaling),
        "masked": lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=scaling),
        "hybrid": lambda: hybrid_tree.hybrid_tree_attention(module, query, key, value, mask, scaling=scaling),
        "check": lambda: hybrid_tree.hybrid_mask_block(mask, query, key),
        "chain": lambda: prefix_block.prefix_block_attention(module, query, key, value, None, scaling=scaling),
    }
    assert calls["check"]() is not None, "the hybrid split does not apply to this mask"
    diff = (calls["hybrid"]()[0].float() - calls["masked"]()[0].float()).abs().max().item()
    row = dict(shape=shape, heads=heads, kv_heads=kv_heads, head_dim=dim, length=length, q=q)
    row |= {f"{name}_ms": time_call(fn, device, reps, budget_s) if chain or name != "chain" else None
            for name, fn in calls.items()}
    row["max_diff"] = diff
    row["hybrid_over_decode"] = row["hybrid_ms"] / row["decode_ms"]
    row["masked_over_hybrid"] = row["masked_ms"] / row["hybrid_ms"]
    return row


def triton_row(shape: str, length: int, parents: list[int], device: torch.device, dtype: torch.dtype, reps: int,
               budget_s: float) -> dict:
    """The hybrid split with the Triton tree kernel (CUDA only): ms and max |triton - masked SDPA| on random inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..attention.hybrid_tree import merge_attention, prefix_attention
    from ..attention.hybrid_tree_triton import tree_attention_triton

    heads, kv_heads, dim = SHAPES[shape]
    q = 1 + len(parents)
    gen = torch.Generator(device=device).manual_seed(1)
    key = torch.randn(1, kv_heads, length + q, dim, generator=gen, device=device, dtype=dtype)  # [1, kvh, L+q, d]
    value = torch.randn(1, kv_heads, length + q, dim, generator=gen, device=device, dtype=dtype)  # [1, kvh, L+q, d]
    query = torch.randn(1, heads, q, dim, generator=gen, device=device, dtype=dtype)  # [1, h, q, d]
    mask = verification_mask(parents, length, dtype).to(device)  # [1, 1, q, L+q] additive
    block = (mask[0, :, :, length:] == 0)  # [1, q, q] bool, True = visible
    scale = dim ** -0.5

    def fused():
        out_p, lse_p = prefix_attention(query, key[:, :, :length], value[:, :, :length], scale)
        out_t, lse_t = tree_attention_triton(query, key[:, :, length:], value[:, :, length:], block, scale)
        return merge_attention(out_p, lse_p, out_t, lse_t)  # [1, h, q, d] float32

    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    ref = sdpa_attention_forward(module, query, key, value, mask, scaling=scale)[0]  # [1, q, h, d]
    diff = (fused().transpose(1, 2).float() - ref.float()).abs().max().item()
    return {"shape": shape, "length": length, "q": q, "triton_ms": time_call(fused, device, reps, budget_s),
            "triton_max_diff": diff}


def table(rows: list[dict]) -> str:
    head = (f"{'shape':<8} {'L':>6} {'q':>3} {'decode':>8} {'masked':>8} {'hybrid':>8} {'check':>7} {'chain':>8} "
            f"{'hyb/dec':>8} {'mask/hyb':>8} {'max_diff':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        chain = f"{r['chain_ms']:8.2f}" if r["chain_ms"] is not None else f"{'-':>8}"
        lines.append(f"{r['shape']:<8} {r['length']:>6} {r['q']:>3} {r['decode_ms']:8.2f} {r['masked_ms']:8.2f} "
                     f"{r['hybrid_ms']:8.2f} {r['check_ms']:7.3f} {chain} {r['hybrid_over_decode']:8.2f} "
                     f"{r['masked_over_hybrid']:8.2f} {r['max_diff']:9.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retrospec.bench.hybrid_timing", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768", help="cache lengths L, comma-separated")
    ap.add_argument("--tree", default="4,16,16", help="tree nodes per depth below the root")
    ap.add_argument("--shapes", default="smollm2,llama8b", help=f"comma-separated, from {sorted(SHAPES)}")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (cpu)")
    ap.add_argument("--reps", type=int, default=9, help="at most this many timed calls per case (median)")
    ap.add_argument("--budget-s", type=float, default=3.0, help="stop repeating a case after this long (>= 3 calls)")
    ap.add_argument("--no-chain", action="store_true", help="skip the prefix_block chain timing")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    parents = tree_parents([int(w) for w in args.tree.split(",") if w])
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    rows = [measure(shape, int(length), parents, device, dtype, args.reps, args.budget_s, chain=not args.no_chain)
            for shape in shapes for length in args.lengths.split(",") if length]
    print(f"device {device} ({torch.get_num_threads()} threads), {dtype}, tree {args.tree} (q = {1 + len(parents)}),"
          " ms per attention call (median)")
    print(table(rows))
    if args.out:
        meta = dict(device=str(device), threads=torch.get_num_threads(), dtype=str(dtype), tree=args.tree,
                    torch=torch.__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


@torch.inference_mode()
def verify_cost(target: torch.nn.Module, prompt_ids: list[int], gamma: int = 10, reps: int = 15,
                memo: PrefillMemo | None = None) -> dict:
    """Median seconds of one verification forward of ``gamma`` chain tokens vs one decode token after
    ``prompt_ids`` (cache rolled back after each call, so every call sees the same cache length), with the target
    as it is (transformers' ``sdpa``) and through the engine's fast copy (``fastpath``: ``attention.prefix_block``
    and the measured matmul paths). The caller's model is not changed."""
    root = prompt_ids[-1]
    chain = DraftTree.chain(prompt_ids[-gamma - 1:-1] if len(prompt_ids) > gamma else [root] * gamma)
    out = {"cache_tokens": len(prompt_ids), "gamma": gamma}
    for key, how in (("sdpa", "off"), ("prefix_block", None)):
        ver = Verifier(target, fastpath=how)
        if how is None and ver.engine.mode == "off":
            continue
        ver.prefill(prompt_ids[:-1], memo)  # the decode loop's invariant: the cache holds all but the root
        times: dict[int, list[float]] = {0: [], gamma: []}
        clock = device_clock(ver.device)
        for _ in range(reps):
            for n, tree in ((0, DraftTree.empty()), (gamma, chain)):
                t = clock()
                ver.score(root, tree)
                times[n].append(clock() - t)
                ver.commit([])
                ver.kv.crop(len(prompt_ids))
        t1, tg = statistics.median(times[0]), statistics.median(times[gamma])
        out[key] = {"attention": ver.engine.describe()["attention"], "decode_s": t1, "verify_s": tg,
                    "ratio": tg / t1}
    return out
