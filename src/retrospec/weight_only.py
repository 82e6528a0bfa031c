"""Weight-only quantized formats, run natively: a step reads the compressed weights, not a float copy.

Formats (``load_model(..., dtype=...)``, ``--dtype`` on every command that loads a model):

- ``int8``: every linear layer of the decoder and the output head as int8 with one bfloat16 scale per output row
  (symmetric, round to nearest), computed by ``torch.ops.aten._weight_int8pack_mm``;
- ``int4``: the same layers as 4-bit integers in groups of ``GROUP`` (32) along the input, each group with a
  bfloat16 scale and zero (``w = (q - 8) * scale + zero``, ``q`` in 0..15, round to nearest from the group's min and
  max), computed by ``torch.ops.aten._weight_int4pack_mm_for_cpu``;
- ``w8a8``: the ``int8`` weights, and each activation row quantized to int8 as it enters a layer (symmetric, one
  float32 scale per row: its largest magnitude / 127, round to nearest), multiplied in integers (fbgemm's prepacked
  kernels, else ``torch._int_mm``; int32 sums, exact) and scaled back in float32 (``sum * weight scale * row
  scale``). The integer matmul's cost grows slowly with the row count (a 16-token verification ~2x a one-token step
  on a 2-core Xeon, where the two kernels above cost ~5x), so long drafts and trees verify cheaply; its one-token
  step may cost more than ``int4``'s. Like llama.cpp's Q8_0 path, which also quantizes activations to 8 bits (there
  per block of 32), it is lossier than ``int8``;
- ``w4a8``: the ``int4`` weights, and each activation row quantized to int8 per group of ``GROUP`` inputs as it
  enters a layer (symmetric, one float32 step per group: its largest magnitude / 127, round to nearest), multiplied
  with integer dot products (``kernels/w4a8.cpp``: AVX-512 VNNI; int32 sums per group, exact) and scaled back in
  float32 (``scale * step * (sum - 8 * sum of the activation integers) + zero * step * that sum``, group by group):
  the computation llama.cpp runs its Q4_1 files with (4-bit weights with a scale and minimum per 32, times 8-bit
  activation blocks of 32). A one-token step reads what ``int4`` reads with far less arithmetic, and a 5-token
  verification costs ~1.4x one where ``int4``'s float kernel costs ~2.2x. Needs a CPU with AVX-512 VNNI and a C++
  compiler (the kernel is built once per machine: ``kernels``).

``int8`` and ``int4`` take bfloat16 activations: a layer casts its float32 input to bfloat16 and its output back.
Norms, attention, rotary embeddings and the embedding lookup stay float32 in every format. Each format is a model of
its own, and the identity of a quantized model is that of its float32 source (``identity.derive``), so artefacts
built for the source (LongSpec blocks, datastores, drafts) load on it.

Row invariance: every format computes each output row from that row alone, in the same order whatever the number of
rows (tested bitwise by ``row_invariant``; ``w8a8`` and ``w4a8`` by construction too: a row's scales are its own and
integer sums do not depend on their order). Attention is made so too: the engine measures its matmuls row-invariant
(``fastpath.rows``) and then runs each verified row's attention alone, as a one-token step does
(``prefix_block.ROW_EXACT``), so a k-token verification's logits are bitwise those of k one-token steps and every
lossless method is token-identical to ``ar`` in the same format, near-ties included. (Without that, float32
attention over a block and over one token differ by ~1e-7, and the cast to bfloat16 before the next matmul can turn
that into a one-ulp activation change and a flipped near-tie.)

Why these kernels: they are PyTorch's own CPU quantized matmuls (the weight-only ones are those torchao's CPU layouts
call), so nothing is hand-written here but the packing of the weights they expect and ``w8a8``'s row quantization;
``w4a8``'s kernel is written here because no library in this stack has a 4-bit integer-dot-product CPU matmul
(``kernels/w4a8.cpp`` says why).
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F

from . import kernels
from .errors import RetrospecError

GROUP = 32  # int4: input features per scale/zero group (GGUF's Q4_0/Q4_1 block size)
INNER_K_TILES = 2  # the int4 packing's K tiling (the CPU kernel accepts 2, 4 or 8)
FORMATS = {
    "int8": "int8 weight-only: int8 weights, one bfloat16 scale per output row; bfloat16 activations in the matmuls",
    "int4": f"int4 weight-only: 4-bit weights in groups of {GROUP} with bfloat16 scale and zero; bfloat16 "
            "activations in the matmuls",
    "w8a8": "int8 weights (as int8) and int8 activations, one scale per row (dynamic): integer matmuls whose cost "
            "hardly grows with the rows verified",
    "w4a8": f"int4 weights (as int4) and int8 activations, one scale per row and group of {GROUP} (dynamic): integer "
            "dot products (llama.cpp's Q4_1 computation; CPUs with AVX-512 VNNI)",
}
INT8_WEIGHTS = ("int8", "w8a8")  # formats holding int8 [out, in] weights with one bfloat16 scale per output row
W4A8_TILE = 16  # w4a8: output features per weight tile (the kernel's 16 int32 lanes)


def available(fmt: str) -> bool:
    """Whether this torch build has the CPU kernel of ``fmt``."""
    ops = torch.ops.aten
    if fmt == "w8a8":
        return _int_mm_runs()
    if fmt == "w4a8":
        return kernels.w4a8() is not None
    return hasattr(ops, "_weight_int8pack_mm") if fmt == "int8" else (
        hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu"))


_INT_MM: list[bool] = []  # whether ``torch._int_mm`` runs on the CPU here (probed once)


def _int_mm_runs() -> bool:
    if not _INT_MM:
        try:
            ok = torch.equal(torch._int_mm(torch.ones(1, 32, dtype=torch.int8), torch.ones(32, 16, dtype=torch.int8)),
                             torch.full((1, 16), 32, dtype=torch.int32))
        except (AttributeError, RuntimeError, NotImplementedError):
            ok = False
        _INT_MM.append(ok)
    return _INT_MM[0]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, in] float32 -> (int8 [M, in], float32 scales [M, 1]): each row symmetric on its own largest magnitude."""
    scale = row_scales(x)
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """[M, in] float32 -> [M, 1]: each row's largest magnitude / 127 (its int8 step)."""
    return x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, packed=None) -> torch.Tensor:
    """[M, in] float32 rows x int8 [out, in] with bfloat16 [out] scales -> float32 [M, out]: each row divided by its
    scale and rounded to int8, integer products summed in int32 (exact), then ``sum * weight scale * row scale``.
    ``packed``: the same weights prepacked for fbgemm (``prepack_w8a8``), whose one call rounds, multiplies and
    scales by the weight (given the scaled rows and a unit input scale); else ``torch._int_mm``."""
    if packed is not None:
        scale = row_scales(x)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x / scale, 1.0, 128, packed)
        return y * scale
    q, scale = quantize_rows(x)
    return torch._int_mm(q, qweight.t()).float() * scales.float() * scale


def prepack_w8a8(qweight: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed form of int8 [out, in] weights with [out] scales, or None where this build has no fbgemm
    (then ``torch._int_mm`` computes the same sums). PyTorch's quantized-tensor API, which fbgemm's packing takes,
    is deprecated: its warning is silenced here."""
    ops = torch.ops.quantized
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(
            ops, "linear_with_input_q_dq_qweight_dq_output_fp32"):
        return None
    before = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                qweight, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0)
            return ops.linear_prepack(qw, None)
    except (RuntimeError, AttributeError):
        return None
    finally:
        torch.backends.quantized.engine = before


_HANDLES: "weakref.WeakKeyDictionary[WeightOnlyLinear, torch.Tensor]" = weakref.WeakKeyDictionary()  # w8a8 layers'


class WeightOnlyLinear(torch.nn.Module):
    """A linear layer whose weight is held quantized (``weight_only.FORMATS``); float input and output."""

    def __init__(self, fmt: str, in_features: int, out_features: int, qweight: torch.Tensor,
                 scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        # int8, w8a8: int8 [out, in] | int4: packed (uint8, the kernel's) | w4a8: uint8 [out / 16, in / GROUP, 256]
        self.register_buffer("qweight", qweight)
        # int8, w8a8: bf16 [out] | int4: bf16 [in / GROUP, out, 2] | w4a8: bf16 [out / 16, in / GROUP, 2, 16]
        self.register_buffer("scales", scales)  # int4, w4a8: (scale, zero) per group
        self.register_buffer("bias", bias)  # float [out] or None
        self._weight: torch.Tensor | None = None  # ``weight``'s cache (not a buffer: never saved)
        self._packed: list | None = None  # w8a8: [fbgemm's packed weights or None], built on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if self.fmt == "w8a8":
            y = w8a8_matmul(rows.float(), self.qweight, self.scales, self.packed())
        elif self.fmt == "w4a8":
            y = kernels.w4a8().w4a8_mm(rows.float(), self.qweight, self.scales)
        elif self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.scales)  # bf16
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.qweight, GROUP, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., out]
        return y if self.bias is None else y + self.bias

    def packed(self):
        """``w8a8``: the weights prepacked for fbgemm (``prepack_w8a8``; None without fbgemm), built on first use."""
        if self._packed is None:
            self._packed = [prepack_w8a8(self.qweight, self.scales) if self.fmt == "w8a8" else None]
        return self._packed[0]

    def handle(self) -> torch.Tensor | None:
        """``w8a8``: int64 [1], the handle under which ``kernels.w8a8`` holds ``packed()`` for its operator
        (``torch.ops.retrospec.w8a8_mm``, which compiled programs call), released when this layer is collected; None
        where there are no packed weights or no such operator. Kept outside the module's state, so a copy of the layer
        takes a handle of its own."""
        if self not in _HANDLES:
            packed = self.packed()
            if packed is None or kernels.w8a8() is None:
                return None
            h = torch.ops.retrospec.w8a8_hold(packed)
            weakref.finalize(self, torch.ops.retrospec.w8a8_release, h)
            _HANDLES[self] = torch.tensor([h])
        return _HANDLES[self]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight [out, in], built on first use and kept (for code that reads rows of a
        head, e.g. a draft's vocabulary; the forward never uses it)."""
        if self._weight is None:
            self._weight = self.dequantized()
        return self._weight

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer computes with (for tests and references)."""
        if self.fmt in INT8_WEIGHTS:
            return self.qweight.float() * self.scales.float()[:, None]
        if self.fmt == "w4a8":
            q, scale, zero = unpack_w4a8(self.qweight, self.scales)
            groups = self.in_features // GROUP
            w = (q.float().reshape(-1, groups, GROUP) - 8) * scale.float()[..., None] + zero.float()[..., None]
            return w.reshape(self.out_features, self.in_features)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # each basis row picks one input column
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP, self.scales)  # [in, out] bf16
        return cols.float().t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str) -> "WeightOnlyLinear":
        w = linear.weight.detach().float()  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if fmt in INT8_WEIGHTS:
            q, s = quantize_int8(w)
        elif fmt == "w4a8":
            q, s = pack_w4a8(*int4_groups(w))
        else:
            q, s = pack_int4(*int4_groups(w))
        return cls(fmt, linear.in_features, linear.out_features, q, s, bias)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bfloat16 scales [out]): symmetric, round to nearest."""
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)  # [out]
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q int32 [out, in] in 0..15, bfloat16 scale and zero [out, in / GROUP]) with
    ``w ~ (q - 8) * scale + zero`` per group of ``GROUP`` inputs (round to nearest from the group's min and max)."""
    out, inp = w.shape
    if inp % GROUP or out % 16:
        raise RetrospecError(f"int4 needs input features divisible by {GROUP} and output features by 16; a layer "
                             f"has {inp} -> {out}")
    g = w.reshape(out, inp // GROUP, GROUP)  # [out, G, 32]
    lo, hi = g.amin(dim=2), g.amax(dim=2)  # [out, G]
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)  # w = (q - 8) * scale + zero; q = 0 at the minimum
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return q.reshape(out, inp).to(torch.int32), scale, zero


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scale/zero [out, in / GROUP]) -> the CPU kernel's packed weight and
    [in / GROUP, out, 2] bfloat16 scales-and-zeros."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    sz = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=-1).transpose(0, 1).contiguous()
    return packed, sz


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scale/zero [out, in / GROUP]) -> the ``w4a8`` kernel's tiles: uint8
    [out / 16, in / GROUP, 256] (per group, 4 chunks of 64 bytes; byte 4j + i of chunk c: q[16 t + j, 32 g + 8 c + i]
    low, q[16 t + j, 32 g + 8 c + 4 + i] high) and bfloat16 [out / 16, in / GROUP, 2, 16] (scale, zero)."""
    out, inp = q.shape
    tiles, groups = out // W4A8_TILE, inp // GROUP
    nib = q.to(torch.uint8).reshape(tiles, W4A8_TILE, groups, 4, 2, 4)  # tile, j, group, chunk, half, i
    packed = (nib[..., 0, :] | (nib[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tiles, groups, chunk, j, i]
    sz = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)])  # [2, out, groups]
    sz = sz.reshape(2, tiles, W4A8_TILE, groups).permute(1, 3, 0, 2)  # [tiles, groups, 2, 16]
    return packed.reshape(tiles, groups, 256).contiguous(), sz.contiguous()


def unpack_w4a8(packed: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_w4a8``'s inverse: (q uint8 [out, in], scale and zero bfloat16 [out, in / GROUP])."""
    tiles, groups = packed.shape[:2]
    b = packed.reshape(tiles, groups, 4, W4A8_TILE, 4)
    nib = torch.stack([b & 15, b >> 4], dim=3)  # [tiles, groups, chunk, half, j, i]
    q = nib.permute(0, 4, 1, 2, 3, 5).reshape(tiles * W4A8_TILE, groups * GROUP)
    scale, zero = sz.permute(2, 0, 3, 1).reshape(2, tiles * W4A8_TILE, groups)
    return q, scale, zero


def quantize_group_rows(x: torch.Tensor) -> torch.Tensor:
    """[M, in] float32 -> the same rows as ``w4a8`` multiplies them: each group of ``GROUP`` inputs rounded to
    int8 steps of its largest magnitude / 127 (a group of zeros stays zero)."""
    g = x.reshape(x.shape[0], -1, GROUP)
    step = g.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(step > 0, torch.round(g / step).clamp(-127, 127), torch.zeros_like(g))
    return (q * step).reshape(x.shape)


def quantize_model_(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model``'s decoder and its output head by a ``WeightOnlyLinear``
    of format ``fmt``. Only for a model this library loaded itself (``load_model``): a caller's model is never
    changed. The input embedding stays float (a tied head gets its own quantized copy)."""
    if fmt not in FORMATS:
        raise RetrospecError(f"unknown weight-only format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not available(fmt):
        if fmt == "w4a8":
            raise RetrospecError("w4a8 needs a CPU with AVX-512 VNNI and a C++ compiler with ninja to build its "
                                 "kernel once" + ("" if kernels.w4a8_cpu() else "; this CPU has no AVX-512 VNNI"))
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
    bfloat16/float16 2; int8 and w8a8 1 plus a 2-byte scale per output row; int4 and w4a8 half a byte plus a 2-byte
    scale and zero per group of ``GROUP`` inputs."""
    per = {"float32": lambda o, i: 4 * o * i, "bfloat16": lambda o, i: 2 * o * i, "float16": lambda o, i: 2 * o * i,
           "int8": lambda o, i: o * i + 2 * o, "w8a8": lambda o, i: o * i + 2 * o,
           "int4": lambda o, i: o * i // 2 + 4 * o * (i // GROUP),
           "w4a8": lambda o, i: o * i // 2 + 4 * o * (i // GROUP)}[fmt]
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
    """What ``layer`` computes, in float32 from its dequantized weight (bfloat16-rounded input; ``w8a8``: the input
    rows quantized as the layer quantizes them; ``w4a8``: each group of the rows so)."""
    if layer.fmt == "w8a8":
        q, row_scale = quantize_rows(x.reshape(-1, layer.in_features).float())
        x = (q.float() * row_scale).reshape(x.shape)
    elif layer.fmt == "w4a8":
        x = quantize_group_rows(x.reshape(-1, layer.in_features).float()).reshape(x.shape)
    else:
        x = x.to(torch.bfloat16).float()
    return F.linear(x, layer.dequantized(), layer.bias)


def row_invariant(layer: WeightOnlyLinear, rows: int = 8, seed: int = 0) -> bool:
    """Whether a ``rows``-row call of ``layer`` gives bit for bit the rows of ``rows`` one-row calls."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layer.in_features, generator=gen)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    return torch.equal(together, alone)
