"""``retrospec profile``: what one target forward costs on this machine, by tokens per forward and context length.

Every method's speedup is tau divided by what a verification step costs next to a plain decode step, so this is
how a user chooses a method on their hardware. Measured (medians, one process, nothing else should run):

- ``forward_ms[context][tokens]``: one ``Verifier.score`` of a chain of ``tokens - 1`` draft nodes (``tokens`` rows:
  the root and the chain) over a cache of ``context`` tokens, through the engine's fast path (``fastpath``) — what
  every method pays; ``plain_forward_ms`` the same with the target as it is (transformers' ``sdpa`` and its own
  matmuls, ``RETROSPEC_FASTPATH=off``); ``tree_ms`` for draft trees of the shapes methods use;
- floors: the weights' bytes read once at the measured memory bandwidth (``bandwidth_floor_ms``), and the model's
  linear layers alone on the engine's matmul path (``linear_ms``, decoder linears + head, no attention or norms);
- with a draft: its cost per drafted token (a one-token step of the draft on its own cache), as a share of a
  one-token target step, both repeated (``ms_per_token``: a chain's later tokens) and right after a one-token target
  step (``ms_first_after_step``: a step's first drafted token, which finds the caches the target's forward left);
- ``gamma``: the chain length a method would pick from these costs for a per-token acceptance alpha (expected
  tokens per step (1 - alpha^(g+1)) / (1 - alpha) over the step's cost, against a plain step), per alpha.

Times depend on the machine and on what else runs; the JSON records the machine, torch version and threads.
"""

from __future__ import annotations

import platform
import statistics
from pathlib import Path

import torch

from ..fastpath import device_clock, engine_for, machine_id
from ..fastpath.linear import KernelLinear, PackedLinear
from ..fastpath.plan import median_ms
from ..kv import KVCache
from ..types import DraftTree
from ..weight_only import WeightOnlyLinear, format_of, matmul_bytes
from ..verify import Verifier

DEFAULT_CONTEXTS = (300, 2000)
DEFAULT_TOKENS = (1, 2, 3, 4, 5, 8, 16)  # 4: the last row count of the quantized kernels' 4-row blocks
TREES = ((4, 3), (4, 2, 2, 1))  # children per node per depth: 4 + 12 = 16 nodes; 4 + 8 + 16 + 16 = 44 nodes
ALPHAS = (0.5, 0.7, 0.9)


def tree_shape(fanout: tuple[int, ...]) -> DraftTree:
    """A full tree with ``fanout[d]`` children per node at depth d (breadth first; tokens are placeholders)."""
    parents, level = [], [-1]
    for f in fanout:
        first = len(parents)
        parents += [p for p in level for _ in range(f)]
        level = list(range(first, len(parents)))
    return DraftTree(torch.arange(10, 10 + len(parents)), torch.tensor(parents, dtype=torch.long))


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The host's largest CPU cache in bytes as the kernel reports it (Linux sysfs), 0 where unknown."""
    best = 0
    for f in Path(root).glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            best = max(best, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return best


def bandwidth_gbs(mib: int | None = None, device: torch.device | None = None) -> float:
    """Memory read bandwidth of ``device`` (the host's by default; a GPU's own memory on CUDA): a sum over ``mib``
    MiB of touched float32 memory (best of 5; synchronised on CUDA). Default size: 256 MiB, and on the host at least
    twice the last-level cache (some server CPUs have hundreds of MiB of L3: a smaller probe would time the cache)."""
    device = device or torch.device("cpu")
    if mib is None:
        mib = 256 if device.type != "cpu" else max(256, 2 * last_level_cache_bytes() >> 20)
    x = torch.ones(mib * (1 << 20) // 4, device=device)
    clock = device_clock(device)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        x.sum()
        best = min(best, clock() - t0)
    return x.numel() * 4 / best / 1e9


@torch.inference_mode()
def verify_ms(model, paths: dict[str, tuple[str | None, dict[str, DraftTree]]], context: int, reps: int,
              vocab: int) -> dict[str, dict[str, float]]:
    """Median ms of one ``Verifier.score`` per path (name -> (fastpath mode, {shape name: tree})) over a cache of
    ``context`` tokens, rolled back after each call. Interleaved (every repetition runs every path and shape in
    turn), so slow drift of the machine hits all alike."""
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    verifiers, clock = {}, device_clock(next(model.parameters()).device)
    for name, (how, _) in paths.items():
        verifiers[name] = Verifier(model, fastpath=how)
        verifiers[name].prefill(prompt[:-1])
    times = {name: {shape: [] for shape in shapes} for name, (_, shapes) in paths.items()}
    for rep in range(reps + 1):  # the first repetition warms up
        for name, ver in verifiers.items():
            for shape, tree in paths[name][1].items():
                t = clock()
                ver.score(prompt[-1], tree)
                ver.commit([])
                ver.kv.crop(context - 1)
                if rep:
                    times[name][shape].append(clock() - t)
    return {name: {shape: statistics.median(ts) * 1e3 for shape, ts in row.items()} for name, row in times.items()}


@torch.inference_mode()
def linear_ms(model, tokens: tuple[int, ...], reps: int) -> dict[int, float]:
    """Median ms of the decoder's linear layers (as the engine runs them) plus the head, per token count."""
    engine = engine_for(model)
    module = engine.module
    decoder = engine.decoder if engine.decoder is not None else module.get_decoder()
    kinds = (torch.nn.Linear, PackedLinear, KernelLinear, WeightOnlyLinear)
    lins = [m for m in decoder.modules() if isinstance(m, kinds)]
    emb = module.get_input_embeddings().weight  # the activations' dtype and device
    head = module.get_output_embeddings()
    logits = engine.logits_of if engine.decoder is not None else head  # the head as the engine applies it
    out = {}
    for t in tokens:
        xs = {m.in_features: torch.randn(1, t, m.in_features, dtype=emb.dtype, device=emb.device) for m in lins}
        h = torch.randn(t, head.in_features, dtype=emb.dtype, device=emb.device)

        def run():
            for m in lins:
                m(xs[m.in_features])
            logits(h)

        out[t] = median_ms(run, reps, emb.device)
    return out


def target_step(model, context: int, vocab: int):
    """A callable running one one-token ``Verifier.score`` of ``model`` over a cache of ``context`` tokens, rolled
    back after each call: what decoding runs between two drafting steps."""
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    ver = Verifier(model)
    ver.prefill(prompt[:-1])
    empty = DraftTree.empty()

    def step():
        ver.score(prompt[-1], empty)
        ver.commit([])
        ver.kv.crop(context - 1)

    return step


def _token_ms(step, reps: int, device, after=None) -> float:
    """Median ms of ``step``; with ``after``, each timed call runs right after one untimed ``after()`` (the first
    drafted token of a decoding step, with the caches and threads the target's forward left)."""
    if after is None:
        return median_ms(step, reps, device)
    clock, times = device_clock(device), []
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first repetition warms up
            after()
            t = clock()
            step()
            if rep:
                times.append(clock() - t)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def draft_step_ms(draft, context: int, reps: int, after=None) -> float:
    """Median ms of one draft token (a one-token forward of the draft on its own cache of ``context`` tokens), on
    the draft's engine as ``sd`` runs it (``engine_for(draft, draft=True)``); ``after``: see ``_token_ms``."""
    engine = engine_for(draft, draft=True)
    kv = KVCache(draft)
    device = next(draft.parameters()).device
    ids = torch.randint(0, draft.config.vocab_size, (1, context), device=device)
    engine.forward(ids, torch.arange(context, device=device)[None], None, kv.cache, last_only=True)
    one, pos = torch.tensor([[1]], device=device), torch.tensor([[context]], device=device)

    def step():
        engine.forward(one, pos, None, kv.cache, last_only=True)
        kv.crop(context)

    return _token_ms(step, reps, device, after)


@torch.inference_mode()
def block_step_ms(block, target_model, context: int, reps: int, after=None) -> float:
    """Median ms of one token drafted by a LongSpec block as ``longspec`` runs it (its fast copy,
    ``drafters.longspec.fast_block``): ``DraftState.speculate`` of one tentative token over a ring of ``context``
    committed tokens, cross-attending to the target's last-layer K/V of ``context`` tokens; ``after``: see
    ``_token_ms``."""
    from ..drafters.longspec import fast_block
    from ..models.longspec import DraftState, KeyBuffer

    cfg = target_model.config
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ref = next(target_model.parameters())
    # the target's cache as drafting reads it: its buffers (room to spare) holding ``context`` positions
    kv = KeyBuffer(*(torch.randn(1, heads, context + 64, dim, dtype=ref.dtype, device=ref.device) for _ in "kv"),
                   context)
    state = DraftState(fast_block(block))
    state.append(torch.randint(0, cfg.vocab_size, (context,)))

    def step():
        state.speculate([1], [-1], kv)
        state.rollback()

    return _token_ms(step, reps, ref.device, after)


def best_gamma(step_ms: dict[int, float], draft_ms: float, alpha: float, max_gamma: int,
               first_ms: float | None = None) -> tuple[int, float]:
    """(gamma, expected speedup over plain decoding) maximising expected tokens per ms for a chain of gamma; 0 =
    plain decoding pays best. ``step_ms[t]`` = a forward of t tokens (read linearly between measured t); a chain's
    first drafted token costs ``first_ms`` (default ``draft_ms``), the others ``draft_ms`` each."""
    xs = sorted(step_ms)
    first = draft_ms if first_ms is None else first_ms

    def cost(t):
        for lo, hi in zip(xs, xs[1:]):
            if lo <= t <= hi:
                return step_ms[lo] + (t - lo) / (hi - lo) * (step_ms[hi] - step_ms[lo])
        return step_ms[xs[-1]] * t / xs[-1]

    best, rate = 0, 1.0 / step_ms[xs[0]]
    for g in range(1, max_gamma + 1):
        expected = (1 - alpha ** (g + 1)) / (1 - alpha)
        r = expected / (first + (g - 1) * draft_ms + cost(g + 1))
        if r > rate:
            best, rate = g, r
    return best, rate * step_ms[xs[0]]


def run_profile(target, draft=None, contexts=DEFAULT_CONTEXTS, tokens=DEFAULT_TOKENS, reps: int = 7,
                plain: bool = True, trees: bool = True, progress=None) -> dict:
    """The whole profile as one JSON-ready dict (see the module docstring). ``target``/``draft``: loaded models."""
    model = target.model
    vocab = int(model.config.vocab_size)
    say = progress or (lambda _msg: None)
    engine = engine_for(model)
    say(f"engine: {engine.describe()}")
    chains = {str(t): DraftTree.chain(list(range(10, 10 + t - 1))) for t in tokens}
    tree_shapes = {f"tree{len(t)}": t for t in map(tree_shape, TREES)} if trees else {}
    fwd, base, tree_ms = {}, {}, {}
    for ctx in contexts:
        say(f"context {ctx}")
        paths = {"engine": (None, chains | tree_shapes)} | ({"plain": ("off", chains)} if plain else {})
        got = verify_ms(model, paths, ctx, reps, vocab)  # one interleaved pass: the engine's chains and trees,
        if plain:  # and transformers' chains
            base[str(ctx)] = got["plain"]
        got = got["engine"]
        fwd[str(ctx)] = {k: got[k] for k in chains}
        tree_ms[str(ctx)] = {k: got[k] for k in tree_shapes}  # "tree16": a tree of 16 draft nodes
    say("floors")
    fmt, weights, shapes = weight_bytes(model)
    bw = bandwidth_gbs(device=next(model.parameters()).device)
    # every format this model could run in, read once at the measured bandwidth (the step's lower bound)
    formats = {f: {"weights_bytes": matmul_bytes(shapes, f), "floor_ms": matmul_bytes(shapes, f) / bw / 1e6}
               for f in ("float32", "bfloat16", "int8", "w8a8", "int4", "w4a8")}
    if fmt == "gguf":
        formats["gguf"] = {"weights_bytes": weights, "floor_ms": weights / bw / 1e6}
    lin = linear_ms(model, tokens, reps)
    out = {
        "target": str(getattr(target, "path", "")),
        "machine": machine_id(), "arch": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "engine": engine.describe(), "contexts": list(contexts), "tokens": list(tokens), "forward_ms": fwd,
        "ratio": {c: {t: v / row[str(tokens[0])] for t, v in row.items()} for c, row in fwd.items()},
        "plain_forward_ms": base, "tree_ms": tree_ms,
        "format": fmt,
        "floors": {"weights_bytes": weights, "bandwidth_gbs": bw, "bandwidth_floor_ms": weights / bw / 1e6,
                   "linear_ms": {str(t): v for t, v in lin.items()}, "formats": formats},
    }
    short = fwd[str(contexts[0])]
    steps = {int(t): v for t, v in short.items()}
    draft_ms = first_ms = None
    if draft is not None:
        say("draft")
        block = getattr(draft, "longspec_block", None)
        after = target_step(model, contexts[0], vocab)
        if block is not None:
            draft_ms, first_ms = (block_step_ms(block, model, contexts[0], reps, a) for a in (None, after))
        else:
            draft_ms, first_ms = (draft_step_ms(draft.model, contexts[0], reps, a) for a in (None, after))
        out["draft"] = {"model": str(getattr(draft, "path", "")), "ms_per_token": draft_ms,
                        "share_of_target_step": draft_ms / steps[min(steps)],
                        "ms_first_after_step": first_ms, "share_first_after_step": first_ms / steps[min(steps)]}
        if block is not None:  # whether its drafting calls ran as one compiled program (``fastpath.compiled_block``)
            from ..drafters.longspec import fast_block
            from ..fastpath import compiled_block

            out["draft"]["compiled"] = getattr(fast_block(block), "program_info", None) or {
                "compiled": False, "why": compiled_block.unwanted(block)}
    gam = {"pld (draft cost ~0)": {str(a): best_gamma(steps, 0.0, a, 16) for a in ALPHAS}}
    if draft_ms is not None:
        gam["sd"] = {str(a): best_gamma(steps, draft_ms, a, 16, first_ms) for a in ALPHAS}
    out["gamma"] = {m: {a: {"gamma": g, "expected_speedup": s} for a, (g, s) in row.items()} for m, row in gam.items()}
    return out


def weight_bytes(model: torch.nn.Module) -> tuple[str, int, list[tuple[int, int]]]:
    """(format, bytes a forward reads for the decoder's linears and the head, their (out, in) shapes). A GGUF file's
    own blocks mix kinds (4-bit linears, an 8-bit head): each layer is counted in its kind."""
    layers = [m for m in model.get_decoder().modules() if isinstance(m, (torch.nn.Linear, WeightOnlyLinear))]
    layers.append(model.get_output_embeddings())
    shapes = [(m.out_features, m.in_features) for m in layers]
    fmt = format_of(model) or str(next(model.parameters()).dtype).replace("torch.", "")
    if fmt == "gguf":
        return fmt, sum(matmul_bytes([(m.out_features, m.in_features)], m.fmt) for m in layers), shapes
    return fmt, matmul_bytes(shapes, fmt), shapes


def render_format_steps(rows: dict, context: int) -> list[str]:
    """Markdown lines: one row per format, ours and llama.cpp's step against the format's floor."""
    lines = ["", f"Decode step by format (context {context}; floor: weights read once at the measured bandwidth):", "",
             "| format | weights | floor | retrospec step | llama.cpp step | retrospec / llama.cpp speed | our layers |",
             "|---|---|---|---|---|---|---|"]
    for fmt, r in rows.items():
        ours = f"{r['step_ms']:.1f} ms ({r['step_ms'] / r['floor_ms']:.2f}x floor)"
        if "llamacpp_ms" in r:
            peer = f"{r['llamacpp_ms']:.1f} ms ({r['llamacpp_ms'] / r['floor_ms']:.2f}x floor)"
            ratio = f"{r['llamacpp_ms'] / r['step_ms']:.2f}x"
        else:
            peer, ratio = f"— ({r['llamacpp_note']})", "—"
        lines.append(f"| {fmt} | {r['weights_bytes'] / 1e6:.0f} MB | {r['floor_ms']:.1f} ms | {ours} | {peer} | "
                     f"{ratio} | {r.get('loop', '-')} |")
    return lines


def render_plot(profile: dict, path) -> None:
    """ms per forward by tokens, one line per context (engine solid, plain transformers dashed), floors dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, ctx in enumerate(profile["forward_ms"]):
        color = f"C{i}"
        row = profile["forward_ms"][ctx]
        ax.plot([int(t) for t in row], list(row.values()), "o-", color=color, label=f"retrospec, context {ctx}")
        plain = profile["plain_forward_ms"].get(ctx)
        if plain:
            ax.plot([int(t) for t in plain], list(plain.values()), "s--", color=color, alpha=0.6,
                    label=f"transformers as is, context {ctx}")
    lin = profile["floors"]["linear_ms"]
    ax.plot([int(t) for t in lin], list(lin.values()), ":", color="gray", label="linear layers alone")
    ax.axhline(profile["floors"]["bandwidth_floor_ms"], color="black", lw=0.8, ls=":",
               label=f"weights at {profile['floors']['bandwidth_gbs']:.0f} GB/s")
    ax.set_xlabel("tokens per target forward (root + chain)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{profile['target'].split('/')[-1] or 'target'}: forward cost on {profile['machine'][:40]}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_table(profile: dict) -> str:
    """Markdown: ms and ratio to a one-token step per context and token count, trees, floors, draft, gamma."""
    toks = [str(t) for t in profile["tokens"]]
    lines = ["| context | path | " + " | ".join(f"{t} tok" for t in toks) + " |",
             "|---|---|" + "---|" * len(toks)]
    for ctx, row in profile["forward_ms"].items():
        for name, ms in (("retrospec", row), ("transformers", profile["plain_forward_ms"].get(ctx))):
            if ms:
                cells = (f"{ms[t]:.1f} ms" + ("" if t == toks[0] else f" ({ms[t] / ms[toks[0]]:.2f}x)") for t in toks)
                lines.append(f"| {ctx} | {name} | " + " | ".join(cells) + " |")
    fl = profile["floors"]
    lines += ["| - | linear layers alone | " + " | ".join(f"{fl['linear_ms'][t]:.1f} ms" for t in toks) + " |", ""]
    lines.append(f"Weights {fl['weights_bytes'] / 1e6:.0f} MB at {fl['bandwidth_gbs']:.1f} GB/s: "
                 f"floor {fl['bandwidth_floor_ms']:.1f} ms per forward"
                 + (f" ({profile['format']}; a one-token step here is "
                    f"{profile['forward_ms'][str(profile['contexts'][0])][toks[0]] / fl['bandwidth_floor_ms']:.1f}x "
                    "its floor)." if profile.get("format") else "."))
    if fl.get("formats"):
        lines.append("Floors by format (same weights, read once): " + ", ".join(
            f"{f} {v['weights_bytes'] / 1e6:.0f} MB = {v['floor_ms']:.1f} ms" for f, v in fl["formats"].items()) + ".")
    for ctx, row in profile["tree_ms"].items():
        one = profile["forward_ms"][ctx][toks[0]]
        for name, ms in row.items():
            lines.append(f"Context {ctx}, {name[4:]}-node tree: {ms:.1f} ms ({ms / one:.2f}x a one-token step).")
    if "draft" in profile:
        d = profile["draft"]
        lines.append(f"Draft: {d['ms_per_token']:.2f} ms per drafted token = "
                     f"{100 * d['share_of_target_step']:.1f} % of a one-token target step; the first of a step, right "
                     f"after the target's forward: {d['ms_first_after_step']:.2f} ms = "
                     f"{100 * d['share_first_after_step']:.1f} %.")
        if "compiled" in d:
            c = d["compiled"]
            lines.append("The block's drafting call ran as one compiled program." if c.get("compiled") else
                         f"The block's drafting call ran its modules ({c.get('why')}).")
    for m, row in profile["gamma"].items():
        picks = ", ".join(f"alpha {a}: gamma {v['gamma']} (~{v['expected_speedup']:.2f}x)" for a, v in row.items())
        lines.append(f"Best chain for {m}: {picks}.")
    if profile.get("format_steps"):
        lines += render_format_steps(profile["format_steps"], profile["contexts"][0])
        lines.append("")
    e = profile["engine"]
    lines.append(f"Engine: {e.get('mode')} (attention {e.get('attention')}, prepacked linears for "
                 f"{e.get('packed_rows', [])} rows, head {e.get('head', {})}; plan {e.get('plan', '-')}; decoder layers "
                 f"{e.get('loop', '-')}).")
    return "\n".join(lines) + "\n"
