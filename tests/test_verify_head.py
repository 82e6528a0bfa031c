"""The verifier's own logits head (``verify.LogitsHead``): same logits as the model's forward, for one row and for
verification-sized blocks, on the families it is enabled for; other models are called whole."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from retrospec.verify import LogitsHead, Verifier


@torch.inference_mode()
def test_head_logits_equal_model_logits(target):
    head = LogitsHead.of(target)
    assert head is not None
    ids = torch.tensor([[5, 17, 3, 42, 8, 61, 2]])
    ref = target(input_ids=ids).logits[0]  # [T, V]
    hidden = head.decoder(input_ids=ids).last_hidden_state[0]  # [T, H]
    for rows in (slice(0, 1), slice(0, 2), slice(0, 7), slice(6, 7)):
        torch.testing.assert_close(head.logits(hidden[rows]), ref[rows], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_transposed_copy_follows_in_place_updates(target):
    head = LogitsHead.of(target)
    h = torch.randn(1, target.config.hidden_size)
    before = head.logits(h)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2.0)  # e.g. tests that sharpen a model after first use
    torch.testing.assert_close(head.logits(h), 2 * before, rtol=1e-5, atol=1e-5)


def test_other_families_are_called_whole():
    cfg = GPT2Config(vocab_size=50, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(cfg).eval()
    assert LogitsHead.of(model) is None
    assert Verifier(model).head is None
