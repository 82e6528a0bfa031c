"""``retrospec zoo build|info``: train or describe the bundled tiny model zoo."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("zoo", help="build or inspect the bundled tiny model zoo")
    zsub = p.add_subparsers(dest="zoo_command", required=True)
    b = zsub.add_parser("build", help="train tokenizer, target and distilled draft on the stdlib source (CPU ok)")
    b.add_argument("--out", required=True, help="output directory (written atomically)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--target-tokens", type=int, default=4_000_000)
    b.add_argument("--draft-tokens", type=int, default=2_500_000)
    b.add_argument("--self-distill-tokens", type=int, default=0,
                   help="also distil the draft on this many tokens the target generates from corpus prefixes")
    b.add_argument("--reuse-target", help="existing zoo dir: keep its tokenizer and target, retrain only the draft")
    b.set_defaults(func=run_build)
    i = zsub.add_parser("info", help="print the bundled zoo's manifest")
    i.add_argument("dir", nargs="?", help="zoo directory (default: bundled)")
    i.set_defaults(func=run_info)


def run_build(args) -> int:
    from ..errors import RetrospecError
    from ..train.zoo import ZooBuildConfig, build_zoo

    if args.target_tokens <= 0 or args.draft_tokens <= 0:
        raise RetrospecError("token budgets must be > 0")
    reuse = Path(args.reuse_target) if args.reuse_target else None
    if reuse is not None and not (reuse / "target" / "config.json").is_file():
        raise RetrospecError(f"--reuse-target: no zoo target at {reuse / 'target'}")
    build_zoo(ZooBuildConfig(out=Path(args.out), seed=args.seed, target_tokens=args.target_tokens,
                             draft_tokens=args.draft_tokens, reuse_target=reuse,
                             self_distill_tokens=max(0, args.self_distill_tokens)))
    return 0


def run_info(args) -> int:
    from ..errors import RetrospecError
    from ..models import ZOO_DIR

    path = Path(args.dir) if args.dir else ZOO_DIR
    manifest = path / "zoo.json"
    if not manifest.is_file():
        raise RetrospecError(f"no zoo manifest at {manifest}")
    print(json.dumps(json.loads(manifest.read_text()), indent=2))
    return 0
