"""``dtype="gguf"``: a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors run natively through the weight-only kernels.

A tiny Llama written here as a GGUF with quantized tensors of every native type (``gguf`` package), converted with
``retrospec models import-gguf``, then loaded in the ``gguf`` format: each linear is a weight-only layer built from the
file's own blocks (4-bit groups with bfloat16 scale and zero; Q8_0 requantized per row), its weights within the
scale rounding of the file's exact dequantized values, its logits within tolerance of the dequantized float32 model;
lossless methods are token-identical to ``ar`` in that format; user errors are one line.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch

from retrospec import RetrospecError, generate, load_model
from retrospec.models.gguf_native import SOURCE_FILE, blocks, dequantize
from retrospec.weight_only import WeightOnlyLinear, format_of

from test_models_named import EPS, HEADS, HIDDEN, KV_HEADS, LAYERS, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("single_thread")

QUANT = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
for _i, _kind in zip(range(LAYERS), ("Q4_0", "Q4_1")):
    QUANT.update({f"blk.{_i}.{n}.weight": _kind for n in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")})
    QUANT.update({f"blk.{_i}.attn_output.weight": "Q8_0", f"blk.{_i}.ffn_down.weight": _kind})


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(GGUF file, converted checkpoint directory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from retrospec.cli import main
    from retrospec.train.tokenizer import train_bpe

    tok = train_bpe([inspect.getsource(textwrap)], vocab_size=300)
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=EPS, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked outputs: repetitive greedy text, drafts get accepted
    root = tmp_path_factory.mktemp("gguf-native")
    write_tiny_gguf(root / "tiny-q.gguf", model, tok, quant=QUANT)
    out = root / "tiny-q-hf"
    assert main(["models", "import-gguf", str(root / "tiny-q.gguf"), "--out", str(out)]) == 0
    return root / "tiny-q.gguf", out


def test_the_file_s_blocks_run_natively_and_match_the_dequantized_model(quantized):
    from gguf import GGUFReader

    file, out = quantized
    assert json.loads((out / SOURCE_FILE).read_text())["file"].endswith("tiny-q.gguf")
    native, plain = load_model(out, dtype="gguf"), load_model(out)
    layers = native.model.model.layers
    assert layers[0].self_attn.q_proj.fmt == "int4" and layers[1].mlp.down_proj.fmt == "int4"
    assert layers[0].self_attn.o_proj.fmt == "int8" and native.model.lm_head.fmt == "int8"
    assert type(native.model.model.embed_tokens) is torch.nn.Embedding  # the lookup: exact float32 values
    assert format_of(native.model) == "gguf" and format_of(plain.model) is None
    tensors = {t.name: t for t in GGUFReader(str(file)).tensors}
    for i in range(LAYERS):
        for gguf_name, module in ((f"blk.{i}.attn_v.weight", layers[i].self_attn.v_proj),
                                  (f"blk.{i}.ffn_down.weight", layers[i].mlp.down_proj)):
            t = tensors[gguf_name]
            exact = dequantize(QUANT[gguf_name], *blocks(QUANT[gguf_name], t.data, (int(t.shape[1]), int(t.shape[0]))))
            assert isinstance(module, WeightOnlyLinear)
            # bfloat16 scale and zero: each weight within a few bf16 ulps of its group's range
            assert (module.dequantized() - exact).abs().max() <= 2**-7 * exact.abs().max()
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 30, 4, 50, 120, 8]])
    with torch.no_grad():
        a, b = plain.model(ids).logits[0], native.model(ids).logits[0]
    assert ((a - b).norm() / a.norm()).item() < 0.03
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("method", ["pld", "sd"])
def test_lossless_methods_equal_ar_in_the_gguf_format(quantized, method):
    _, out = quantized
    kwargs = dict(target=out, dtype="gguf", max_new_tokens=24, temperature=0)
    if method == "sd":
        kwargs["draft"] = out  # converted from the GGUF too: runs in its blocks as well
    prompt = [5, 9, 2, 7, 7, 1, 30, 4, 5, 9, 2, 7]
    ref = generate(prompt, method="ar", **kwargs)
    got = generate(prompt, method=method, **kwargs)
    assert got.token_ids == ref.token_ids


def test_gguf_format_errors_are_one_line(quantized, tmp_path, saved_models):
    _, out = quantized
    with pytest.raises(RetrospecError, match="was not converted from one"):
        load_model(saved_models.target, dtype="gguf")
    moved = tmp_path / "copy"
    moved.mkdir()
    for f in out.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    (moved / SOURCE_FILE).write_text(json.dumps({"file": str(tmp_path / "gone.gguf")}))
    with pytest.raises(RetrospecError, match="is gone"):
        load_model(moved, dtype="gguf")
    # a draft without a GGUF of its own beside a GGUF target runs in float32
    draft = load_model(saved_models.target, role="draft", dtype="gguf")
    assert not any(isinstance(m, WeightOnlyLinear) for m in draft.model.modules())
