"""Loading Hugging Face causal LMs from local directories or model names, and vocabulary compatibility checks.

Any checkpoint directory ``AutoModelForCausalLM.from_pretrained`` understands works; nothing is ever downloaded
(``local_files_only=True``). Models load in float32 on the CPU by default, whatever dtype they were saved in. A
``str`` that is not an existing path but a known name (``named.py``) is resolved (converted once if needed) first;
a LoRA adapter directory (``adapters.py``) loads as its base with the adapter merged into a private copy.

A draft directory may hold ``draft_vocab.json`` (a *reduced draft vocabulary*)::

    {"target_vocab_size": V, "token_ids": [t0, t1, ...]}

where ``token_ids[i]`` is the target token id that the draft's output row ``i`` stands for: distinct ids, each
``< V``, exactly one per output row. It is loaded, validated, into ``LoadedModel.vocab_map`` ([V_draft] int64).
``vocab_size`` is always the model's own output size; ``target_vocab_size`` is V (or ``vocab_size`` without a map).

Devices (``resolve_device``): ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present); dtypes
(``resolve_format``): a ``torch.dtype`` or ``float32`` / ``bfloat16`` / ``float16``, or a quantized format ``int8`` /
``int4`` / ``w8a8`` / ``w4a8`` (``weight_only``: loaded in float32, then its linears quantized; CPU only). Anything
else, or CUDA asked for where there is none, is one ``RetrospecError`` line. A draft given by path or name loads where its target is, in
its dtype, unless told otherwise (``placement``). Loaded models are cached by (resolved path, dtype, device), so
repeated API calls with the same paths reuse them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import RetrospecError
from ..identity import derive, head_rows, model_identity
from .adapters import is_adapter_dir, load_adapter
from .files import first_line, quiet_transformers
from .pages import place_weights
from .named import gguf_of, known_names, lookup, resolve_name
from ..weight_only import FORMATS as WEIGHT_ONLY, quantize_model_
from .gguf_native import FORMAT as GGUF_FORMAT, converted_from_gguf, load_native_, source_of

DRAFT_VOCAB_FILE = "draft_vocab.json"
ROLES = ("target", "draft", "drafter", "verifier", "adapter base")  # what a model is loaded as (named in errors)


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with a causal-LM head
    tokenizer: Any  # a transformers tokenizer, or None
    path: str
    vocab_map: torch.Tensor | None = None  # [vocab_size] int64: target token id of each output row (reduced draft)
    vocab_map_size: int = 0  # V of draft_vocab.json: the target vocabulary vocab_map points into (0 without a map)

    @property
    def vocab_size(self) -> int:
        """The model's own output size (rows of its LM head)."""
        return head_rows(self.model)

    @property
    def target_vocab_size(self) -> int:
        """Size of the vocabulary this model's token ids live in: V from ``draft_vocab.json``, else ``vocab_size``."""
        return self.vocab_map_size if self.vocab_map is not None else self.vocab_size

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.model.config.eos_token_id, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return frozenset(ids)


def as_module(model) -> torch.nn.Module:
    """The module behind a ``LoadedModel`` (anything else as is)."""
    return model.model if isinstance(model, LoadedModel) else model


_CACHE: dict[tuple[str, str, str], LoadedModel] = {}


def forget(model) -> None:
    """Drop ``model`` (a module or ``LoadedModel``) from ``load_model``'s cache: a later ``load_model`` of the same
    source loads it afresh (for a caller about to change the loaded instance, e.g. shard it)."""
    module = as_module(model)
    for key in [k for k, v in _CACHE.items() if v.model is module]:
        del _CACHE[key]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what --dtype / dtype= take: a float dtype, a weight-only format, or a GGUF file's own blocks (``gguf_native``)
FORMAT_NAMES = (*DTYPES, *WEIGHT_ONLY, GGUF_FORMAT)


def resolve_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present) as a ``torch.device``; CUDA always with its
    index (``cuda`` is the current device), so that one device has one name."""
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise RetrospecError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RetrospecError(f"--device {name}: no CUDA device is available (torch {torch.__version__})")
    index = int(name[5:]) if name.startswith("cuda:") else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise RetrospecError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def load_options(device=None, dtype=None) -> dict:
    """The ``load_model`` keywords a caller gave (None: not given, ``load_model``'s default, or for a draft its
    target's ``placement``)."""
    return {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}


def placement(model) -> dict:
    """``{"device", "dtype"}`` of a loaded model (its first floating-point parameter's; CPU and float32 without
    one): where a draft loads by default, so that it runs beside its target."""
    weight = next((p for p in as_module(model).parameters() if p.is_floating_point()), None)
    if weight is None or weight.dtype not in DTYPES.values():
        device = next((p.device for p in as_module(model).parameters()), torch.device("cpu"))
        return {"device": device, "dtype": torch.float32}
    return {"device": weight.device, "dtype": weight.dtype}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32``, ``bfloat16`` or ``float16``, or its name (``float32``, ``bfloat16``, ``float16``)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise RetrospecError(f"--dtype must be one of {', '.join(FORMAT_NAMES)}, got {dtype!r}")


def resolve_format(fmt: str | torch.dtype) -> tuple[torch.dtype, str | None]:
    """A weight format -> (the dtype the model loads in, the weight-only format applied after or None):
    ``float32`` / ``bfloat16`` / ``float16`` (or a ``torch.dtype``), ``int8`` / ``int4`` (``weight_only``), or
    ``gguf``: the blocks of the GGUF file the checkpoint was converted from (``gguf_native``)."""
    if isinstance(fmt, str) and (fmt in WEIGHT_ONLY or fmt == GGUF_FORMAT):
        return torch.float32, fmt
    return resolve_dtype(fmt), None


def _check_dir(path: Path, role: str) -> None:
    if not path.exists():
        names = ", ".join(known_names())
        raise RetrospecError(f"{role} model directory not found: {path} (nor is it a model name; known: {names})")
    if not path.is_dir():
        raise RetrospecError(f"{role} model path is not a directory: {path}")
    if not (path / "config.json").exists():
        raise RetrospecError(f"{role} model directory has no config.json (not a Hugging Face checkpoint): {path}")


def model_dir(src) -> Path:
    """The checkpoint directory ``src`` (a path, or a model name) stands for; resolving a name may convert it."""
    if isinstance(src, str) and not Path(src).expanduser().exists() and lookup(src) is not None:
        return resolve_name(src)
    return Path(os.fspath(src)).expanduser()


def load_model(src, *, role: str = "target", tokenizer=None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load (or wrap) a causal LM. ``src``: a directory path, a model name (``retrospec models list``), a
    ``LoadedModel``, or a transformers model (wrapped as it is: a run puts it in eval mode and back, ``run``).
    ``dtype`` / ``device``: see ``resolve_dtype`` / ``resolve_device`` (a loaded model is used where and as it is)."""
    if role not in ROLES:
        raise RetrospecError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if isinstance(src, LoadedModel):
        return src
    if not isinstance(src, (str, os.PathLike, torch.nn.Module)):
        raise RetrospecError(f"a {role} model is a directory, a model name or a loaded model, got "
                             f"{type(src).__name__}")
    if isinstance(src, torch.nn.Module):
        name = getattr(src, "name_or_path", "") or ""
        home = Path(name) if name and Path(name).is_dir() else None
        if tokenizer is None and home is not None:
            tokenizer = _load_tokenizer(home)
        loaded = LoadedModel(src, tokenizer, str(name or "<in-memory model>"))
        return _attach_vocab_map(loaded, home) if home is not None else loaded
    (dtype, quant), device = resolve_format(dtype), resolve_device(device)
    if quant is not None and device.type != "cpu":
        raise RetrospecError(f"--dtype {quant} (weight-only) runs on the CPU; use bfloat16 or float16 on {device}")
    path = model_dir(src)
    if quant == GGUF_FORMAT and role != "target" and not converted_from_gguf(path, gguf_of(path)):
        quant = None  # a draft beside a GGUF target that has no file of its own: float32
    key = (str(path.resolve()), quant or str(dtype), str(device))
    if key in _CACHE:
        return _CACHE[key]
    if path.is_dir() and is_adapter_dir(path):  # a LoRA adapter: merged into a copy of its base
        model, tok = load_adapter(path, dtype=dtype, device=device, load_model=load_model)
        _CACHE[key] = LoadedModel(model, tok, str(path))
        return _CACHE[key]
    _check_dir(path, role)
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():  # load reports and progress bars off the user's terminal
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as exc:  # corrupt weights, unknown architecture, ...
        raise RetrospecError(f"could not load {role} model from {path}: {first_line(exc)}") from exc
    tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(path)
    if quant is not None:  # a model of its own whose identity is its source's (artefacts built on it load)
        source = model_identity(model)
        if quant == GGUF_FORMAT:
            load_native_(model, source_of(path, gguf_of(path)))
        else:
            quantize_model_(model, quant)
        derive(model, source, quant)
    if device.type == "cpu":
        place_weights(model)  # out of the checkpoint file's mapping, into huge pages (``models.pages``)
    _CACHE[key] = _attach_vocab_map(LoadedModel(model.to(device).eval(), tokenizer, str(path)), path)
    return _CACHE[key]


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise RetrospecError(f"could not load tokenizer from {path}: {first_line(exc)}") from exc


def _attach_vocab_map(loaded: LoadedModel, path: Path) -> LoadedModel:
    """Load and validate ``path/draft_vocab.json`` into ``loaded`` (nothing to do without the file)."""
    file = path / DRAFT_VOCAB_FILE
    if not file.is_file():
        return loaded
    bad = f"bad {DRAFT_VOCAB_FILE} in {path}"
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RetrospecError(f"{bad}: not readable JSON ({first_line(exc)})") from exc
    if not isinstance(data, dict) or not {"target_vocab_size", "token_ids"} <= set(data):
        raise RetrospecError(f"{bad}: expected an object with 'target_vocab_size' and 'token_ids'")
    size, ids = data["target_vocab_size"], data["token_ids"]
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise RetrospecError(f"{bad}: 'target_vocab_size' must be a positive integer, got {size!r}")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RetrospecError(f"{bad}: 'token_ids' must be a list of integers")
    if len(ids) != loaded.vocab_size:
        raise RetrospecError(f"{bad}: {len(ids)} token ids for a model with {loaded.vocab_size} output rows")
    if ids and (min(ids) < 0 or max(ids) >= size):
        raise RetrospecError(f"{bad}: token ids must lie in [0, {size}), got {min(ids)}..{max(ids)}")
    if len(set(ids)) != len(ids):
        raise RetrospecError(f"{bad}: token ids must be distinct")
    loaded.vocab_map = torch.tensor(ids, dtype=torch.int64)
    loaded.vocab_map_size = size
    return loaded


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids would mean something else than the target's: a different vocabulary size
    (for a reduced draft, the size its ``draft_vocab.json`` maps into) or a different tokenizer; and a draft on
    another device than the target (their tensors meet in every step)."""
    there, here = placement(target)["device"], placement(draft)["device"]
    if there != here:
        raise RetrospecError(f"the draft {draft.path} is on {here}, the target {target.path} on {there}: load both "
                             "on one device (--device / device=...)")
    if target.vocab_map is not None:
        raise RetrospecError(f"target {target.path} has a reduced vocabulary ({DRAFT_VOCAB_FILE}); only a draft may")
    if target.vocab_size != draft.target_vocab_size:
        mapped = " (through its draft_vocab.json)" if draft.vocab_map is not None else ""
        raise RetrospecError(
            f"draft and target vocabularies differ: target has {target.vocab_size} output tokens, "
            f"draft has {draft.target_vocab_size}{mapped} ({draft.path})"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise RetrospecError(f"draft tokenizer differs from the target's ({draft.path} vs {target.path})")
