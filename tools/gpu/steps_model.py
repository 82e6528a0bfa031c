"""Steps ``stage`` and ``model``: the real model across, in parts, and its logits checked against the CPU's.

``stage`` reports which GGUF parts sit in ``<stage>/g`` (copied there by every call's prelude) and whether each
matches ``parts.json``. ``model`` reassembles the GGUF (SHA-256 checked; a missing part is a clear error naming the
calls to redo), converts it with ``models.gguf.import_gguf`` into ``$RETROSPEC_HOME`` (so the named model resolves
there like here) and compares its logits in float32 and bfloat16 with ``.gpu/ref/ref.pt``. Dry run: a tiny random
model's safetensors stands in for the GGUF (no conversion), against a reference taken a moment earlier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from retrospec.errors import RetrospecError
from . import common, prepare


def staged(stage: Path) -> dict:
    """``{"manifest": parts.json or None, "present": [...], "missing": [...], "bad": [...]}``."""
    g = stage / "g"
    if not (g / "parts.json").is_file():
        return {"manifest": None, "present": [], "missing": ["parts.json"], "bad": []}
    state = {"manifest": json.loads((g / "parts.json").read_text()), "present": [], "missing": [], "bad": []}
    for p in state["manifest"]["parts"]:
        f = g / p["file"]
        ok = f.is_file() and f.stat().st_size == p["bytes"] and prepare.sha256(f) == p["sha256"]
        state["present" if ok else "bad" if f.is_file() else "missing"].append(p["dir"])
    return state


def assemble(stage: Path, out: Path) -> Path:
    state = staged(stage)
    if state["manifest"] is None or state["missing"] or state["bad"]:
        raise RetrospecError(f"GGUF parts missing {state['missing']} or damaged {state['bad']} in {stage / 'g'}: the "
                             "machine went cold between calls; redo the plan from call 1 (python -m tools.gpu plan)")
    m = state["manifest"]
    target = out / m["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as f:
        for p in m["parts"]:
            with (stage / "g" / p["file"]).open("rb") as part:
                shutil.copyfileobj(part, f)
    if prepare.sha256(target) != m["sha256"]:
        raise RetrospecError(f"{target}: SHA-256 differs from parts.json after reassembly")
    return target


@torch.inference_mode()
def compare_logits(loaded, ref: dict, dtype: torch.dtype) -> dict:
    rows = []
    for p in ref["prompts"]:
        now, last = prepare.ref_row(loaded.model, p["name"], p["ids"]), p["last"].float()
        diff = now["last"] - last
        rows.append({"prompt": p["name"], "tokens": len(p["ids"]), "max_abs_diff": diff.abs().max().item(),
                     "rel_l2": (diff.norm() / last.norm()).item(),
                     "argmax_agreement": (now["argmax"] == p["argmax"]).float().mean().item()})
    return {"dtype": common.dtype_name(dtype), "rows": rows, "worst_rel_l2": max(r["rel_l2"] for r in rows),
            "min_argmax_agreement": min(r["argmax_agreement"] for r in rows)}


def run_stage(out: Path, dry_run: bool, budget_s: float, ref_dir: Path | None = None) -> int:
    res, device = common.start("stage", dry_run, budget_s)
    state = staged(common.stage_root())
    res.figures = {k: v for k, v in state.items() if k != "manifest"} | {
        "parts": len(state["manifest"]["parts"]) if state["manifest"] else None}
    if state["missing"] or state["bad"]:
        res.notes.append(f"not yet staged: {state['missing']}, damaged: {state['bad']}")
    return common.finish(res, out)


def run_model(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref")) -> int:
    from retrospec.models import load_model
    from retrospec.models.gguf import import_gguf
    from retrospec.models.named import lookup

    res, device = common.start("model", dry_run, budget_s)
    stage = common.stage_root()
    if dry_run:  # a stage and reference of its own: a dry run never touches the real ones
        stage, ref_dir = stage / "dry-stage", stage / "dry-stage" / "ref"
        model_dir = _dry_model(stage, ref_dir)
    else:
        gguf = res.part("assemble", assemble, stage, stage / "gguf")
        model_dir = lookup("smollm2-135m").location()
        if gguf is not None and not (model_dir / "config.json").is_file():
            res.part("convert", import_gguf, gguf, model_dir, log=print)
        res.figures["gguf_sha256_ok"] = gguf is not None
    if not (Path(model_dir) / "config.json").is_file():
        return common.finish(res, out)
    ref = torch.load(ref_dir / "ref.pt", weights_only=False)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = res.part(f"load_{dtype}", load_model, model_dir, dtype=dtype, device=device)
        got = None if loaded is None else res.part(f"logits_{dtype}", compare_logits, loaded, ref, dtype)
        if got is not None:
            res.figures[got["dtype"]] = got
    fp32 = res.figures.get("float32")
    if fp32 is not None:  # fp32 on CUDA vs the CPU: same weights, different kernels (TF32 off by default)
        res.figures["logits_match"] = fp32["min_argmax_agreement"] >= 0.99 and fp32["worst_rel_l2"] < 1e-3
    return common.finish(res, out)


def _dry_model(stage: Path, ref_dir: Path) -> Path:
    """Dry run: a tiny random Llama saved as a checkpoint, split and staged like the GGUF, then reassembled; the
    CPU reference is its own logits taken now (the comparison runs the same code as on CUDA)."""
    shutil.rmtree(stage, ignore_errors=True)
    model = common.tiny_causal_lm("llama", seed=3)
    model_dir, root = stage / "work" / "model", stage / "work" / "root"
    model.save_pretrained(model_dir)
    (root / ".gpu").mkdir(parents=True)
    manifest = prepare.split_file(model_dir / "model.safetensors", root, 1 << 15)
    (stage / "g").mkdir(parents=True)
    for f in [p["dir"] + "/" + p["file"] for p in manifest["parts"]] + ["parts.json"]:
        shutil.copyfile(root / ".gpu" / f, stage / "g" / Path(f).name)
    (model_dir / "model.safetensors").unlink()
    shutil.move(str(assemble(stage, stage / "work" / "re")), model_dir / "model.safetensors")
    ref_dir.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        prompts = [prepare.ref_row(model, f"p{k}", ids) for k, ids in enumerate([[5, 9, 17, 33, 2, 8], [1, 2, 3, 4]])]
    torch.save({"prompts": prompts}, ref_dir / "ref.pt")
    return model_dir
