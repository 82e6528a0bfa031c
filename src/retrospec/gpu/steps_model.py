"""Steps ``stage`` and ``model``: the real model across, in parts, and its logits checked against the CPU's.

``stage``: reports which GGUF parts sit in the staging folder (``<stage>/g``; the prelude of every call copies the
carried part there) and whether each one's SHA-256 matches ``parts.json``.

``model``: concatenates the parts in order into the GGUF (SHA-256 of the whole checked), converts it with the
project's own ``models.gguf.import_gguf`` into ``$RETROSPEC_HOME/models/smollm2-135m`` (so the named model
resolves there like here), loads it on CUDA in float32 and bfloat16, and compares with the CPU reference
(``.gpu/ref/ref.pt``): the last position's logits (max |diff|, relative L2), argmax agreement at every position.
A missing part is a clear error naming the calls to redo (a cold machine lost the staging folder).

Dry run: the same code on a small file split here into parts (a tiny random model's safetensors stand in for
the GGUF; conversion is skipped: it needs a real GGUF), the logits check on that tiny model against a reference
taken a moment earlier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..errors import RetrospecError
from . import common


def staged(stage: Path) -> dict:
    """``{"manifest": parts.json or None, "present": [...], "missing": [...], "bad": [...]}``."""
    from .prepare import sha256

    g = stage / "g"
    path = g / "parts.json"
    if not path.is_file():
        return {"manifest": None, "present": [], "missing": ["parts.json"], "bad": []}
    manifest = json.loads(path.read_text())
    present, missing, bad = [], [], []
    for p in manifest["parts"]:
        f = g / p["file"]
        if not f.is_file():
            missing.append(p["dir"])
        elif f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            bad.append(p["dir"])
        else:
            present.append(p["dir"])
    return {"manifest": manifest, "present": present, "missing": missing, "bad": bad}


def assemble(stage: Path, out: Path) -> Path:
    from .prepare import sha256

    state = staged(stage)
    if state["manifest"] is None or state["missing"] or state["bad"]:
        raise RetrospecError(f"GGUF parts missing {state['missing']} or damaged {state['bad']} in {stage / 'g'}: the "
                             "machine went cold between calls; redo the plan from call 1 (retrospec gpu plan)")
    m = state["manifest"]
    target = out / m["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as f:
        for p in m["parts"]:
            with (stage / "g" / p["file"]).open("rb") as part:
                shutil.copyfileobj(part, f)
    if sha256(target) != m["sha256"]:
        raise RetrospecError(f"{target}: SHA-256 differs from parts.json after reassembly")
    return target


@torch.inference_mode()
def compare_logits(loaded, ref: dict, device: torch.device, dtype: torch.dtype) -> dict:
    model = loaded.model
    rows = []
    for p in ref["prompts"]:
        logits = model(torch.tensor([p["ids"]], device=device)).logits[0].float().cpu()  # [T, V]
        last = p["last"].float()
        diff = (logits[-1] - last).abs().max().item()
        rel = ((logits[-1] - last).norm() / last.norm()).item()
        agree = (logits.argmax(-1) == p["argmax"]).float().mean().item()
        rows.append({"prompt": p["name"], "tokens": len(p["ids"]), "max_abs_diff": diff, "rel_l2": rel,
                     "argmax_agreement": agree})
    return {"dtype": str(dtype).replace("torch.", ""), "rows": rows,
            "worst_rel_l2": max(r["rel_l2"] for r in rows), "min_argmax_agreement": min(r["argmax_agreement"]
                                                                                        for r in rows)}


def run_stage(out: Path, dry_run: bool, budget_s: float) -> int:
    res, device, budget = common.start("stage", dry_run)
    budget.seconds = budget_s
    state = staged(common.stage_root())
    res.figures = {k: v for k, v in state.items() if k != "manifest"} | {
        "parts": len(state["manifest"]["parts"]) if state["manifest"] else None}
    if state["missing"] or state["bad"]:
        res.notes.append(f"not yet staged: {state['missing']}, damaged: {state['bad']}")
    return common.finish(res, out, budget)


def run_model(out: Path, dry_run: bool, budget_s: float, ref_dir: Path = Path(".gpu/ref")) -> int:
    from ..models import load_model
    from ..models.named import lookup

    res, device, budget = common.start("model", dry_run)
    budget.seconds = budget_s
    stage = common.stage_root()
    if dry_run:  # a stage and reference of its own: a dry run never touches the real ones
        stage, ref_dir = stage / "dry-stage", stage / "dry-stage" / "ref"
        model_dir = _dry_model(stage, ref_dir)
    else:
        gguf = res.part("assemble", assemble, stage, stage / "gguf")
        model_dir = lookup("smollm2-135m").location()
        if gguf is not None and not (model_dir / "config.json").is_file():
            from ..models.gguf import import_gguf

            res.part("convert", import_gguf, gguf, model_dir, log=print)
        res.figures["gguf_sha256_ok"] = gguf is not None
    if not (Path(model_dir) / "config.json").is_file():
        return common.finish(res, out, budget)
    ref = torch.load(ref_dir / "ref.pt", weights_only=False)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = res.part(f"load_{dtype}", load_model, model_dir, dtype=dtype, device=device)
        if loaded is not None:
            got = res.part(f"logits_{dtype}", compare_logits, loaded, ref, device, dtype)
            if got is not None:
                res.figures[got["dtype"]] = got
    fp32 = res.figures.get("float32")
    if fp32 is not None:  # fp32 on CUDA vs the CPU: same weights, different kernels (TF32 off by default)
        res.figures["logits_match"] = fp32["min_argmax_agreement"] >= 0.99 and fp32["worst_rel_l2"] < 1e-3
    return common.finish(res, out, budget)


def _dry_model(stage: Path, ref_dir: Path) -> Path:
    """Dry run: a tiny random Llama saved as a checkpoint, split and staged like the GGUF, then reassembled; the
    CPU reference is its own logits taken now (the comparison runs the same code as on CUDA)."""
    from . import prepare

    shutil.rmtree(stage, ignore_errors=True)
    work = stage / "work"
    model = common.tiny_causal_lm("llama", seed=3)
    src = work / "src"
    model.save_pretrained(src)
    root = work / "root"
    (root / ".gpu").mkdir(parents=True)
    manifest = prepare.split_file(src / "model.safetensors", root, 1 << 15)
    g = stage / "g"
    shutil.rmtree(g, ignore_errors=True)
    g.mkdir(parents=True)
    for p in manifest["parts"]:
        shutil.copyfile(root / ".gpu" / p["dir"] / p["file"], g / p["file"])
    shutil.copyfile(root / ".gpu" / "parts.json", g / "parts.json")
    model_dir = work / "model"
    shutil.copytree(src, model_dir)
    (model_dir / "model.safetensors").unlink()
    shutil.move(str(assemble(stage, work / "re")), model_dir / "model.safetensors")
    ref_dir.mkdir(parents=True, exist_ok=True)
    ids = [[5, 9, 17, 33, 2, 8], [1, 2, 3, 4]]
    prompts = []
    with torch.inference_mode():
        for k, i in enumerate(ids):
            logits = model(torch.tensor([i])).logits[0].float()
            prompts.append({"name": f"p{k}", "ids": i, "last": logits[-1].clone(), "argmax": logits.argmax(-1)})
    torch.save({"prompts": prompts}, ref_dir / "ref.pt")
    return model_dir
