"""A repeated workload inside vLLM: MBPP problems, each asked in three phrasings, served one at a time in random order.

Run in the vLLM peer's virtualenv (``make peers-repeated``)::

    .venv-peers-vllm/bin/python -m tools.peers.vllm_repeated --model DIR --mbpp FILE [--problems 40] \\
        [--max-new-tokens 64] [--proposers ServedOutputProposer,PromptLookupProposer] [--plain]

Each problem is asked as three chat requests, its task sentence worded three ways; the 3 x N requests go in one
seeded random order. One engine per proposer class of
``retrospec.integrations.vllm_proposer`` (float32, prefix caching off, greedy); the proposer's stats file gives each
request's target forwards, so τ = tokens after the first / forwards after the first. The table groups requests by
the time their problem is asked (first, second, third): the served-output store can only help from the second on.
``--plain`` also runs plain vLLM for the tokens/s baseline and checks every output identical to it. ``vllm-suffix``
among the proposers is vLLM's own suffix decoding (``"method": "suffix"``, Arctic Inference's suffix trees over the
request and earlier outputs; needs ``arctic-inference``, skipped with a note without it): its forwards come from
vLLM's accepted-token counter, read after each request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from tools.peers.common import engine, private_stdout


DOCSTRING = "'" * 3


def _phrasings(mbpp: Path, n: int) -> list[tuple[int, str]]:
    """(problem, chat message) three times for each of the first n problems: MBPP's task sentence worded three ways,
    each naming the function its tests call."""
    out = []
    for i, line in enumerate(mbpp.read_text().splitlines()[:n]):
        row = json.loads(line)
        parts = row["prompt"].split(DOCSTRING)  # MBPP's prompt: a signature, then the task in a docstring
        desc = (parts[1] if len(parts) > 2 else row["prompt"]).strip()
        name = row["entry_point"]
        out += [(i, f"{desc} The function should be called `{name}`."),
                (i, f"Please write `{name}` in Python: {desc[:1].lower()}{desc[1:]}"),
                (i, f"Task: {desc}\nFunction name: {name}")]
    return out


def _ids(model: str, requests: list[tuple[int, str]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for _, text in requests]


SUFFIX = "vllm-suffix"


def _accepted(llm) -> int:
    """vLLM's count of accepted draft tokens so far (its metrics; needs the engine built with stats)."""
    return int(next((m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"), 0))


def counter_stats(outs: list[list[int]], accepted: list[int]) -> list[dict]:
    """Per request, the target forwards (prefill included: ``steps``, as our proposers' stats count them) from its
    output length and accepted draft tokens: each step after the prefill yields its accepted drafts + 1 tokens."""
    return [{"steps": len(o) - a} for o, a in zip(outs, accepted, strict=True)]


def _serve(llm, prompts: list[list[int]], max_new: int, counted: list[int] | None = None
           ) -> tuple[list[list[int]], float]:
    """Outputs, one request at a time, and the seconds they took; then one short request so that the proposer sees
    the last one leave (it writes a request's stats when the request is gone). ``counted``: filled with each
    request's accepted draft tokens from vLLM's counter."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, detokenize=False)
    outs, seconds = [], 0.0
    before = _accepted(llm) if counted is not None else 0
    for ids in prompts:
        t0 = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        outs.append(list(got[0].outputs[0].token_ids))
        if counted is not None:
            now = _accepted(llm)
            counted.append(now - before)
            before = now
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    return outs, seconds


def _tau(outs: list[list[int]], stats: list[dict], occurrence: list[int]) -> dict[str, float]:
    """τ per occurrence (1st, 2nd, 3rd asking of a problem): tokens after the first / target forwards after the
    first, pooled over the requests of that occurrence."""
    table = {}
    for occ in (1, 2, 3):
        pick = [i for i, o in enumerate(occurrence) if o == occ]
        tokens = sum(len(outs[i]) - 1 for i in pick)
        forwards = sum(max(stats[i]["steps"] - 1, 0) for i in pick)
        table[f"tau_{occ}"] = round(tokens / forwards, 2) if forwards else 0.0
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. retrospec's smollm2-135m)")
    p.add_argument("--mbpp", required=True, type=Path, help="MBPP jsonl (task_id, prompt, entry_point)")
    p.add_argument("--problems", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=10, help="num_speculative_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the serving order")
    p.add_argument("--proposers", default="ServedOutputProposer,PromptLookupProposer")
    p.add_argument("--plain", action="store_true", help="also plain vLLM: tokens/s baseline and output identity")
    args = p.parse_args(argv)
    out, threads = private_stdout()
    requests = _phrasings(args.mbpp, args.problems)
    random.Random(args.seed).shuffle(requests)
    seen: dict[int, int] = {}
    occurrence = []
    for problem, _ in requests:
        seen[problem] = seen.get(problem, 0) + 1
        occurrence.append(seen[problem])
    prompts = _ids(args.model, requests)
    summary: dict = {"requests": len(prompts), "problems": args.problems, "max_new_tokens": args.max_new_tokens,
                     "k": args.k, "threads": threads, "seed": args.seed}
    want = None
    if args.plain:
        llm = engine(args.model, None)
        want, seconds = _serve(llm, prompts, args.max_new_tokens)
        del llm
        summary["plain"] = {"tok_s": round(sum(map(len, want)) / seconds, 1)}
    same_all = True
    for name in args.proposers.split(","):
        if name == SUFFIX:
            try:
                import arctic_inference  # noqa: F401  (vLLM's suffix method imports it)
            except ImportError:
                print(f"{SUFFIX}: skipped (arctic-inference is not installed in this environment)", file=out)
                continue
            llm = engine(args.model, {"method": "suffix", "num_speculative_tokens": args.k}, stats=True)
            counted: list[int] = []
            outs, seconds = _serve(llm, prompts, args.max_new_tokens, counted)
            del llm
            stats = counter_stats(outs, counted)
        else:
            outs, seconds, stats = _ours(args, name, prompts)
        row = {"tok_s": round(sum(map(len, outs)) / seconds, 1)} | _tau(outs, stats, occurrence)
        if want is not None:
            row["identical"] = sum(a == b for a, b in zip(want, outs, strict=True))
            same_all &= row["identical"] == len(prompts)
        summary[name] = row
        print(f"{name}: {row}", file=out)
        out.flush()
    print(json.dumps(summary), file=out)
    out.flush()
    return 0 if same_all else 1


def _ours(args, name: str, prompts: list[list[int]]) -> tuple[list[list[int]], float, list[dict]]:
    """One of our proposer classes inside vLLM: outputs, seconds, and its per-request stats."""
    with tempfile.TemporaryDirectory() as tmp:
        stats_file = Path(tmp) / "stats.jsonl"
        os.environ["RETROSPEC_PROPOSER_STATS"] = str(stats_file)
        llm = engine(args.model, {"method": "custom_class", "num_speculative_tokens": args.k,
                                   "model": f"retrospec.integrations.vllm_proposer.{name}"})
        outs, seconds = _serve(llm, prompts, args.max_new_tokens)
        del llm
        stats = [json.loads(line) for line in stats_file.read_text().splitlines()][: len(prompts)]
    return outs, seconds, stats


if __name__ == "__main__":
    sys.exit(main())
