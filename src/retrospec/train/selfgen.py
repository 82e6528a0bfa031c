"""Sequence-level distillation data: the target's own continuations of training-corpus prefixes.

At inference the draft must predict what the *target* writes (a small model's greedy output is more repetitive
than human code), so the draft is distilled partly on text the target generated. Prefixes come only from the
training split; benchmark and held-out prompts are never used. Half the sequences are greedy (what greedy
speculative decoding sees), half sampled at temperature 0.8 (diversity, and what sampling sees).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm


@torch.inference_mode()
def generate_stream(target: torch.nn.Module, corpus: np.ndarray, n_tokens: int, *, eos_id: int, pad_id: int,
                    prefix_len: int = 64, gen_len: int = 192, batch_size: int = 32, seed: int = 0) -> np.ndarray:
    """About ``n_tokens`` tokens of prefix + target continuation, sequences separated by EOS. 1-D, corpus dtype."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    out: list[np.ndarray] = []
    total = 0
    bar = tqdm(total=n_tokens, desc="self-generation", unit="tok", dynamic_ncols=True)
    i = 0
    while total < n_tokens:
        starts = rng.integers(0, len(corpus) - prefix_len, size=batch_size)
        prefixes = torch.from_numpy(np.stack([corpus[s : s + prefix_len] for s in starts]).astype(np.int64))
        greedy = i % 2 == 0
        seqs = target.generate(input_ids=prefixes, attention_mask=torch.ones_like(prefixes),
                               max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=not greedy,
                               temperature=None if greedy else 0.8, top_k=None, top_p=None,
                               pad_token_id=pad_id, eos_token_id=None)
        for row in seqs.numpy():
            out.append(np.append(row, eos_id).astype(corpus.dtype))
            total += len(row) + 1
        bar.update(seqs.numel())
        i += 1
    bar.close()
    return np.concatenate(out)
