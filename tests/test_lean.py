"""The engine's lean decoder loop (``fastpath.lean``) computes what the model's own forward computes, bit for bit.

On tiny Llama, Qwen2 and Qwen3 models, in float32 and the weight-only formats: a prefill, a one-token step, a chain
and a draft tree (4D mask) through ``LeanDecoder`` give the same last hidden state and cache as the decoder module
called with the same arguments (``torch.equal``); the outputs of chosen layers are transformers' hidden states;
models it does not cover (sliding windows, another activation) run through their modules.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from retrospec.fastpath import engine_for
from retrospec.fastpath.lean import LeanDecoder
from retrospec.kv.cache import KVCache
from retrospec.weight_only import quantize_model_

from conftest import VOCAB, tiny_llama, tiny_qwen2

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_qwen3(seed: int = 0, layers: int = 2, hidden: int = 64):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2)
    return Qwen3ForCausalLM(cfg).eval()


BUILDS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


def _engine(build: str, fmt: str):
    model = BUILDS[build](seed=3, layers=3, hidden=64)
    if fmt != "float32":
        model = quantize_model_(copy.deepcopy(model), fmt)
    return engine_for(model, "plain")


def _tree_mask(past: int) -> torch.Tensor:
    """[1, 1, 4, past + 4] additive: root, two children of the root, a grandchild under the first child."""
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(4, past + 4)
    mask[:, past:] = torch.zeros(4, 4).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_lean_loop_equals_the_module_forward_bitwise(build, fmt):
    engine = _engine(build, fmt)
    assert engine.lean is not None and engine.describe()["loop"] == "lean"
    decoder, lean = engine.decoder, engine.lean
    ours, theirs = KVCache(engine.module).cache, KVCache(engine.module).cache
    prompt = torch.tensor([[5, 9, 2, 7, 7, 1, 30, 4, 5, 9, 2, 11, 3]])
    past = prompt.shape[1]
    steps = [(prompt, torch.arange(past)[None], None),
             (torch.tensor([[8]]), torch.tensor([[past]]), None),
             (torch.tensor([[6, 2, 40, 41, 9]]), torch.arange(past + 1, past + 6)[None], None)]
    past += 6
    steps.append((torch.tensor([[12, 13, 14, 15]]), torch.tensor([[past, past + 1, past + 1, past + 2]]),
                  _tree_mask(past)))
    with torch.inference_mode():
        for ids, pos, mask in steps:
            mine, _ = lean(ids, pos, mask, ours)
            ref = decoder(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=theirs,
                          use_cache=True).last_hidden_state[0]
            assert torch.equal(mine, ref), (build, fmt, ids.shape, (mine - ref).abs().max().item())
        for a, b in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_lean_loop_returns_the_chosen_layers_outputs(build):
    engine = _engine(build, "float32")
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    pos = torch.arange(6)[None]
    with torch.inference_mode():
        last, layers = engine.lean(ids, pos, None, KVCache(engine.module).cache, want_layers=(0, 1))
        out = engine.decoder(input_ids=ids, position_ids=pos, past_key_values=KVCache(engine.module).cache,
                             use_cache=True, output_hidden_states=True)
    assert sorted(layers) == [0, 1]
    for i, hidden in layers.items():  # hidden_states[0] is the embedding; [i + 1] the output of layer i
        assert torch.equal(hidden, out.hidden_states[i + 1][0])
    assert torch.equal(last, out.last_hidden_state[0])


def test_engine_logits_through_the_lean_loop_equal_the_plain_forward():
    model = tiny_llama(seed=1, layers=2, hidden=64)
    engine = engine_for(model)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 30]])
    with torch.inference_mode():
        logits, hidden = engine.forward(ids, torch.arange(7)[None], None, KVCache(engine.module).cache,
                                        want_hidden=True)
        ref = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


def test_models_the_loop_does_not_cover_run_through_their_modules():
    gelu = tiny_llama(seed=2, layers=2, hidden=64)
    gelu.config.hidden_act = "gelu"
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    engine = engine_for(gelu, "plain")
    assert engine.lean is None and engine.describe()["loop"] == "modules"
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        logits, _ = engine.forward(ids, torch.arange(4)[None], None, KVCache(engine.module).cache)
    torch.testing.assert_close(logits, gelu(input_ids=ids).logits[0], rtol=1e-5, atol=1e-5)
    window = tiny_qwen2(seed=2)
    window.config.layer_types = ["sliding_attention"] * window.config.num_hidden_layers
    assert not LeanDecoder.supports(window.model)
