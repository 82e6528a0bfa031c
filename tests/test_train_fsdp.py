"""The distillers with the frozen target sharded (``--fsdp``, ``train.fsdp``): two processes on the gloo backend,
FSDP2 over a CPU device mesh, train as one process does on the same global batches. The tiny saved target, corpus
and distiller runs of ``test_train_ddp`` (``longspec-distill`` with wsd, ``draft-distill``), with ``fsdp=True`` in
the two forked processes: each distiller shards its own target (each process holds half of the layers' elements,
as DTensor shards); the rows each process computed are the one-process batch split in rank order (a process with no
rows of a batch runs the sharded target alone: its collectives need every process); the losses and final weights
match one process's; rank 0's artefacts load as one process's do. In the same processes: both distillers again on
a target passed in (sharded on private copies: the same losses, the caller's model left as it was), the sharded
forward equal to the whole model's, and ``load_model`` no longer returning the distillers' sharded targets."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch

from retrospec.train import draft_distill, longspec_distill
from retrospec.train.distributed import Dist
from retrospec.train.fsdp import local_share

from test_train_ddp import WORLD, configs, run_both, two_and_one

pytestmark = pytest.mark.usefixtures("single_thread")


def caller_unchanged(model, before: dict) -> bool:
    """``model`` holds ``before`` (its state dict), as plain tensors in modules FSDP did not take over."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return (not any(isinstance(p, DTensor) for p in model.parameters())
            and not any(isinstance(m, FSDPModule) for m in model.modules())
            and model.state_dict().keys() == before.keys()
            and all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))


def sharding_check(target_path: str) -> dict:
    """Shard a target passed in (``private``): this process's share of its layers' elements, the sharded forward
    against the caller's, and whether the caller's model changed."""
    from torch.distributed.tensor import DTensor

    from retrospec.models import load_model
    from retrospec.models.loading import as_module
    from retrospec.train.distributed import setup
    from retrospec.train.fsdp import shard_target

    loaded = load_model(target_path)  # the distillers' own sharded targets left the cache: this one is whole
    model = as_module(loaded)
    fresh = not any(isinstance(p, DTensor) for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    teacher = shard_target(loaded, setup("cpu", fsdp=True), private=True)
    ids = torch.arange(2, 22).reshape(2, 10)
    with torch.no_grad():
        got = teacher.get_decoder()(input_ids=ids).last_hidden_state
        want = model.get_decoder()(input_ids=ids).last_hidden_state
    mine, total = local_share(teacher)
    layers = sum(p.numel() for p in model.get_decoder().layers.parameters())
    shards = {type(p.to_local()) for p in teacher.get_decoder().layers.parameters()}
    return {"fresh": fresh, "mine": mine, "total": total, "layers": layers, "plain_shards": shards == {torch.Tensor},
            "same_forward": torch.equal(got, want),
            "caller_same": caller_unchanged(model, before),
            "shares_whole": teacher.get_input_embeddings() is model.get_input_embeddings()}


def worker(rank: int, port: int, root: str, paths: tuple[str, str, str]) -> None:
    """One of the launched processes (as in ``test_train_ddp.worker``), both distillers with ``fsdp``."""
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    shares = []

    def spy(module):
        """Record, per distiller, whether it sharded a private copy and this process's share of the target."""
        real = module.shard_target

        def shard(target, dist, private):
            out = real(target, dist, private)
            shares.append((private, *local_share(out)))
            return out
        return mock.patch.object(module, "shard_target", shard)

    with spy(longspec_distill), spy(draft_distill):
        rec = run_both(None, [replace(c, fsdp=True) for c in configs(*paths, Path(root) / "fsdp")])
        rec["shares"], rec["sharding"] = list(shares), sharding_check(paths[0])
        # the same runs on a target passed in: sharded on private copies, the caller's model left as it was
        from retrospec.models import load_model

        caller = load_model(paths[0])
        before = {k: v.clone() for k, v in caller.model.state_dict().items()}
        shares.clear()
        given = run_both(caller, [replace(c, fsdp=True) for c in configs(*paths, Path(root) / f"given{rank}")])
    rec["given"] = {"losses": {n: [s["loss"] for s in given[n]["steps"]] for n in ("block", "draft")},
                    "shares": shares, "caller_same": caller_unchanged(caller.model, before)}
    torch.save(rec, Path(root) / f"rank{rank}.pt")


def test_two_processes_with_a_sharded_target_train_as_one(saved_models, tmp_path):
    from retrospec.models import load_model
    from retrospec.models.longspec import load_longspec

    from test_longspec_distill import tiny_corpus

    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    paths = (str(saved_models.target), str(saved_models.draft), str(tmp_path / "corpus"))
    # the one-process run while they start (fsdp asked for, and with one process nothing to shard)
    one, ranks = two_and_one(worker, paths, tmp_path, lambda: run_both(
        target, [replace(c, fsdp=True) for c in configs(*paths, tmp_path / "one")]))
    idle = 0
    for name in ("block", "draft"):
        ref, r0, r1 = one[name], ranks[0][name], ranks[1][name]
        assert len(ref["steps"]) >= 3 and len(r0["steps"]) == len(r1["steps"]) == len(ref["steps"])
        for k, want in enumerate(ref["steps"]):
            (whole,), parts = want["ids"], [r["steps"][k] for r in (r0, r1)]
            # each process computed its contiguous rows of the batch one process drew, with the same draws
            assert torch.equal(torch.cat([t for p in parts for t in p["ids"]]), whole), (name, k)
            sizes = [len(t) for p in parts for t in p["ids"]]
            assert sizes in ([len(whole) // 2, len(whole) - len(whole) // 2], [len(whole)]), (name, k)
            idle += len(whole) == 1
            if name == "block":
                assert torch.equal(torch.cat([t for p in parts for t in p["positions"]]), want["positions"][0])
            assert parts[0]["loss"] == parts[1]["loss"]
            assert parts[0]["loss"] == pytest.approx(want["loss"], rel=1e-4), (name, k)
        assert all(torch.equal(a, b) for a, b in zip(r0["final"], r1["final"]))
        assert len(r0["final"]) == len(ref["final"])
        for a, b in zip(r0["final"], ref["final"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert r0["saves"] == 1 and r0["logs"] and r1["saves"] == 0 and r1["logs"] == []
        m0, m1 = r0["manifest"], ref["manifest"]
        assert (m0["processes"], m0["fsdp"]) == (WORLD, "target") and "processes" not in m1 and "fsdp" not in m1
        assert (m0["steps"], m0["tokens_seen"]) == (m1["steps"], m1["tokens_seen"])
        assert [c.get("loss", 0) for c in m0["curve"]] == pytest.approx([c.get("loss", 0) for c in m1["curve"]],
                                                                        rel=1e-4)
    assert idle > 0  # some batches had one row: one process ran the target on none
    # the artefacts rank 0 wrote load as one process's do, with its weights
    block, ref_block = (load_longspec(tmp_path / d / "block", target) for d in ("fsdp", "one"))
    torch.testing.assert_close(block.state_dict(), ref_block.state_dict(), rtol=1e-4, atol=1e-6)
    state, ref_state = (torch.load(tmp_path / d / "block" / "resume.pt", weights_only=True) for d in ("fsdp", "one"))
    assert state.keys() == ref_state.keys()
    torch.testing.assert_close(state["model"], ref_state["model"], rtol=1e-4, atol=1e-6)
    draft, ref_draft = (load_model(tmp_path / d / "draft", role="draft") for d in ("fsdp", "one"))
    assert draft.vocab_map.tolist() == ref_draft.vocab_map.tolist()
    torch.testing.assert_close(draft.model.state_dict(), ref_draft.model.state_dict(), rtol=1e-3, atol=1e-4)
    # a target passed in: sharded on a private copy, half of its layers' elements on each process, the same forward
    for r in ranks:
        s = r["sharding"]
        assert s["fresh"] and s["plain_shards"] and s["same_forward"] and s["caller_same"] and s["shares_whole"]
        assert s["total"] == s["layers"] and s["mine"] == s["layers"] // WORLD
        # each distiller sharded its own target in place, the layers split in halves; a target passed in: a copy
        assert r["shares"] == [(False, s["layers"] // WORLD, s["layers"])] * 2
        g = r["given"]
        assert g["shares"] == [(True, s["layers"] // WORLD, s["layers"])] * 2 and g["caller_same"]
        assert g["losses"] == {n: [st["loss"] for st in r[n]["steps"]] for n in ("block", "draft")}


def test_a_process_without_rows_runs_the_sharded_target_alone():
    """Rank 0 of 2 has no rows of a one-row batch: it computes no loss; with ``fsdp`` the target's forward runs on the
    batch's first row (no gradient), for the collectives of its sharded layers. The manifest names the sharding."""
    mask = torch.tensor([[1, 1, 0]])
    for fsdp in (False, True):
        calls = []
        target = lambda m: calls.append(("target", m.tolist(), torch.is_grad_enabled()))  # noqa: E731
        out = Dist(0, 2, fsdp=fsdp).local_loss(lambda m: calls.append(("loss", m)), mask, mask, target=target)
        assert float(out) == 0.0 and not out.requires_grad
        assert calls == ([("target", [[1, 1, 0]], False)] if fsdp else [])
    assert Dist(fsdp=True).manifest() == {} and Dist(0, 2).manifest() == {"processes": 2}
    assert Dist(0, 2, fsdp=True).manifest() == {"processes": 2, "fsdp": "target"}
