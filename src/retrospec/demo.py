"""``make demo`` / ``python -m retrospec.demo``: the main job on the bundled zoo, in about a minute on 2 cores.

1. Streams one speculative generation (sd) for a held-out standard-library prompt.
2. Benchmarks ar, sd, pld and Hugging Face's assisted generation and prompt lookup on held-out prompts, printing the
   side-by-side table (tokens/s, speedup, tau, acceptance, lossless) and writing results under ``runs/demo``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    from rich.console import Console

    from .api import stream
    from .bench.harness import BenchConfig, run_bench, write_outputs
    from .bench.report import print_table
    from .bench.tasks import heldout_prompts
    from .errors import RetrospecError
    from .models import load_model, resolve_name

    console = Console()
    try:
        prompts = heldout_prompts(8)
        target = load_model(resolve_name("zoo"), role="target")
        draft = load_model(resolve_name("zoo-draft"), role="draft")
    except RetrospecError as exc:
        print(f"retrospec: error: {exc}", file=sys.stderr)
        return 2
    n_t = sum(p.numel() for p in target.model.parameters()) / 1e6
    n_d = sum(p.numel() for p in draft.model.parameters()) / 1e6
    console.rule("[bold]retrospec demo: bundled zoo")
    console.print(f"target {n_t:.1f}M params, draft {n_d:.1f}M params (Llama, trained on the stdlib's source)")
    console.print(f"prompt from held-out [cyan]{prompts[0]['source']}[/]:")
    console.print(prompts[0]["prompt"], style="dim", markup=False, highlight=False)
    s = stream(prompts[0]["prompt"], target=target, draft=draft, method="sd", max_new_tokens=96)
    for piece in s:
        console.print(piece, end="", style="green", markup=False, highlight=False)
    st = s.result.stats
    console.print(f"\n[sd] {st.new_tokens} tokens, {st.tokens_per_s:.0f} tok/s, tau {st.mean_accepted_tokens:.2f}, "
                  f"acceptance {st.acceptance_rate:.2f}")
    console.rule("[bold]bench: 8 held-out prompts, greedy, 96 new tokens")
    cfg = BenchConfig(methods=["ar", "sd", "pld", "hf-assisted", "hf-assisted-default", "hf-pld"],
                      max_new_tokens=96)
    result = run_bench(target, draft, prompts, cfg)
    out = Path("runs/demo")
    write_outputs(result, out)
    print_table(result["summary"])
    console.print(f"results: {out / 'report.md'}, {out / 'results.json'}, {out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
