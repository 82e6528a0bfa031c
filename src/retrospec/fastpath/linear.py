"""Prepacked small-M linear layers for CPU inference, and the head layouts the verifier chooses between.

Why: a verification forward multiplies every weight matrix by T = 1..16 rows. On CPU the default BLAS path for
``F.linear`` at small M can be far from the memory floor and differ wildly between CPUs (measured on a 2-core AMD
EPYC with AVX-512: 35 ms for SmolLM2-135M's decoder linears at T = 1 and 51 ms at T = 2, where oneDNN with a
prepacked weight takes 21-25 ms at both). Which one wins is machine-specific, so ``fastpath.plan`` measures it.

What: ``PackedLinear`` holds a weight reordered once by PyTorch's oneDNN backend (``mkldnn._reorder_linear_weight``,
the op inductor's freezing pass emits for CPU linears) and multiplies through ``mkldnn._linear_pointwise``; inputs
with more rows than ``max_rows`` (a prompt's prefill) go to plain ``F.linear`` on the shared original weight.
``head_logits`` computes ``hidden @ W.T`` in one of ``HEAD_LAYOUTS``. All layouts compute the same products; only
the order of float summation differs (tested within float tolerance, greedy identical).

A packed copy may be in another dtype than the weight (``pack_weight(w, torch.bfloat16)``): drafts only, see
``fastpath.draft``. Its inputs are cast in and its outputs back, so activations keep the weight's dtype.

Invariant: a ``PackedLinear`` never owns the caller's weight: it keeps a reference (for the fallback and for
``weight.dtype`` readers) plus its own packed copy; nothing is written to the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEAD_LAYOUTS = ("linear", "wht", "packed")  # F.linear(h, W) | (W @ h.T).T | oneDNN prepacked
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

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, packed rows<={self.max_rows}, "
                f"packed dtype={self.packed.dtype}")


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, layout: str,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] hidden x [V, H] weight -> [T, V] logits in the given layout (``packed`` needs the packed weight)."""
    if layout == "packed" and packed is not None:
        return packed_matmul(hidden, packed)
    if layout == "wht":
        return (weight @ hidden.T).T  # [V, H] x [H, T], a transposed view back
    return F.linear(hidden, weight)
