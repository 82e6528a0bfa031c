"""Weight-only quantized formats, run natively: a step reads the compressed weights, not a float copy.

Formats (``load_model(..., dtype=...)``, ``--dtype`` on every command that loads a model):

- ``int8``: every linear layer of the decoder and the output head as int8 with one bfloat16 scale per output row
  (symmetric, round to nearest), computed by ``torch.ops.aten._weight_int8pack_mm``;
- ``int4``: the same layers as 4-bit integers in groups of ``GROUP`` (32) along the input, each group with a
  bfloat16 scale and zero (``w = (q - 8) * scale + zero``, ``q`` in 0..15, round to nearest from the group's min and
  max), computed by ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

Both kernels take bfloat16 activations: a layer casts its float32 input to bfloat16 and its output back. Norms,
attention, rotary embeddings and the embedding lookup stay float32. Each format is a model of its own, and the
identity of a quantized model is that of its float32 source (``identity.derive``), so artefacts built for the source
(LongSpec blocks, datastores, drafts) load on it.

Row invariance: both kernels compute each output row from that row alone, in the same order whatever the number of
rows (tested bitwise by ``row_invariant``). Attention is made so too: the engine measures its matmuls row-invariant
(``fastpath.rows``) and then runs each verified row's attention alone, as a one-token step does
(``prefix_block.ROW_EXACT``), so a k-token verification's logits are bitwise those of k one-token steps and every
lossless method is token-identical to ``ar`` in the same format, near-ties included. (Without that, float32
attention over a block and over one token differ by ~1e-7, and the cast to bfloat16 before the next matmul can turn
that into a one-ulp activation change and a flipped near-tie.)

Why these kernels: they are PyTorch's own CPU weight-only paths (the ones torchao's CPU layouts call), so nothing
is hand-written here but the packing of the weights they expect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import RetrospecError

GROUP = 32  # int4: input features per scale/zero group (GGUF's Q4_0/Q4_1 block size)
INNER_K_TILES = 2  # the int4 packing's K tiling (the CPU kernel accepts 2, 4 or 8)
FORMATS = {
    "int8": "int8 weight-only: int8 weights, one bfloat16 scale per output row; bfloat16 activations in the matmuls",
    "int4": f"int4 weight-only: 4-bit weights in groups of {GROUP} with bfloat16 scale and zero; bfloat16 "
            "activations in the matmuls",
}


def available(fmt: str) -> bool:
    """Whether this torch build has the CPU kernel of ``fmt``."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int8pack_mm") if fmt == "int8" else (
        hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu"))


class WeightOnlyLinear(torch.nn.Module):
    """A linear layer whose weight is held quantized (``int8`` or ``int4``); float input and output."""

    def __init__(self, fmt: str, in_features: int, out_features: int, qweight: torch.Tensor,
                 scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("qweight", qweight)  # int8 [out, in] | int4 packed (uint8, the kernel's layout)
        self.register_buffer("scales", scales)  # int8: bf16 [out] | int4: bf16 [in / GROUP, out, 2] (scale, zero)
        self.register_buffer("bias", bias)  # float [out] or None
        self._weight: torch.Tensor | None = None  # ``weight``'s cache (not a buffer: never saved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, in]
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)  # [M, out] bf16
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out, in], built on first use and kept (for code that reads rows of a
        head, e.g. a draft's vocabulary; the forward never uses it)."""
        if self._weight is None:
            self._weight = self.dequantized()
        return self._weight

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer computes with (for tests and references)."""
        if self.fmt == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # each basis row picks one input column
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP, self.scales)  # [in, out] bf16
        return cols.float().t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str) -> "WeightOnlyLinear":
        w = linear.weight.detach().float()  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if fmt == "int8":
            q, s = quantize_int8(w)
        else:
            q, s = quantize_int4(w)
        return cls(fmt, linear.in_features, linear.out_features, q, s, bias)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bfloat16 scales [out]): symmetric, round to nearest."""
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)  # [out]
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed int4, bfloat16 [in / GROUP, out, 2] scale and zero), asymmetric per group."""
    out, inp = w.shape
    if inp % GROUP or out % 16:
        raise RetrospecError(f"int4 needs input features divisible by {GROUP} and output features by 16; a layer "
                             f"has {inp} -> {out}")
    g = w.reshape(out, inp // GROUP, GROUP)  # [out, G, 32]
    lo, hi = g.amin(dim=2), g.amax(dim=2)  # [out, G]
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)  # w = (q - 8) * scale + zero; q = 0 at the minimum
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return pack_int4(q.reshape(out, inp).to(torch.int32), scale, zero)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scale/zero [out, in / GROUP]) -> the CPU kernel's packed weight and
    [in / GROUP, out, 2] bfloat16 scales-and-zeros."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    sz = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=-1).transpose(0, 1).contiguous()
    return packed, sz


def quantize_model_(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model``'s decoder and its output head by a ``WeightOnlyLinear``
    of format ``fmt``. Only for a model this library loaded itself (``load_model``): a caller's model is never
    changed. The input embedding stays float (a tied head gets its own quantized copy)."""
    if fmt not in FORMATS:
        raise RetrospecError(f"unknown weight-only format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not available(fmt):
        raise RetrospecError(f"this torch build has no CPU kernel for {fmt} weight-only matmuls")
    if next(model.parameters()).device.type != "cpu":
        raise RetrospecError(f"{fmt} weight-only formats run on the CPU")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    with torch.no_grad():
        for parent in list(decoder.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, WeightOnlyLinear.from_linear(child, fmt))
        head = model.get_output_embeddings()
        if type(head) is torch.nn.Linear:
            quantized = WeightOnlyLinear.from_linear(head, fmt)
            model.config.tie_word_embeddings = False  # the head is no longer the embedding's tensor
            _set_head(model, quantized)
    return model


def matmul_bytes(shapes: list[tuple[int, int]], fmt: str) -> int:
    """Bytes a forward reads for linear layers of (out, in) ``shapes`` stored in ``fmt``: float32 4 per weight,
    bfloat16/float16 2; int8 1 plus a 2-byte scale per output row; int4 half a byte plus a 2-byte scale and zero per
    group of ``GROUP`` inputs."""
    per = {"float32": lambda o, i: 4 * o * i, "bfloat16": lambda o, i: 2 * o * i, "float16": lambda o, i: 2 * o * i,
           "int8": lambda o, i: o * i + 2 * o, "int4": lambda o, i: o * i // 2 + 4 * o * (i // GROUP)}[fmt]
    return sum(per(o, i) for o, i in shapes)


FORMAT_ATTR = "_retrospec_weight_format"  # set on a model whose layers were built from a file's own blocks ("gguf")


def format_of(model: torch.nn.Module) -> str | None:
    """The weight-only format of a model ``quantize_model_`` converted (``int8`` / ``int4``) or one built from a
    GGUF file's blocks (``gguf``: ``models.gguf_native``), else None."""
    if getattr(model, FORMAT_ATTR, None):
        return getattr(model, FORMAT_ATTR)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.fmt if isinstance(head, WeightOnlyLinear) else None


def _set_head(model: torch.nn.Module, head: torch.nn.Module) -> None:
    for name, child in model.named_children():
        if child is model.get_output_embeddings():
            setattr(model, name, head)
            return
    raise RetrospecError(f"cannot find the output head of {type(model).__name__}")


def reference_forward(layer: WeightOnlyLinear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer`` computes, in float32 from its dequantized weight (bfloat16-rounded input)."""
    return F.linear(x.to(torch.bfloat16).float(), layer.dequantized(), layer.bias)


def row_invariant(layer: WeightOnlyLinear, rows: int = 8, seed: int = 0) -> bool:
    """Whether a ``rows``-row call of ``layer`` gives bit for bit the rows of ``rows`` one-row calls."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layer.in_features, generator=gen)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    return torch.equal(together, alone)
