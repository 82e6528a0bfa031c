"""A GGUF file's quantized tensors run natively (``dtype="gguf"``): a step reads the file's 4-bit blocks, not floats.

``load_model(src, dtype="gguf")`` loads the float32 checkpoint converted from a GGUF file (``gguf.import_gguf``:
the named ``smollm2-135m``, or a directory ``retrospec models import-gguf`` wrote, which records its source in
``SOURCE_FILE``), then replaces each decoder linear and the output head by a ``weight_only.WeightOnlyLinear`` built
from the file's own blocks:

- ``Q4_0`` (per 32 inputs: fp16 ``d``; ``w = (q - 8) d``) and ``Q4_1`` (fp16 ``d`` and ``m``; ``w = q d + m``) ->
  the int4 kernel, whose groups are the same 32 inputs with a scale and a zero (``w = (q - 8) s + z``): ``s = d``,
  ``z = m + 8 d`` (``z = 0`` for Q4_0). The kernel holds ``s`` and ``z`` in bfloat16, so the file's fp16 scales are
  rounded (relative error <= 2^-9 per weight): **a format of its own, "GGUF 4-bit blocks with bfloat16 scales"**,
  not bit-equal to the file's dequantized values;
- ``Q8_0`` (fp16 ``d`` per 32 inputs, int8 ``q``) -> the int8 kernel, which has one scale per output row: the
  block values ``q d`` (exact in float32) are requantized per row (round to nearest), also named as such;
- float tensors (norms, an F32/F16 embedding) stay the converted float32 values; the input embedding is always the
  exact dequantized float32 table (a lookup reads one row); a tied head gets its own copy from the embedding's blocks.

Self-check at load (cheap: the tensors are in memory): every replaced tensor's exact dequantized values equal the
converted checkpoint's weight (after undoing llama.cpp's rotary row order for q/k, found by trying both orders), so
a block never lands in the wrong layer or row order; a mismatch is a one-line ``RetrospecError``. Identity: the
float32 source's (``identity.derive``), so blocks, stores and drafts built on the float32 model load on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import RetrospecError
from ..weight_only import FORMAT_ATTR, GROUP, WeightOnlyLinear, available, pack_int4, quantize_int8

FORMAT = "gguf"
DESCRIPTION = ("the GGUF file's own blocks: Q4_0/Q4_1 as int4 groups of 32 with bfloat16 scale and zero (the file's "
               "fp16 scales rounded), Q8_0 requantized to int8 per output row; bfloat16 activations in the matmuls")
SOURCE_FILE = "gguf_source.json"  # written by import_gguf: {"file": the GGUF the checkpoint was converted from}
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def write_source(out: Path, file: Path) -> None:
    (out / SOURCE_FILE).write_text(json.dumps({"file": str(file.resolve())}) + "\n")


def converted_from_gguf(path: Path, named_file: Path | None = None) -> bool:
    try:
        source_of(path, named_file)
    except RetrospecError:
        return False
    return True


def source_of(path: Path, named_file: Path | None = None) -> Path:
    """The GGUF file the checkpoint directory ``path`` was converted from (``named_file``: the file of the named
    model converted into ``path``, ``named.gguf_of``)."""
    if named_file is not None:
        return named_file
    record = path / SOURCE_FILE
    if not record.is_file():
        raise RetrospecError(f"--dtype {FORMAT} runs a GGUF file's own tensors, and {path} was not converted from "
                             "one here (convert it with 'retrospec models import-gguf FILE.gguf --out DIR')")
    try:
        file = Path(json.loads(record.read_text())["file"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RetrospecError(f"unreadable {SOURCE_FILE} in {path}") from exc
    if not file.is_file():
        raise RetrospecError(f"the GGUF file {path} was converted from is gone: {file}")
    return file


def blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized tensor's raw bytes [out, in / 32 * block bytes] -> (q int32 [out, in], d float32 [out, in / 32],
    m float32 [out, in / 32]: zeros for types without a minimum). Q4: q in 0..15; Q8_0: q in -128..127."""
    out, inp = shape
    b = np.ascontiguousarray(raw).reshape(out, inp // GROUP, _BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else np.zeros_like(d)
    if kind == "Q8_0":
        q = b[..., 2:34].copy().view(np.int8).astype(np.int32)
    else:
        qs = b[..., 4:20] if kind == "Q4_1" else b[..., 2:18]  # byte j: element j (low nibble), j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)
    return torch.from_numpy(q.reshape(out, inp)), torch.from_numpy(d), torch.from_numpy(m)


def dequantize(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The exact float32 values [out, in] the blocks stand for (``q d + m``; Q4_0: ``(q - 8) d``)."""
    out, inp = q.shape
    qf = q.reshape(out, inp // GROUP, GROUP).float()
    if kind == "Q4_0":
        qf = qf - 8
    return (qf * d[..., None] + m[..., None]).reshape(out, inp)


def native_linear(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  bias: torch.Tensor | None = None) -> WeightOnlyLinear:
    """The weight-only layer that computes with the blocks (see the module docstring for the rounding)."""
    out, inp = q.shape
    if kind == "Q8_0":
        qi, scale = quantize_int8(dequantize(kind, q, d, m))
        return WeightOnlyLinear("int8", inp, out, qi, scale, bias)
    zero = m + 8 * d if kind == "Q4_1" else torch.zeros_like(d)
    packed, sz = pack_int4(q, d, zero)
    return WeightOnlyLinear("int4", inp, out, packed, sz, bias)


def _llama_rows(out: int, heads: int) -> torch.Tensor:
    """Row order of llama.cpp's q/k tensors (rotary halves interleaved per head) back to transformers' order."""
    return torch.arange(out).reshape(heads, out // heads // 2, 2).transpose(1, 2).reshape(out)


def _set(root: torch.nn.Module, dotted: str, module: torch.nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def load_native_(model: torch.nn.Module, file: Path) -> dict[str, int]:
    """Replace, in place, ``model``'s linears by the GGUF ``file``'s blocks (a model ``load_model`` just loaded from
    the checkpoint converted from ``file``); returns the count of tensors per GGUF type made native."""
    from gguf import GGUFReader

    if not (available("int4") and available("int8")):
        raise RetrospecError(f"this torch build has no CPU weight-only kernels for --dtype {FORMAT}")
    reader = GGUFReader(str(file))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    decoder = model.get_decoder()
    counts: dict[str, int] = {}
    with torch.no_grad():
        for name, t in tensors.items():
            kind = t.tensor_type.name
            parts = name.split(".")
            if kind not in NATIVE_TYPES:
                continue
            if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LINEARS:
                dotted = f"layers.{parts[1]}.{_LINEARS[parts[2]]}"
                target = decoder.get_submodule(dotted)
                root = decoder
            elif name in ("output.weight", "token_embd.weight"):
                if name == "token_embd.weight" and "output.weight" in tensors:
                    continue  # an embedding with a head of its own: the lookup stays float32 (exact)
                dotted, target, root = "", model.get_output_embeddings(), model
            else:
                continue
            out, inp = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
            q, d, m = blocks(kind, t.data, (out, inp))
            weight = target.weight.detach().float()
            exact = dequantize(kind, q, d, m)
            if not torch.equal(exact, weight):
                heads = cfg.num_attention_heads if parts[-2] == "attn_q" else getattr(cfg, "num_key_value_heads", None)
                rows = _llama_rows(out, heads) if parts[-2] in ("attn_q", "attn_k") and heads else None
                if rows is None or not torch.equal(exact[rows], weight):
                    raise RetrospecError(f"{file.name}: tensor {name} does not match the checkpoint converted from "
                                         "it (convert the file again)")
                q, d, m = q[rows], d[rows], m[rows]
            bias = None if getattr(target, "bias", None) is None else target.bias.detach().float().clone()
            native = native_linear(kind, q, d, m, bias)
            if dotted:
                _set(root, dotted, native)
            else:
                model.set_output_embeddings(native)
                cfg.tie_word_embeddings = False  # the head is no longer the embedding's tensor
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        raise RetrospecError(f"{file.name} has no {'/'.join(NATIVE_TYPES)} tensors to run natively; use --dtype "
                             "float32 (or int8/int4 to quantize it here)")
    setattr(model, FORMAT_ATTR, FORMAT)
    return counts

