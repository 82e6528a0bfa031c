"""Shared fixtures: tiny random models built from configs (no downloads), Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(2)

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, max_pos: int = 256):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      eos_token_id=vocab - 1, bos_token_id=vocab - 1, pad_token_id=vocab - 2)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, max_pos: int = 256):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      eos_token_id=vocab - 1, bos_token_id=vocab - 1, pad_token_id=vocab - 2)
    return Qwen2ForCausalLM(cfg).eval()


def sharpen(model, scale: float = 8.0):
    """Scale the LM head so a random model has peaked, repetitive outputs (drafts then get accepted)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture
def target(arch):
    return (tiny_llama if arch == "llama" else tiny_qwen2)(seed=0)


@pytest.fixture
def draft(arch):
    return (tiny_llama if arch == "llama" else tiny_qwen2)(seed=1, layers=1)
