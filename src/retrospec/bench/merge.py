"""Merge bench runs done in parts (e.g. prompts 0-9, then 10-19) into one result, as if run together.

``python -m retrospec.bench.merge runs/a runs/b --out runs/ab``: the parts must agree on target, draft, methods,
sampling and lengths (``config``); their per-prompt runs are concatenated (prompt indices offset) and the summary
is recomputed by ``summary.summarize_prompts``, so every figure stays token-weighted over all prompts. Each part has its
own ``ar`` runs on its own prompts, so speedups compare like with like; the machine should be the same. Models are
compared by directory name (the same bundled draft may sit in another checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import RetrospecError
from .report import write_outputs
from .summary import summarize_prompts

MUST_AGREE = ("target", "draft", "chat", "methods", "max_new_tokens", "temperature", "top_p", "top_k", "gamma",
              "pld_k", "pld_max_ngram")


def merge(parts: list[dict]) -> dict:
    if len(parts) < 2:
        raise RetrospecError("give at least two bench result directories to merge")
    first = parts[0]["config"]
    def norm(key, value):  # models compare by directory name (a checkout elsewhere holds the same bundled draft)
        return Path(value).name if key in ("target", "draft") and value else value

    for p in parts[1:]:
        for key in MUST_AGREE:
            if norm(key, p["config"].get(key)) != norm(key, first.get(key)):
                raise RetrospecError(f"the parts differ in {key!r}: {first.get(key)!r} vs {p['config'].get(key)!r}")
    runs, offset = [], 0
    for p in parts:
        n = p["config"]["prompts"]
        runs += [r | {"prompt_index": r["prompt_index"] + offset} for r in p["runs"]]
        offset += n
    config = first | {"prompts": offset, "merged_from": [p["config"].get("date") for p in parts]}
    return {"config": config, "runs": runs, "summary": summarize_prompts(runs, greedy=first["temperature"] == 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retrospec.bench.merge", description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", help="bench output directories (each with results.json)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        parts = []
        for d in args.parts:
            f = Path(d) / "results.json"
            if not f.is_file():
                raise RetrospecError(f"no results.json in {d}")
            parts.append(json.loads(f.read_text()))
        result = merge(parts)
    except RetrospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_outputs(result, Path(args.out))
    from .report import print_table

    print_table(result["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
