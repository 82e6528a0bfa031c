"""Steps ``kernels`` and ``costmodel`` (tools/gpu/README.md: what each measures).

``kernels``: tree verification attention through masked SDPA, ``attention.hybrid_tree`` (rows from
``bench.hybrid_timing.measure``) and the Triton tree kernel (CUDA only, ``bench.hybrid_timing.triton_row``); ``max_diff`` is |fast - masked| so a wrong
fast path shows. Dry run: SmolLM2 shape, L = 256 and 512, float32, no Triton. ``costmodel``: random-weight models
of real shapes (configs here, weights drawn on the device), ms per forward of T tokens over a cache of L tokens.
Dry run: 2-layer models of the same families.

Invariant: every time is a median with CUDA synchronized around it (``common.time_ms``, ``hybrid_timing.time_call``); nothing is asserted.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from . import common

LENGTHS = (8192, 16384, 32768, 65536, 131072)
TREE = (4, 16, 16)
REAL_SHAPES = {
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6)),
}
CONTEXTS = (1024, 8192, 32768)
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def run_kernels(out: Path, dry_run: bool, budget_s: float, ref_dir: Path | None = None) -> int:
    from retrospec.attention import hybrid_tree_triton
    from retrospec.bench.hybrid_timing import measure, tree_parents, triton_row

    res, device = common.start("kernels", dry_run, budget_s)
    dtype = torch.float32 if dry_run else torch.bfloat16
    parents = tree_parents(list(TREE))
    cases = [("smollm2", n) for n in (256, 512)] if dry_run else [
        (s, n) for n in LENGTHS for s in ("smollm2", "llama8b")]
    use_triton = device.type == "cuda" and hybrid_tree_triton.available()
    res.figures |= {"dtype": common.dtype_name(dtype), "tree": list(TREE), "q": 1 + len(parents),
                    "triton": use_triton, "rows": []}
    if not use_triton:
        res.notes.append("triton rows skipped: " + ("a dry run on CPU" if dry_run else "triton unavailable"))
    reps, each = (2, 0.5) if dry_run else (15, 3.0)
    for shape, length in cases:
        if res.left() < (1 if dry_run else 15):
            res.notes.append(f"{shape} L={length}: skipped, out of budget")
            continue
        row = res.part(f"{shape}/{length}", measure, shape, length, parents, device, dtype, reps, each, chain=False)
        if row is None:
            continue
        if use_triton:
            row |= res.part(f"{shape}/{length}/triton", triton_row, shape, length, parents, device, dtype, reps,
                            each) or {}
            if "triton_ms" in row:
                row["masked_over_triton"] = row["masked_ms"] / row["triton_ms"]
        res.figures["rows"].append(row)
        torch.cuda.empty_cache()  # a no-op without CUDA
    return common.finish(res, out)


@torch.inference_mode()
def forward_ms(model, context: int, tokens: tuple[int, ...], device, reps: int, budget_s: float) -> dict[int, float]:
    """ms per forward of T tokens over a cache of ``context`` tokens (the cache cropped back after each call)."""
    from retrospec.kv.cache import KVCache

    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(context)
    kv = KVCache(model)  # the engine's cache (preallocated, rollback = a length pointer)
    cache = kv.cache
    chunk = 8192
    for s in range(0, context, chunk):  # prefill through the decoder only: no [context, vocab] logits
        n = min(chunk, context - s)
        ids = torch.randint(0, vocab, (1, n), generator=gen, device=device)
        model.model(input_ids=ids, past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(s, s + n, device=device)[None])
    out = {}
    for t in tokens:
        ids = torch.randint(0, vocab, (1, t), generator=gen, device=device)
        pos = torch.arange(context, context + t, device=device)[None]

        def step():
            model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos)
            kv.crop(context)

        out[t] = common.time_ms(step, device, reps, 1, budget_s)
    return out


def run_costmodel(out: Path, dry_run: bool, budget_s: float, ref_dir: Path | None = None) -> int:
    res, device = common.start("costmodel", dry_run, budget_s)
    dtype = torch.float32 if dry_run else torch.bfloat16
    contexts, tokens = ((32, 64), (1, 4)) if dry_run else (CONTEXTS, TOKENS)
    reps, each = (2, 0.5) if dry_run else (9, 2.0)
    res.figures |= {"dtype": common.dtype_name(dtype), "contexts": list(contexts), "tokens": list(tokens),
                    "models": {}}
    for name, (arch, shape) in REAL_SHAPES.items():
        if res.left() < (1 if dry_run else 30):
            res.notes.append(f"{name}: skipped, out of budget")
            continue
        # built on the device in fp32 then cast: ~3x the bf16 bytes at the peak (48 GB for 8B, fits an H100)
        model = res.part(f"{name}/build", lambda cfg: common.random_causal_lm(arch, cfg, device).to(dtype),
                         (common.TINY | {"vocab_size": 256} if dry_run else shape) | {"tie_word_embeddings": False})
        if model is None:
            continue
        # one untimed pass over every size first: the first forward of each new shape pays one-off costs (seen on the
        # CPU: 15x at T=4) that would otherwise land in the first context's medians
        res.part(f"{name}/warmup", forward_ms, model, contexts[0], tokens, device, 1, 0.1)
        entry = {"shape": "tiny stand-in" if dry_run else shape, "arch": arch,
                 "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "ms": {}}
        for ctx in contexts:
            if res.left() < (0.5 if dry_run else 20):
                res.notes.append(f"{name} context {ctx}: skipped, out of budget")
                continue
            got = res.part(f"{name}/{ctx}", forward_ms, model, ctx, tokens, device, reps, each)
            if got is not None:
                entry["ms"][str(ctx)] = {str(t): v for t, v in got.items()}
        res.figures["models"][name] = entry
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return common.finish(res, out)
