"""Our proposers inside vLLM change nothing but speed: greedy outputs equal plain vLLM's, prompt for prompt.

Run in the vLLM peer's virtualenv (``make peers-test``; retrospec installed there by ``make peers-vllm``)::

    .venv-peers-vllm/bin/python -m tools.peers.vllm_exactness --model DIR [--prompts 24] [--max-new-tokens 64] \
        [--proposers PromptLookupProposer,ServedOutputProposer]

Engines on the same checkpoint (float32, prefix caching off): plain, then one per proposer class of
``retrospec.integrations.vllm_proposer`` as vLLM's ``custom_class`` proposer (the served-output store fills as the
prompts go by, so later prompts draft from earlier answers). Prompts: held-out
stdlib functions and chat questions (the bench's ``heldout`` and ``chat-tasks`` presets, as token ids through the
model's tokenizer and chat template). Prints one line per prompt and a summary; exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tools.peers.common import engine, private_stdout


def _prompts(model: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from retrospec.tasks import preset

    tok = AutoTokenizer.from_pretrained(model)
    code = [row["prompt"] for row in preset("heldout", (n + 1) // 2)]
    chat = [row["prompt"] for row in preset("chat-tasks", n // 2)]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in code]
    ids += [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in chat]
    return ids


def _run(llm, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, detokenize=False)
    out, seconds = [], 0.0
    for ids in prompts:  # one request at a time, as the bench's batch-1 rows
        t0 = time.perf_counter()
        got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        out.append(list(got[0].outputs[0].token_ids))
    return out, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. retrospec's smollm2-135m)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=10, help="num_speculative_tokens")
    p.add_argument("--proposers", default="PromptLookupProposer,ServedOutputProposer",
                   help="comma-separated classes of retrospec.integrations.vllm_proposer (RestProposer needs "
                        "RETROSPEC_DATASTORE)")
    args = p.parse_args(argv)
    out, threads = private_stdout()
    prompts = _prompts(args.model, args.prompts)
    plain = engine(args.model, None)
    want, plain_s = _run(plain, prompts, args.max_new_tokens)
    del plain
    tokens = sum(map(len, want))
    summary = {"prompts": len(prompts), "new_tokens": tokens, "plain_tok_s": round(tokens / plain_s, 1), "k": args.k,
               "max_new_tokens": args.max_new_tokens, "threads": threads}
    all_same = True
    for name in args.proposers.split(","):
        ours = engine(args.model, {"method": "custom_class", "num_speculative_tokens": args.k,
                                    "model": f"retrospec.integrations.vllm_proposer.{name}"})
        got, ours_s = _run(ours, prompts, args.max_new_tokens)
        del ours
        same = [a == b for a, b in zip(want, got, strict=True)]
        for i, (ok, ids) in enumerate(zip(same, prompts, strict=True)):
            print(f"{name} prompt {i:2d}: {len(ids):4d} prompt tokens, {len(want[i]):3d} new, identical: "
                  f"{'yes' if ok else 'NO'}", file=out)
        summary[name] = {"identical": sum(same), "tok_s": round(tokens / ours_s, 1)}
        all_same &= all(same)
    print(json.dumps(summary), file=out)
    out.flush()
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
