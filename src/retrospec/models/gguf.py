"""GGUF import: any GGUF file that transformers can read becomes an ordinary Hugging Face checkpoint directory.

``import_gguf(file, out)`` loads the file with transformers' own GGUF support (metadata -> config, dequantized
weights -> float32 tensors, GGUF vocabulary -> fast tokenizer with the chat template), drops the GGUF quantization
marker, and saves ``config.json`` (no ``quantization_config``), ``model.safetensors`` (float32: the values
transformers dequantized, so the logits are unchanged), ``generation_config.json`` and the tokenizer files (its
special tokens the header's ids, whatever the transformers release: the conversion gives the same model identity and
the same tokenizer on every supported release).

Contracts:

- Checks come first and are cheap (no tensor is read): the file exists, starts with the magic bytes ``GGUF``, has
  a readable header, and names an architecture transformers can load; ``out`` is absent or an empty directory.
- Atomic (``atomic.atomic_build``): everything is written into a temporary sibling of ``out`` renamed to ``out`` at
  the very end; on any failure (or Ctrl-C) nothing is left at ``out``, and an ``out`` that another process filled
  meanwhile is left as it is.
- Every failure a user can cause is a one-line ``RetrospecError``; transformers' progress bars and log lines are
  kept off the terminal, and one progress message goes to ``log`` (stderr by default).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..atomic import atomic_build
from ..errors import RetrospecError
from .files import first_line, quiet_transformers
from .gguf_native import write_source

GGUF_MAGIC = b"GGUF"

# llama.cpp spells a few architectures differently from the names transformers' GGUF tables use
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def supported_architectures() -> set[str]:
    """GGUF ``general.architecture`` values this transformers version can turn into a model: the table every
    supported release has, plus the architectures of the config-builder registry newer releases added
    (``transformers.integrations.gguf``)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:  # an older release: the table above is the whole list
        GGUF_CONFIG_ARCHS = ()
    return set(GGUF_CONFIG_ARCHS) | set(GGUF_SUPPORTED_ARCHITECTURES)


def _header_architecture(file: Path) -> str:
    """``general.architecture`` from the header, read with the ``gguf`` package (what transformers itself reads
    GGUF files with in older releases; newer ones have their own reader): one code path for every version."""
    from gguf import GGUFReader

    field = GGUFReader(str(file)).fields.get("general.architecture")
    return "" if field is None else str(field.contents())


# the header's special-token ids -> the tokenizer's special-token attributes
_SPECIAL_TOKEN_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def special_tokens(file: Path) -> dict[str, str]:
    """The special tokens the header names (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, each the
    token string of the id the GGUF records), for those it records."""
    from gguf import GGUFReader

    fields = GGUFReader(str(file)).fields
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return {}
    vocab = tokens.contents()
    out = {}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        field = fields.get(key)
        if field is not None and 0 <= int(field.contents()) < len(vocab):
            out[name] = str(vocab[int(field.contents())])
    return out


def gguf_architecture(file: Path) -> str:
    """Check that ``file`` is a readable GGUF file of a supported architecture; return the architecture."""
    if not file.exists():
        raise RetrospecError(f"GGUF file not found: {file}")
    if not file.is_file():
        raise RetrospecError(f"not a file: {file}")
    try:
        with open(file, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise RetrospecError(f"cannot read {file}: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise RetrospecError(f"not a GGUF file (it does not start with the bytes 'GGUF'): {file}")
    try:
        arch = _header_architecture(file)
    except Exception as exc:  # truncated header, unknown value type, unsupported GGUF version, ...
        raise RetrospecError(f"unreadable GGUF header in {file}: {first_line(exc)}") from exc
    supported = supported_architectures()
    if arch not in supported and _ARCH_ALIASES.get(arch) not in supported:
        import transformers

        raise RetrospecError(f"GGUF architecture '{arch}' is not supported by transformers {transformers.__version__} "
                             f"({file.name}); supported: {', '.join(sorted(supported))}")
    return arch


def convert(file: Path, staging: Path) -> None:
    """Load ``file`` with transformers and save it as a float32 checkpoint into ``staging`` (no checks)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers(capture_stderr=True):
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
        # The special tokens are the ones the header names, and no space clean-up on decode: transformers releases
        # differ here (5.16 makes SmolLM2's <|im_start|> the end-of-sequence token, sets no padding token and turns
        # the clean-up on, whatever from_pretrained is told; 5.23 follows the header), and the converted tokenizer
        # must be the same whichever release converts it. Set after loading, through the tokenizer's public setters.
        for name, token in special_tokens(file).items():
            setattr(tokenizer, name, token)
        tokenizer.clean_up_tokenization_spaces = False
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                     local_files_only=True)
        # the weights are plain float tensors now, but the model still says it is quantized
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    write_source(staging, file)  # what --dtype gguf runs natively


def import_gguf(file, out, *, log: Callable[[str], None] | None = _stderr, message: str | None = None) -> Path:
    """Convert the GGUF ``file`` into the checkpoint directory ``out`` (see the module docstring); returns ``out``.

    ``message`` replaces the default progress line; ``log=None`` prints nothing."""
    file = Path(os.fspath(file)).expanduser()
    out = Path(os.fspath(out)).expanduser()
    arch = gguf_architecture(file)
    if out.exists() and not out.is_dir():
        raise RetrospecError(f"output path exists and is not a directory: {out}")
    if out.is_dir() and any(out.iterdir()):
        raise RetrospecError(f"output directory already exists and is not empty: {out}")
    if log is not None:
        size = file.stat().st_size / 2**20
        log(message or f"converting {file.name} ({arch}, {size:.1f} MiB) into {out} (tens of seconds for a "
                       "100M-parameter model)...")
    try:
        with atomic_build(out, required="config.json") as staging:
            convert(file, staging)
    except RetrospecError:
        raise
    except OSError as exc:  # cannot create out's parent, disk full, ...
        raise RetrospecError(f"could not convert {file.name} into {out}: {exc.strerror or exc}") from exc
    except Exception as exc:  # tokenizer or model conversion
        raise RetrospecError(f"could not convert {file.name}: {first_line(exc)}") from exc
    if log is not None and message is None:
        log(f"wrote {out}")
    return out
