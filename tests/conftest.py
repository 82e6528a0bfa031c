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


# ======================================================================================================================
# User-facing suite (test_cli / test_api / test_loading / test_bench): tiny *saved* checkpoints with real tokenizers.
# Built once per session: a byte-level BPE trained on stdlib source, a 2-layer Llama target, a 1-layer draft distilled
# from it, plus drafts whose vocabularies do not match the target's (different size; same size, different tokens).
# ======================================================================================================================

import inspect  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402


@dataclass(frozen=True)
class SavedModels:
    target: Path  # 2-layer Llama + tokenizer
    draft: Path  # 1-layer Llama distilled from the target, same tokenizer
    draft_other_size: Path  # different vocabulary size (different tokenizer)
    draft_other_tokens: Path  # same vocabulary size as the target, different tokenizer
    vocab_size: int
    max_positions: int
    eos_id: int


def _corpus_texts(modules) -> list[str]:
    return [inspect.getsource(m) for m in modules]


def _saved_llama(tok, out: Path, *, layers: int, seed: int, max_pos: int, stream=None, teacher=None, steps: int = 0):
    from retrospec.train.lm import TrainConfig, train_lm

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    if steps:
        tcfg = TrainConfig(tokens=steps * 4 * 64, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=5, seed=seed,
                           log_every=1000)
        train_lm(model, stream, tcfg, teacher=teacher, desc=f"tiny-{out.name}")
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> SavedModels:
    import ast
    import json as _json
    import textwrap

    import numpy as np

    from retrospec.train.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("saved_models")
    texts = _corpus_texts([textwrap])  # ~20 KB of Python
    tok = train_bpe(texts, vocab_size=300)
    other_size_tok = train_bpe(_corpus_texts([_json.decoder]), vocab_size=280)
    # same size as the target's vocabulary, different merges (trained on different text)
    other_tok = train_bpe(_corpus_texts([inspect]), vocab_size=300)
    assert len(tok) == len(other_tok) and tok.get_vocab() != other_tok.get_vocab()
    assert len(other_size_tok) != len(tok)

    stream = np.array(tok("\n".join(texts), add_special_tokens=False)["input_ids"], dtype=np.int64)
    max_pos = 128
    target = _saved_llama(tok, root / "target", layers=2, seed=0, max_pos=max_pos, stream=stream, steps=30)
    _saved_llama(tok, root / "draft", layers=1, seed=1, max_pos=max_pos, stream=stream, teacher=target, steps=30)
    _saved_llama(other_size_tok, root / "draft_other_size", layers=1, seed=2, max_pos=max_pos)
    _saved_llama(other_tok, root / "draft_other_tokens", layers=1, seed=3, max_pos=max_pos)
    return SavedModels(root / "target", root / "draft", root / "draft_other_size", root / "draft_other_tokens",
                       vocab_size=len(tok), max_positions=max_pos, eos_id=tok.eos_token_id)


# ======================================================================================================================
