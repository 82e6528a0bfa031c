"""Data-parallel distillation (``train.distributed``): two processes on the gloo backend train as one process does on
the same global batches. A tiny saved target, its corpus, and one pass of ``longspec-distill`` (wsd, so the resume
state is written too) and of ``draft-distill``, once in this process and once in two forked processes (the launcher's
environment variables set as torchrun sets them): the rows each process computed are the one-process batch split in
rank order (with the same random positions), the losses and final weights match one process's, the two processes
hold identical weights, and only rank 0 logs and writes. The user errors of a launch (a global batch the processes
cannot share, ``--follow``) are one line each."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from retrospec.errors import RetrospecError
from retrospec.train import draft_distill, longspec_distill
from retrospec.train.distributed import Dist
from retrospec.train.draft_distill import DraftDistillConfig
from retrospec.train.longspec_distill import DistillConfig

pytestmark = pytest.mark.usefixtures("single_thread")

WORLD = 2


def configs(target: str, draft: str, corpus: str, out: Path) -> tuple[DistillConfig, DraftDistillConfig]:
    """One pass of each distiller over the tiny corpus's training records (42 to 45 tokens each): batches of 2 rows
    and, for the longest, of 1 (one process then has no rows)."""
    common = dict(target=target, corpus=corpus, max_len=48, batch_tokens=88, heldout=0.3, eval_records=2,
                  precision="float32")
    return (DistillConfig(**common, out=str(out / "block"), draft_vocab=24, curve=(40,), max_positions=256,
                          storage=None, schedule="wsd", decay=0.5),
            DraftDistillConfig(**common, out=str(out / "draft"), init=draft, vocab=40, curve=(60,)))


def run_both(target, cfgs) -> dict:
    """Both distillers, recording per optimizer step the rows this process's ``distill_loss`` saw (none when its
    slice of the batch was empty) and the loss returned; the final parameters; log lines; calls to save."""
    rec: dict = {}
    runs = (("block", longspec_distill, longspec_distill.distill_longspec, "save_block"),
            ("draft", draft_distill, draft_distill.distill_draft, "save_draft"))
    for (name, module, run, save), cfg in zip(runs, cfgs):
        steps, seen, logs, saves, final = [], [], [], [], []
        loss_fn, step_fn, save_fn = module.distill_loss, module.optimizer_step, getattr(module, save)

        def loss(*args, loss_fn=loss_fn, name=name):
            ids = args[2] if name == "block" else args[4]
            seen.append((ids.clone(), args[3].clone() if name == "block" else None))
            return loss_fn(*args)

        def step(opt, *args, step_fn=step_fn, **kw):
            value = step_fn(opt, *args, **kw)
            steps.append({"loss": value, "ids": [s[0] for s in seen], "positions": [s[1] for s in seen]})
            seen.clear()
            final[:] = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
            return value

        with (mock.patch.object(module, "distill_loss", loss), mock.patch.object(module, "optimizer_step", step),
              mock.patch.object(module, save, lambda *a, save_fn=save_fn, **k: (saves.append(1), save_fn(*a, **k)))):
            manifest = run(cfg, log=logs.append, target=target)
        rec[name] = {"steps": steps, "final": final, "logs": logs, "saves": len(saves), "manifest": manifest}
    return rec


def worker(rank: int, port: int, root: str, paths: tuple[str, str, str]) -> None:
    """One of the launched processes (forked: no second import of torch and transformers; one thread, so no OpenMP
    pool the parent may have started is used): the environment torchrun gives it, then both distillers."""
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.save(run_both(None, configs(*paths, Path(root) / "ddp")), Path(root) / f"rank{rank}.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_and_one(worker, paths: tuple, tmp_path, one_process):
    """Start ``worker`` on WORLD processes, run ``one_process()`` here while they start, wait for them (120 s at most);
    -> (its result, each rank's saved record)."""
    procs = mp.start_processes(worker, args=(free_port(), str(tmp_path), paths), nprocs=WORLD, join=False,
                               start_method="fork")
    try:
        one = one_process()
        deadline = time.monotonic() + 120
        while not procs.join(timeout=5):
            assert time.monotonic() < deadline, "the two processes did not finish"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    return one, [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_two_processes_train_as_one(saved_models, tmp_path):
    from retrospec.models import load_model
    from retrospec.models.longspec import load_longspec

    from test_longspec_distill import tiny_corpus

    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    paths = (str(saved_models.target), str(saved_models.draft), str(tmp_path / "corpus"))
    one, ranks = two_and_one(worker, paths, tmp_path, lambda: run_both(target, configs(*paths, tmp_path / "one")))
    alone = 0
    for name in ("block", "draft"):
        ref, r0, r1 = one[name], ranks[0][name], ranks[1][name]
        assert len(ref["steps"]) >= 3 and len(r0["steps"]) == len(r1["steps"]) == len(ref["steps"])
        for k, want in enumerate(ref["steps"]):
            (whole,), parts = want["ids"], [r["steps"][k] for r in (r0, r1)]
            # each process computed its contiguous rows of the batch one process drew, with the same draws
            assert torch.equal(torch.cat([t for p in parts for t in p["ids"]]), whole), (name, k)
            assert [len(t) for p in parts for t in p["ids"]] in ([len(whole) // 2, len(whole) - len(whole) // 2],
                                                                 [len(whole)])
            if name == "block":
                assert torch.equal(torch.cat([t for p in parts for t in p["positions"]]), want["positions"][0])
            alone += len(whole) == 1
            # the loss every process reports is the global one: the one-process loss of the batch
            assert parts[0]["loss"] == parts[1]["loss"]
            assert parts[0]["loss"] == pytest.approx(want["loss"], rel=1e-4), (name, k)
        assert all(torch.equal(a, b) for a, b in zip(r0["final"], r1["final"]))  # the processes stay equal
        assert len(r0["final"]) == len(ref["final"])
        for a, b in zip(r0["final"], ref["final"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        # rank 0 logs and saves once; rank 1 neither
        assert r0["saves"] == 1 and r0["logs"] and r1["saves"] == 0 and r1["logs"] == []
        m0, m1 = r0["manifest"], ref["manifest"]
        assert m0["processes"] == WORLD and "processes" not in m1
        assert (m0["steps"], m0["tokens_seen"]) == (m1["steps"], m1["tokens_seen"])
        assert [c.get("loss", 0) for c in m0["curve"]] == pytest.approx([c.get("loss", 0) for c in m1["curve"]],
                                                                        rel=1e-4)
    assert alone > 0  # some batches had one row: the first process computed nothing of them
    # the artefacts rank 0 wrote: the block and its resume state hold the one-process weights
    block, ref_block = load_longspec(tmp_path / "ddp" / "block", target), load_longspec(tmp_path / "one" / "block",
                                                                                       target)
    torch.testing.assert_close(block.state_dict(), ref_block.state_dict(), rtol=1e-4, atol=1e-6)
    state, ref_state = (torch.load(tmp_path / d / "block" / "resume.pt", weights_only=True) for d in ("ddp", "one"))
    torch.testing.assert_close(state["model"], ref_state["model"], rtol=1e-4, atol=1e-6)
    assert load_model(tmp_path / "ddp" / "draft", role="draft").vocab_map.tolist() == \
        load_model(tmp_path / "one" / "draft", role="draft").vocab_map.tolist()


def test_rows_split_every_batch_in_rank_order():
    for n in range(7):
        for world in (1, 2, 3):
            parts = [list(range(n))[Dist(rank, world).rows(n)] for rank in range(world)]
            assert sum(parts, []) == list(range(n)) and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_launch_refuses_what_it_cannot_share(cli, saved_models, tmp_path, monkeypatch):
    (tmp_path / "c").mkdir()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = DistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "c"), out=str(tmp_path / "b"),
                        batch_tokens=4097)
    with pytest.raises(RetrospecError, match="--batch-tokens 4097 .* divisible by 2"):
        longspec_distill.check_config(cfg)
    with pytest.raises(RetrospecError, match="--follow runs in one process"):
        longspec_distill.check_config(DistillConfig(**{**cfg.__dict__, "batch_tokens": 4096, "follow": True,
                                                       "seconds": 1.0}))
    cli("train", "draft-distill", "--target", saved_models.target, "--corpus", tmp_path / "c", "--init",
        saved_models.draft, "--out", tmp_path / "d", "--batch-tokens", 999).assert_user_error("--batch-tokens 999",
                                                                                             "divisible by 2")
    assert not (tmp_path / "b").exists() and not (tmp_path / "d").exists()
