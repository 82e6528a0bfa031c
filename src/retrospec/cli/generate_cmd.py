"""``retrospec generate``: one prompt, streamed text or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RetrospecError


def add_sampling_args(p) -> None:
    p.add_argument("--target", help="target model directory (default: bundled zoo target)")
    p.add_argument("--draft", help="draft model directory (default: bundled zoo draft when --target is unset)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--gamma", type=int, default=None, help="draft length (sd: 5, pld: 10)")
    p.add_argument("--adaptive-gamma", action="store_true", help="sd: grow gamma on full acceptance, shrink on rejection")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one prompt")
    p.add_argument("--method", default="sd", help="ar | sd | pld (default: sd)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise RetrospecError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RetrospecError(f"prompt file is not UTF-8 text: {path}") from None


JSON_STATS = ("method", "new_tokens", "target_calls", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens",
              "acceptance_rate", "prefill_s", "decode_s", "tokens_per_s")


def run(args) -> int:
    from ..api import stream

    s = stream(read_prompt(args), target=args.target, draft=args.draft, method=args.method,
               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
               seed=args.seed, gamma=args.gamma, adaptive_gamma=args.adaptive_gamma, stop=args.stop)
    if args.json:
        for _ in s.token_chunks():
            pass
        res = s.result
        full = res.stats.to_dict()
        stats = {k: full[k] for k in JSON_STATS} | {"per_position_acceptance": full["per_position_acceptance"]}
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": stats}))
        return 0
    for piece in s:
        sys.stdout.write(piece)
        sys.stdout.flush()
    st = s.result.stats
    print(f"\n[{st.method}] {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s, tau {st.mean_accepted_tokens:.2f}, "
          f"acceptance {st.acceptance_rate:.2f}, prefill {st.prefill_s * 1000:.0f} ms", file=sys.stderr)
    return 0
