"""Learning-rate schedules the distillers share, and resuming a warmup-stable-decay run.

Every distillation pass from ``--init`` restarted a warm-up and cosine: the peak rate came back, the held-out
agreement dipped for about a quarter of the pass, and AdamW's moments started from zero. With ``--schedule wsd``
(``common.warmup_stable_decay``; Hägele et al. 2024) a run holds the peak rate, decays only over its last ``decay``
share, and keeps the model and AdamW's state **as the decay starts** in ``resume.pt`` beside the decayed weights it
saves. ``--resume DIR`` loads that state and goes on at the stable rate with no warm-up and DIR's vocabulary, so runs
spread over several sittings train as one long run, each ending in its own decay.

Invariants: ``resume.pt`` holds float32 CPU tensors only (``torch.load(weights_only=True)`` reads it), the state is
taken before any decayed step, and a file this cannot use is one ``RetrospecError`` line, before training starts.
A state records the identity of the target it was trained for (``target``: ``identity.target_record``; or, in older
states, the run's manifest's ``target_identity``): resuming it for another target is refused (``identity.same_model``:
a bfloat16 or float16 copy of the same weights is the same target).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..errors import RetrospecError
from ..identity import model_identity, same_model
from ..models.files import first_line, read_json

SCHEDULES = ("cosine", "wsd")
RESUME_FILE = "resume.pt"
RESUME_FORMAT = "retrospec-distill-resume"


def check_schedule(cfg, init_flag: str = "--init") -> None:
    """``cfg.schedule`` / ``decay`` / ``resume`` (before anything loads): ``--resume`` needs ``--schedule wsd``, no
    ``init_flag`` and a ``resume.pt`` in its directory."""
    if cfg.schedule not in SCHEDULES or not 0 < cfg.decay <= 1 or cfg.decay + cfg.warmup > 1:
        raise RetrospecError(f"need --schedule in {', '.join(SCHEDULES)} and --decay in (0, 1 - warm-up share], got "
                             f"{cfg.schedule!r} and {cfg.decay}")
    if cfg.resume is None:
        return
    if cfg.init or cfg.schedule != "wsd":
        raise RetrospecError(f"--resume goes on from a --schedule wsd run's stable state: give --schedule wsd and no "
                             f"{init_flag}")
    if not (Path(cfg.resume) / RESUME_FILE).is_file():
        raise RetrospecError(f"--resume {cfg.resume}: no {RESUME_FILE} there (only a run with --schedule wsd writes "
                             "one)")


def stable_state(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens_total: int,
                 target: dict | None = None) -> dict:
    """What ``resume.pt`` holds: the model's weights and AdamW's state (float32, on the CPU), tokens trained so far
    along the chain of resumed runs, and ``target``: the record (``identity.target_record``) of the model being
    distilled for."""
    def cpu(v):
        return v.detach().float().cpu().clone() if torch.is_tensor(v) and v.is_floating_point() else v

    opt_state = opt.state_dict()
    return {"format": RESUME_FORMAT, "model": {k: cpu(v) for k, v in model.state_dict().items()},
            "optimizer": {"state": {i: {k: cpu(v) for k, v in st.items()} for i, st in opt_state["state"].items()},
                          "param_groups": opt_state["param_groups"]},
            "tokens_total": tokens_total, **({"target": target} if target is not None else {})}


def save_stable_state(state: dict, directory: Path) -> None:
    torch.save(state, Path(directory) / RESUME_FILE)


def load_stable_state(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg, manifest: str,
                      target: torch.nn.Module | None = None) -> dict:
    """Load ``path``/``resume.pt`` into ``model`` and ``opt`` (betas and weight decay from ``cfg``); returns the
    previous run's manifest (``path``/``manifest``) with ``tokens_total``, or one ``RetrospecError`` line for a file
    this cannot use or (with ``target``) a state trained for another target."""
    file = Path(path) / RESUME_FILE
    corrupt = f"corrupt resume state {file}"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, truncated, not a torch file
        raise RetrospecError(f"{corrupt}: {first_line(exc)}") from None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise RetrospecError(f"{corrupt}: not a {RESUME_FORMAT} file")
    previous = read_json(Path(path) / manifest, corrupt)
    if target is not None:
        check_state_target(state, previous, path, target)
    try:
        model.load_state_dict(state["model"], strict=True)
        opt.load_state_dict(state["optimizer"])
        tokens_total = int(state.get("tokens_total", previous.get("tokens_seen", 0)))
    except Exception as exc:  # missing entries, another model's tensors, optimiser groups not matching
        raise RetrospecError(f"{corrupt}: {first_line(exc)}") from None
    for group in opt.param_groups:
        group["betas"] = tuple(getattr(cfg, "betas", group["betas"]))
        group["weight_decay"] = cfg.weight_decay if group["params"][0].dim() >= 2 else 0.0
    return {**previous, "tokens_total": tokens_total}


def check_state_target(state: dict, previous: dict, path: str, target: torch.nn.Module) -> None:
    """Refuse a state whose recorded target (``state["target"]``, else the manifest's ``target_identity``) is not
    ``target``; a state that records none is left to the caller's vocabulary checks."""
    recorded = state.get("target") if state.get("target") is not None else previous.get("target_identity")
    if recorded is None:
        return
    if not same_model(recorded, target):
        where = recorded.get("path") if isinstance(recorded, dict) else None
        fingerprint = recorded.get("fingerprint") if isinstance(recorded, dict) else None
        raise RetrospecError(f"--resume {path} was trained for another target ({where or 'path unrecorded'}, "
                             f"fingerprint {fingerprint}); the target given has fingerprint "
                             f"{model_identity(target)['fingerprint']}; resume it with the target it was trained for")


def resume_run(cfg, model: torch.nn.Module, opt: torch.optim.Optimizer, manifest: str, log=print,
               target: torch.nn.Module | None = None):
    """A distiller's start under ``cfg.resume`` (none: ``(cfg, None, 0)``): the state loaded into ``model`` and
    ``opt`` (refused if trained for another ``target``); returns (``cfg`` with no warm-up, the previous run's
    manifest, tokens trained before this run). With ``precision`` ``auto``, the run keeps the precision the one it
    resumes measured: timing it again could choose the other on a busy machine, and a chain would no longer train
    as one run (nor a resumed run give the same weights twice); with ``lr`` None (a distiller's default), its peak
    rate, so the stable phase goes on at the rate it had."""
    if not cfg.resume:
        return cfg, None, 0
    previous = load_stable_state(cfg.resume, model, opt, cfg, manifest, target)
    log(f"resuming {cfg.resume}: {previous['tokens_total']:,} tokens trained before, its stable weights and optimiser "
        "state")
    kept = {}
    if getattr(cfg, "precision", None) == "auto" and previous.get("precision") in ("float32", "bfloat16"):
        kept["precision"] = previous["precision"]
        log(f"precision {kept['precision']}, as the run resumed (--precision to choose another)")
    rate = (previous.get("config") or {}).get("lr")
    if hasattr(cfg, "lr") and cfg.lr is None and isinstance(rate, (int, float)) and rate > 0:
        kept["lr"] = float(rate)
    return replace(cfg, warmup=0.0, **kept), previous, previous["tokens_total"]  # the stable rate from the first step


def chain_fields(previous: dict | None, before: int, tokens_seen: int) -> dict:
    """The manifest's ``tokens_total`` and, after a resume, ``resumed_recipe`` (the run this one went on from,
    nesting its own predecessors)."""
    return {"tokens_total": before + tokens_seen, **({"resumed_recipe": previous} if previous is not None else {})}
