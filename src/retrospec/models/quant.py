"""int8 storage for weights we save ourselves (LongSpec blocks, LoRA adapters): symmetric, one absmax scale per
output row. A storage format, not a compute format: ``unpack_int8`` restores floating point before anything runs.

``pack_int8(state)``, tensor by tensor:

- a floating tensor ``w`` with ``w.dim() >= 2`` (rows = ``w.shape[0]``; other dims flattened) becomes ``name`` ->
  int8 ``q`` plus ``name + ".int8_scale"`` -> bfloat16 ``s`` [rows], with ``s[i] = max|w[i]| / 127`` rounded *up*
  to bfloat16 and ``q = clamp(round(w / s), -127, 127)``; a row of zeros gets ``s = 1`` (no NaN);
- a floating tensor with ``dim() < 2`` (norm weights, biases) is stored as float16; any other tensor as is.

Why bfloat16 scales: 2 bytes, and float32's exponent range (float16 underflows for a LoRA ``B`` row of 1e-6, whose
scale is ~1e-8); rounding up costs < 0.8 % of the step and keeps every ``|w / s| <= 127`` (no clipping).

Error bound (the contract, tested): ``|unpack(pack(w)) - w| <= s[row] / 2`` per element (plus a few float32 ulps),
i.e. at most ``max|w[row]| / 254 * (1 + 2**-7)``; 1-D tensors: float16 rounding (relative 2**-11). Matrices take
~1/4 of their float32 bytes.

Invariants: ``pack_int8`` refuses non-finite values, 1-D values float16 cannot hold, and names that already end in
``.int8_scale``; ``unpack_int8`` refuses (one ``RetrospecError`` line) a scale without its int8 tensor, an int8
tensor without its scale, and a scale of the wrong shape, dtype or sign — the caller adds which file it was.
"""

from __future__ import annotations

import torch

from ..errors import RetrospecError

SCALE_SUFFIX = ".int8_scale"
QMAX = 127
# what a file records as its ``storage`` when its weights went through ``pack_int8``
INT8 = "int8"
INT8_DESCRIPTION = "int8, symmetric, one bfloat16 absmax scale per output row; 1-D tensors float16 (lossy)"
_FP16_MAX = torch.finfo(torch.float16).max


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= x (x float32, positive and finite)."""
    y = x.to(torch.bfloat16)
    low = y.float() < x
    if low.any():  # round-to-nearest went down: step to the next bfloat16 (same sign, so +1 on the bit pattern)
        bits = y.view(torch.int16)
        y = torch.where(low, (bits + 1).view(torch.bfloat16), y)
    return y


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q of ``w``'s shape, bfloat16 scale [rows]) for a floating tensor with dim >= 2."""
    flat = w.detach().float().reshape(w.shape[0], -1)  # [rows, cols]
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(flat.shape[0])  # [rows]
    scale = _round_up_bf16(torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)))  # [rows]
    q = torch.round(flat / scale.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)  # [rows, cols]
    return q.reshape(w.shape), scale


def pack_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` for int8 storage (see the module docstring). The input is not modified."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(SCALE_SUFFIX):
            raise RetrospecError(f"cannot pack {name!r} to int8: names ending in {SCALE_SUFFIX!r} are reserved")
        w = w.detach().cpu()
        if not w.is_floating_point():
            out[name] = w.contiguous()
            continue
        if not bool(torch.isfinite(w).all()):
            raise RetrospecError(f"cannot pack {name!r} to int8: it holds NaN or infinite values")
        if w.dim() >= 2 and w.shape[0] > 0:
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(w)
        else:
            if w.numel() and float(w.float().abs().max()) > _FP16_MAX:
                raise RetrospecError(f"cannot store {name!r} in float16: values beyond {_FP16_MAX:.0f}")
            out[name] = w.to(torch.float16).contiguous()
    return out


def unpack_int8(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Invert ``pack_int8``: every int8 tensor times its row scale, every other floating tensor cast to ``dtype``
    (dequantisation itself runs in float32, then is rounded once to ``dtype``); integer tensors are kept."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base not in state:
                raise RetrospecError(f"int8 scale {name!r} has no tensor {base!r}")
            if state[base].dtype != torch.int8:
                raise RetrospecError(f"{name!r} scales {base!r}, which is {state[base].dtype}, not int8")
        elif t.dtype == torch.int8:
            s = state.get(name + SCALE_SUFFIX)
            if s is None:
                raise RetrospecError(f"int8 tensor {name!r} has no scale {name + SCALE_SUFFIX!r}")
            if not s.is_floating_point() or s.dim() != 1 or t.dim() < 2 or s.shape[0] != t.shape[0]:
                raise RetrospecError(f"int8 scale {name + SCALE_SUFFIX!r} has shape {list(s.shape)} ({s.dtype}); "
                                     f"expected one floating value per row of {name!r} {list(t.shape)}")
            if not bool((torch.isfinite(s) & (s > 0)).all()):
                raise RetrospecError(f"int8 scale {name + SCALE_SUFFIX!r} holds zero, negative or non-finite values")
            flat = t.float().reshape(t.shape[0], -1) * s.float()[:, None]  # [rows, cols]
            out[name] = flat.reshape(t.shape).to(dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def is_packed(state: dict[str, torch.Tensor]) -> bool:
    """True when ``state`` holds int8 tensors or int8 scales (it needs ``unpack_int8`` before use)."""
    return any(k.endswith(SCALE_SUFFIX) or v.dtype == torch.int8 for k, v in state.items())


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``|a[k] - b[k]|`` over the floating tensors two state dicts share (in float32)."""
    return max((float((v.float() - b[k].float()).abs().max()) for k, v in a.items()
                if k in b and v.is_floating_point() and b[k].is_floating_point() and v.numel()), default=0.0)
