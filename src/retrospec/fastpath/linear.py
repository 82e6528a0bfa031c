"""Prepacked small-M linear layers for CPU inference, and the head layouts the verifier chooses between.

Why: a verification forward multiplies every weight by T = 1..16 rows, where CPU BLAS ``F.linear`` can be far from
the memory floor and differs between CPUs (2-core AMD EPYC, AVX-512: SmolLM2-135M's decoder linears take 35 ms at
T = 1 and 51 ms at T = 2; oneDNN with a prepacked weight 21-25 ms at both), so ``fastpath.plan`` measures.

``PackedLinear`` multiplies by a weight reordered once by oneDNN (``mkldnn._reorder_linear_weight``, as inductor's
freezing pass does) through ``mkldnn._linear_pointwise``; over ``max_rows`` rows (a prefill) it takes ``F.linear``.
``KernelLinear`` multiplies by the weight as it is through ``kernels.f32`` (AVX-512 or AVX2 dot products, each row's
bits independent of how many rows share the call). ``head_logits`` computes ``hidden @ W.T`` in one of
``HEAD_LAYOUTS``.
All compute the same products (tested within tolerance, greedy identical). A bfloat16 packed copy is for drafts
only. Invariant: a ``PackedLinear`` or ``KernelLinear`` never owns or writes the caller's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels

HEAD_LAYOUTS = ("linear", "wht", "packed", "kernel")  # F.linear(h, W) | (W @ h.T).T | oneDNN prepacked | kernels.f32
PACK_HINT = 8  # the batch-size hint given to the reorder (measured: a hint of 8 serves 1..16 rows well)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a [out, in] weight (in ``dtype``, default the weight's), or None where the backend
    refuses this dtype/device."""
    if weight.device.type != "cpu" or not onednn_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype or weight.dtype), PACK_HINT)
    except (RuntimeError, NotImplementedError):
        return None


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., in] x packed [out, in] -> [..., out], in ``x``'s dtype (cast to the packed dtype and back if they
    differ; ``bias`` must be in the packed dtype)."""
    if x.dtype != packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "").to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_or_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor,
                    packed_bias: torch.Tensor | None, max_rows: int) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through ``packed``, or plain ``F.linear`` on ``weight`` for inputs of more than
    ``max_rows`` rows (a prompt) or of another dtype than the weight's."""
    if x.numel() > max_rows * weight.shape[1] or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return packed_matmul(x, packed, packed_bias)


class PackedLinear(torch.nn.Module):
    """A drop-in ``nn.Linear`` for the engine's private model copy (see ``fastpath.engine``)."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, max_rows: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared with the caller's module (a Parameter: no copy)
        self.bias = linear.bias
        self.packed = packed  # plain attribute, not a buffer: never saved, never moved by .to()
        # the bias in the packed dtype (a copy only when the packed dtype differs: a draft's bfloat16 copy)
        self.packed_bias = None if linear.bias is None else linear.bias.detach().to(packed.dtype)
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return packed_or_plain(x, self.weight, self.bias, self.packed, self.packed_bias, self.max_rows)


def kernel_available(weight: torch.Tensor | None = None) -> bool:
    """Whether ``kernels.f32`` is built here and (given a weight) can multiply by it: float32 on the CPU."""
    if weight is not None and (weight.dtype != torch.float32 or weight.device.type != "cpu"):
        return False
    return kernels.f32() is not None


def kernel_most_streamed() -> int:
    """The most rows a ``kernels.f32`` call can stream (4 with AVX-512, 2 with AVX2): ``kernel_streamed`` caps there."""
    return kernels.f32().most_streamed()


def kernel_streamed(rows: int) -> int:
    """Make ``kernels.f32`` compute calls of at most ``rows`` rows (0..4) output after output (one sequential stream
    per weight row) and larger calls in register blocks; the same bits either way, only the speed differs
    (``fastpath.plan`` measures it). Process-wide; returns the previous setting."""
    return kernels.f32().set_streamed(rows)


def kernel_prefetch(nbytes: int) -> int:
    """Make ``kernels.f32``'s register-blocked calls prefetch the weights ``nbytes`` ahead of their loads into L2 (0:
    no prefetching; streamed calls leave their one stream to the hardware); the same bits whatever the distance, only
    the speed differs (``fastpath.plan`` measures it). Process-wide; returns the previous setting."""
    return kernels.f32().set_prefetch(nbytes)


def kernel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., in] x [out, in] -> [..., out] through ``kernels.f32`` (float32 rows)."""
    y = torch.ops.retrospec.f32_mm(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class KernelLinear(torch.nn.Module):
    """A drop-in float32 ``nn.Linear`` through ``kernels.f32`` for the engine's private model copy."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared with the caller's module (no copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return kernel_matmul(x, self.weight, self.bias)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, layout: str,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] hidden x [V, H] weight -> [T, V] logits in the given layout (``packed`` needs the packed weight)."""
    if layout == "packed" and packed is not None:
        return packed_matmul(hidden, packed)
    if layout == "kernel":
        return kernel_matmul(hidden, weight)
    if layout == "wht":
        return (weight @ hidden.T).T  # [V, H] x [H, T], a transposed view back
    return F.linear(hidden, weight)
