"""Teacher-forced span scores for Speculative RAG (Wang et al., ICLR 2025, §3.4).

``span_logprobs`` runs one forward per text (right-padded batches) and returns, for each requested character span,
the sum of log p(token | everything before it) over the tokens that cover the span (0 for an empty span). Tokens
are mapped to spans through the tokenizer's offsets, so a span starting mid-token (``" Yes"`` after a space) is
scored by the token that carries it; the first token of a text has no left context and is never scored.

The three scores of a draft (α answer, β rationale; the paper multiplies probabilities, so we add logs):

- ``log ρ_draft = log P_drafter(β | Q, δ) + log P_drafter(α | Q, δ, β)`` — from the log-softmax of each
  generated token kept by ``batched.greedy_batch`` (exactly the teacher-forced value; ``drafter_rescore=True``
  re-runs a teacher-forced forward);
- ``log ρ_SC = log P_verifier(α, β | Q)``: self-consistency, the α and β spans of ``prompts.verifier_text``;
- ``log ρ_SR = log P_verifier("Yes" | Q, α, β, R)``: self-reflection, the "Yes" span.

Invariant (tested against a hand-computed forward on a tiny model): the value of a span is
``sum_t log_softmax(logits[t - 1])[ids[t]]`` over exactly the tokens whose offsets overlap it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import RetrospecError

Span = tuple[int, int]


def token_spans(offsets: Sequence[tuple[int, int]], span: Span) -> list[int]:
    """Indices of the tokens whose character range overlaps ``span`` (token 0 excluded: it has no context)."""
    lo, hi = span
    return [t for t, (s, e) in enumerate(offsets) if t > 0 and s < hi and e > lo and e > s]


@torch.no_grad()
def span_logprobs(model, tokenizer, texts: Sequence[str], spans: Sequence[Sequence[Span]],
                  batch_size: int = 8) -> np.ndarray:
    """``[len(texts), n_spans]`` float64: summed log-probabilities of each span (see the module docstring)."""
    if len(texts) != len(spans):
        raise RetrospecError("one list of spans per text")
    if not getattr(tokenizer, "is_fast", False):
        raise RetrospecError("scoring needs a fast tokenizer (character offsets)")
    n_spans = len(spans[0]) if spans else 0
    result = np.zeros((len(texts), n_spans), dtype=np.float64)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(texts), batch_size):
        chunk = list(range(start, min(len(texts), start + batch_size)))
        encs = [tokenizer(texts[i], add_special_tokens=False, return_offsets_mapping=True) for i in chunk]
        rows = [torch.tensor(e["input_ids"], dtype=torch.long) for e in encs]
        ids = pad_sequence(rows, batch_first=True, padding_value=pad).to(device)  # [b, T]
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True).to(device)  # [b, T]
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [b, T, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # [b, T - 1]
        logp = logp.double().cpu().numpy()
        for r, i in enumerate(chunk):
            offsets = encs[r]["offset_mapping"]
            for s, span in enumerate(spans[i]):
                if span[1] <= span[0]:  # an empty rationale or answer: nothing to score
                    continue
                covered = token_spans(offsets, span)
                if not covered:
                    raise RetrospecError(f"span {span} of a scored text covers no token")
                result[i, s] = float(sum(logp[r, t - 1] for t in covered))
    return result


def token_logprob_sum(logprobs: Sequence[float], offsets: Sequence[tuple[int, int]], span: Span) -> float:
    """Sum of per-token log-probs (one per token of a generated text, with its offsets) over the tokens overlapping
    ``span``; unlike ``token_spans`` the first token counts (a generated token always has context)."""
    lo, hi = span
    return float(sum(lp for lp, (s, e) in zip(logprobs, offsets) if s < hi and e > lo))
