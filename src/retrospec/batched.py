"""Batched generation: several prompts decoded together with one KV cache (plain decoding, not the speculative loop).

Users: Speculative RAG drafts m answers in parallel, one per document subset (Wang et al., ICLR 2025, §3.3), and
``corpus`` writes a corpus of the target's own outputs, many sequences per forward.

Layout: prompts are **left-padded** to one length ``L``; ``attention_mask`` hides the pads and ``position_ids`` count
only real tokens (``cumsum(mask) - 1``), so every row sees what it would see alone. A row stops at an EOS id, when
``stop(row_ids)`` says so, or at ``max_new_tokens``; finished rows leave the batch (``batch_select_indices``).
Sampling draws each row from ``probs_from_logits`` of its own logits through one ``torch.Generator`` (a seed fixes
the batch's output), by the inverse CDF (``sampling.draw_rows``: one uniform per row crosses to the device, not the
[b, V] probabilities).

Invariants (tested): greedy rows equal one-at-a-time greedy decoding (``decode.autoregressive_generate``);
``logprobs[i][t]`` is the raw (untempered) log-softmax at the step that produced ``tokens[i][t]``. One host sync per
step. The batch runs on the engine's private copy (transformers' attention, linears prepacked where it pays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .config import SamplingConfig
from .errors import RetrospecError
from .fastpath import engine_for
from .sampling import draw_rows, probs_from_logits


@dataclass
class BatchOutput:
    tokens: list[list[int]]  # generated ids per row (the stopping EOS id included, when one was produced)
    logprobs: list[list[float]]  # raw log p of each generated token
    steps: int  # forward passes after the prefill


@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   eos_ids: frozenset[int] = frozenset(), pad_id: int = 0,
                   stop: Callable[[list[int]], bool] | None = None, sampling: SamplingConfig | None = None,
                   generator: torch.Generator | None = None) -> BatchOutput:
    """Decode every prompt of ``prompts`` together, greedy (default) or sampled; see the module docstring."""
    sampling = sampling or SamplingConfig()
    model = engine_for(model, attention="sdpa").module  # prepacked linears where they pay; the same attention
    if not prompts or any(len(p) == 0 for p in prompts):
        raise RetrospecError("batched generation needs non-empty prompts")
    if max_new_tokens < 1:
        raise RetrospecError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)  # [n, L]
    mask = torch.zeros((n, width), dtype=torch.long, device=device)  # [n, L]
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, L]
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1]  # [n, V]
    next_pos = positions[:, -1] + 1  # [n]
    live = list(range(n))  # row of the batch -> prompt index
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    steps = 0
    while True:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
        if sampling.greedy:
            best = logp.argmax(dim=-1)  # [b]
        else:
            best = draw_rows(probs_from_logits(logits, sampling), generator)  # [b]
        picked = logp.gather(-1, best[:, None])[:, 0]  # [b]
        keep = []
        best_list, picked_list = torch.stack([best.double(), picked.double()]).tolist()  # one host sync per step
        for b, row in enumerate(live):
            t = int(best_list[b])
            tokens[row].append(t)
            logprobs[row].append(picked_list[b])
            if not (t in eos_ids or len(tokens[row]) >= max_new_tokens or (stop is not None and stop(tokens[row]))):
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, next_pos, best = mask[index], next_pos[index], best[index]
            live = [live[b] for b in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)  # [b, L + t]
        out = model(input_ids=best[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
        steps += 1
    return BatchOutput(tokens, logprobs, steps)


greedy_batch = generate_batch  # greedy unless given a sampling config
