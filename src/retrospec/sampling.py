"""Turning logits into the distribution that decoding samples from, and the seeded generator it samples with.

``probs_from_logits`` applies temperature, then top-k, then top-p, as Hugging Face's default processors do.
Speculative decoding is lossless with respect to *this processed* distribution (p and q get the same knobs).
Invariant: every random draw goes through the ``torch.Generator`` of ``make_generator``, so a seed fixes the output.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities. Greedy (temperature 0) gives one-hot argmax rows."""
    logits = logits.float()
    if cfg.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # shifted so the largest logit is 0 before dividing: the same softmax, and a tiny temperature sends the others
    # to -inf (one-hot on the argmax) instead of overflowing them to +inf (inf - inf: NaN); a temperature below
    # float32's smallest normal number (which would round to 0, and 0 / 0 is NaN) divides as that number
    top = logits.amax(-1, keepdim=True)  # [..., 1]
    logits = (logits - top.masked_fill(top.isinf(), 0.0)) / max(cfg.temperature, torch.finfo(logits.dtype).tiny)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (always keeps the top token)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= cfg.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest number would otherwise drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)``, [..., V] -> [..., 1] on ``probs``' device, drawn on the
    generator's device (the decode loop's generator is a CPU one: CUDA probabilities are drawn from on the CPU, so a
    seed gives the same tokens on every device)."""
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)


def draw_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [b, V] -> [b] by the inverse CDF: one uniform per row from ``generator`` (on
    its own device, so a seed gives the same uniforms everywhere), the token found where it falls in the row's
    cumulative sum (float64, on ``probs``' device). A token of probability 0 is never drawn.

    For batches: ``torch.multinomial`` on a CPU generator would first copy ``probs`` to the CPU and walk [b, V] there
    (seconds a step at b = 1536, V = 49,152); this moves b numbers instead."""
    cdf = probs.double().cumsum(-1)  # [b, V]
    u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64,
                   device=generator.device if generator is not None else probs.device)  # [b]
    total = cdf[:, -1:]  # [b, 1]
    at = torch.minimum(u.to(probs.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    picked = torch.searchsorted(cdf, at, right=True)[:, 0]  # [b]: first index whose cdf exceeds u * total
    return picked.clamp_(max=probs.shape[-1] - 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
