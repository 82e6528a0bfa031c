"""Shared fixtures: tiny random models built from configs (no downloads), Llama and Qwen2."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)  # tiny models gain nothing from threads; a busy CI machine makes them fight
# Every test runs the engine's fast path (prepacked linears, packed head, prefix + block attention: ``fastpath``)
# whatever this machine would measure, so the oracle tests prove it; test_fastpath covers the other modes.
os.environ.setdefault("RETROSPEC_FASTPATH", "packed")
# Compiling decoder layers ahead of time takes ~half a minute per layer shape: only test_compiled turns it on.
os.environ.setdefault("RETROSPEC_COMPILE", "off")
# Nothing a test runs writes into the user's cache home (converted models, measured plans, saved profiles that seed
# the gate of every later process): one private home per test run, removed at exit; tests that need their own set it.
os.environ["RETROSPEC_HOME"] = tempfile.mkdtemp(prefix="retrospec-tests-")
atexit.register(shutil.rmtree, os.environ["RETROSPEC_HOME"], True)
# ... except hand-written kernels (``retrospec.kernels``): built once per checkout (about half a minute), kept beside
# pytest's own cache.
os.environ.setdefault("RETROSPEC_KERNELS_HOME",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                                   "retrospec-kernels"))

VOCAB = 96


def formats_here() -> list[str]:
    """The weight-only formats this machine can run (``w4a8`` needs AVX-512 VNNI; its kernel builds on first use)."""
    from retrospec import kernels
    from retrospec.weight_only import FORMATS

    return [f for f in FORMATS if f != "w4a8" or kernels.w4a8_cpu()]


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
# Built once per session in about a second (no training steps: they cost tens of seconds on a busy 2-core machine):
# - a byte-level BPE (300 tokens) trained on stdlib source;
# - a 2-layer Llama target with random weights and a sharpened head: varied, deterministic greedy output, including
#   tokens that are partial UTF-8 sequences;
# - a 1-layer "early exit" draft made of the target's embeddings, first layer, norm and head, so its drafts are
#   accepted sometimes and rejected sometimes;
# - drafts whose vocabulary does not match the target's (different size; same size but another tokenizer).
# Each is saved with save_pretrained + tokenizer.save_pretrained, like a hub checkpoint.
# ======================================================================================================================

import inspect  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402


@dataclass(frozen=True)
class SavedModels:
    target: Path  # 2-layer Llama + tokenizer
    draft: Path  # 1-layer early-exit copy of the target, same tokenizer
    draft_other_size: Path  # different vocabulary size (different tokenizer)
    draft_other_tokens: Path  # same vocabulary size as the target, different tokenizer
    vocab_size: int
    max_positions: int
    eos_id: int


def _tiny_saved_llama(tok, layers: int, seed: int, max_pos: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval()


def _save(model, tok, out: Path) -> Path:
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> SavedModels:
    import json as _json
    import textwrap

    from retrospec.train.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("saved_models")
    max_pos = 512  # room for MBPP and held-out preset prompts (up to ~500 tokens with this tiny BPE)
    texts = [inspect.getsource(textwrap)]  # ~20 KB of Python
    tok = train_bpe(texts, vocab_size=300)
    other_size_tok = train_bpe([inspect.getsource(_json.decoder)], vocab_size=280)
    other_tok = train_bpe([inspect.getsource(inspect)], vocab_size=300)  # same size, different merges
    assert len(tok) == len(other_tok) and tok.get_vocab() != other_tok.get_vocab()
    assert len(other_size_tok) != len(tok)

    target = _tiny_saved_llama(tok, layers=2, seed=1, max_pos=max_pos)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peakier p: sampling runs look like a real model's
    draft = _tiny_saved_llama(tok, layers=1, seed=2, max_pos=max_pos)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    return SavedModels(
        target=_save(target, tok, root / "target"),
        draft=_save(draft, tok, root / "draft"),
        draft_other_size=_save(_tiny_saved_llama(other_size_tok, 1, 4, max_pos), other_size_tok,
                               root / "draft_other_size"),
        draft_other_tokens=_save(_tiny_saved_llama(other_tok, 1, 5, max_pos), other_tok, root / "draft_other_tokens"),
        vocab_size=len(tok), max_positions=max_pos, eos_id=tok.eos_token_id)


@dataclass
class CliRun:
    """Outcome of one in-process ``retrospec.cli.main([...])`` call."""

    rc: int
    out: str
    err: str

    def assert_user_error(self, *fragments: str) -> str:
        """The CLI contract for user errors: exit 2, exactly one line on stderr starting with 'retrospec: error:',
        no traceback, nothing on stdout. Returns the line; each fragment must appear in it (case-insensitive)."""
        assert self.rc == 2, f"exit code {self.rc}, stderr: {self.err!r}"
        assert "Traceback" not in self.err
        lines = self.err.splitlines()
        assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
        assert lines[0].startswith("retrospec: error:"), lines[0]
        assert self.out == "", f"stdout should be empty on error, got {self.out!r}"
        for frag in fragments:
            assert frag.lower() in lines[0].lower(), f"{frag!r} not in {lines[0]!r}"
        return lines[0]


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process: ``cli("generate", "--prompt", "x", ...) -> CliRun``."""
    from retrospec.cli import main

    def run(*args) -> CliRun:
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return CliRun(rc, out, err)

    return run


def bench_two_prompts(cli, models, tmp_path, methods, *extra):
    """``retrospec bench`` on two short code prompts, 6 new tokens, no warm-up: (CliRun, results.json or None)."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    res = cli("bench", "--target", models.target, "--prompts", prompts, "--methods", methods, "--out", out,
              "--max-new-tokens", "6", "--no-warmup", *extra)
    return res, (json.loads((out / "results.json").read_text()) if res.rc == 0 else None)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """Ahead-of-time compiles fail (as without a C++ compiler), with nothing cached or loaded to fall back on: the
    fresh cache folder is returned, to check nothing half-written was left in it."""
    from retrospec.fastpath import aot

    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(aot, "_LOADED", {})

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    return tmp_path


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for tiny models: with the machine's 2 cores busy, 2 OpenMP threads make a 2-layer forward
    hundreds of times slower (spin-waiting), and tiny matmuls gain nothing from a second thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ======================================================================================================================
# Chat (test_chat): a tiny saved checkpoint whose tokenizer has ChatML control tokens and a chat template.
# - the BPE of ``saved_models`` plus ``<|im_start|>`` / ``<|im_end|>`` added as special tokens; its EOS stays
#   ``<|endoftext|>``, so the end-of-turn id must come from the template, not from the EOS token;
# - a 2-layer Llama target whose greedy reply to ``CHAT_STOP_MESSAGES`` emits ``<|im_end|>`` at step ``stop_step``
#   (two rows of the LM head swapped: the token it would have emitted there and ``<|im_end|>``; earlier steps are
#   unchanged because their argmax is neither of the two);
# - a 1-layer early-exit draft of that target (same tokenizer), and a copy without a chat template.
# ======================================================================================================================

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_STOP_MESSAGES = [{"role": "user", "content": "def wrap(text, width):"}]


@dataclass(frozen=True)
class ChatModels:
    target: Path  # 2-layer Llama + ChatML tokenizer; stops at <|im_end|> on CHAT_STOP_MESSAGES
    draft: Path  # 1-layer early-exit copy of the target, same tokenizer
    no_template: Path  # the target with its chat template removed
    im_end_id: int
    eos_id: int
    stop_step: int  # 0-based position of <|im_end|> in the greedy reply to CHAT_STOP_MESSAGES


def chatml_tokenizer():
    import textwrap

    from retrospec.train.tokenizer import train_bpe

    tok = train_bpe([inspect.getsource(textwrap)], vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory) -> ChatModels:
    from retrospec.config import SamplingConfig
    from retrospec.decode import autoregressive_generate

    root = tmp_path_factory.mktemp("chat_models")
    tok = chatml_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    target = _tiny_saved_llama(tok, layers=2, seed=11, max_pos=512)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    ids = tok.apply_chat_template(CHAT_STOP_MESSAGES, add_generation_prompt=True)["input_ids"]
    greedy = SamplingConfig()
    out = autoregressive_generate(target, ids, sampling=greedy, max_new_tokens=24)
    step = next(k for k in range(4, len(out)) if out[k] not in out[:k] and im_end not in out[: k + 1]
                and tok.eos_token_id not in out[: k + 1])
    with torch.no_grad():  # swap the head rows of out[step] and <|im_end|>
        w = target.lm_head.weight
        w[[out[step], im_end]] = w[[im_end, out[step]]]
    stopped = autoregressive_generate(target, ids, sampling=greedy, max_new_tokens=24)
    assert stopped[:step] == out[:step] and stopped[step] == im_end
    draft = _tiny_saved_llama(tok, layers=1, seed=12, max_pos=512)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    no_template = _save(target, tok, root / "no_template")
    cfg_path = no_template / "tokenizer_config.json"
    import json as _json

    cfg = _json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(_json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (no_template / extra).unlink(missing_ok=True)
    return ChatModels(target=_save(target, tok, root / "target"), draft=_save(draft, tok, root / "draft"),
                      no_template=no_template, im_end_id=im_end, eos_id=tok.eos_token_id, stop_step=step)
