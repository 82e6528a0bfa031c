"""The GPU runbook (``tools.gpu``, development tooling outside the library): the plan fits the device limits, the
model's parts reassemble byte for byte, and every step's dry run (CPU, tiny models) runs through the same code as on
CUDA and reports, so the runbook never rots before a GPU session launches it. No timing is asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from retrospec.errors import RetrospecError
from tools.gpu import plan, prepare, report, slim, steps_model
from tools.gpu.cli import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_thread")


def _git_root(tmp_path: Path, tracked_bytes: int = 1000) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    (root / ".gitignore").write_text("/.gpu/\n/.whl/\n")
    (root / "tracked.bin").write_bytes(os.urandom(tracked_bytes))
    return root


def test_the_plan_of_this_repository_fits_every_device_limit(monkeypatch):
    """As 'make gpu' makes it: slim (simulated: this checkout's index is left alone), then the parts cut fresh."""
    heavy = slim.heavy_files(ROOT)
    whole = plan.travelling_bytes(ROOT)
    assert plan.check_plan(plan.build_plan(ROOT, whole, prepared=False), whole)  # not slim: too many calls
    monkeypatch.setattr(plan, "slimmed", lambda root: heavy)
    tree = whole - sum((ROOT / p).stat().st_size for p in heavy)
    calls = plan.build_plan(ROOT, tree, prepared=False)  # as a fresh 'make gpu' cuts the parts
    assert plan.check_plan(calls, tree) == []
    assert [c.step for c in calls if not c.optional] == ["stage", "model", "train"]  # the model in two calls
    for c in calls:  # each step carries the bundled weights it loads
        for w in plan.SPECS[c.step].weights:
            assert any(p.startswith(f"{plan.ZOO}/{w}/") for p in c.carry) == any(h.startswith(f"{plan.ZOO}/{w}/")
                                                                                 for h in heavy)
    for c in calls:
        assert len(c.command) <= plan.COMMAND_MAX and len(c.carry) <= plan.CARRY_MAX
        assert tree + c.carry_bytes <= plan.TRAVEL_MAX and c.timeout_s <= plan.CALL_MAX_S
        assert f"step {c.step} " in c.command and "--out $OUT" in c.command
        assert len(c.returns.split(",")) <= plan.FILES_BACK
    parts = [p for c in calls for p in c.carry if p.startswith(".gpu/p")]
    assert parts == sorted(parts) and len(parts) == len(set(parts))  # each part once, in order
    steps = [c.step for c in calls]
    with_parts = [i for i, c in enumerate(calls) if any(p.startswith(".gpu/p") for p in c.carry)]
    assert with_parts[-1] == steps.index("model")  # the model step takes the last part: all are staged by then
    assert plan.expected_minutes(calls) <= plan.SESSION_S / 60
    assert all(c.optional for c in calls[steps.index("train") + 1:])  # training gets the time; the rest if any


def _committed_zoo(root: Path) -> None:
    zoo = root / plan.ZOO / "m"
    zoo.mkdir(parents=True)
    (zoo / "model.safetensors").write_bytes(os.urandom(slim.MIN_BYTES + 10))
    (zoo / "config.json").write_text("{}")
    for cmd in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "zoo"]):
        subprocess.run(["git", *cmd], cwd=root, check=True)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, capture_output=True,
                          text=True)


def test_slim_keeps_heavy_bundled_files_out_of_the_tree_until_undone(tmp_path):
    root = _git_root(tmp_path)
    _committed_zoo(root)
    big = f"{plan.ZOO}/m/model.safetensors"
    packed = f"{slim.CORPUS}/t/ids.u16.xz"  # a packed corpus stays behind whatever its size
    (root / packed).parent.mkdir(parents=True)
    (root / packed).write_bytes(b"ids")
    _git(root, "add", packed)
    _git(root, "commit", "-qm", "corpus")
    data = (root / big).read_bytes()
    hooks = root / ".git" / "hooks"
    assert slim.slim(root) == [packed, big] and slim.slim(root) == [packed, big]  # idempotent
    assert (root / big).read_bytes() == data  # the file on disk is untouched
    sent = _git(root, "ls-files", "--cached", "--others", "--exclude-standard").stdout.split()
    assert big not in sent and packed not in sent and f"{plan.ZOO}/m/config.json" in sent  # only these stay behind
    assert plan.travelling_bytes(root) < slim.MIN_BYTES
    assert _git(root, "check-ignore", "-q", big).returncode == 0  # so a call can carry it
    refused = _git(root, "commit", "-qm", "would delete the weights")
    assert refused.returncode != 0 and "make gpu-done" in refused.stderr
    shutil.rmtree(root / ".gpu", ignore_errors=True)  # the record lives in git's own directory
    assert slim.unslim(root) == [packed, big] and slim.unslim(root) == []
    assert _git(root, "status", "--porcelain").stdout == ""  # index and exclude as before
    assert not (hooks / "pre-commit").exists() and slim.slimmed(root) == []
    (hooks / "pre-commit").write_text("#!/bin/sh\nexit 0\n")  # someone's own hook would let a deletion through:
    with pytest.raises(RetrospecError, match="pre-commit exists"):  # refused, and left as it is
        slim.slim(root)
    assert (hooks / "pre-commit").read_text() == "#!/bin/sh\nexit 0\n" and slim.slimmed(root) == []


def test_unslim_restores_staged_edits_and_a_half_done_slim_is_finished(tmp_path):
    root = _git_root(tmp_path)
    _committed_zoo(root)
    big = root / plan.ZOO / "m" / "model.safetensors"
    big.write_bytes(os.urandom(slim.MIN_BYTES + 20))
    _git(root, "add", str(big))  # a staged edit...
    big.write_bytes(os.urandom(slim.MIN_BYTES + 30))  # ...and a newer one on disk (git rm --cached alone refuses)
    before = _git(root, "status", "--porcelain").stdout
    staged = _git(root, "ls-files", "-s").stdout
    real_git = slim._git
    calls = []

    def crash_before_rm(r, *args, **kw):  # killed after the record, before the index changed
        calls.append(args[0])
        if args[0] == "rm":
            raise KeyboardInterrupt
        return real_git(r, *args, **kw)

    slim._git = crash_before_rm
    try:
        with pytest.raises(KeyboardInterrupt):
            slim.slim(root)
    finally:
        slim._git = real_git
    assert "rm" in calls and slim.slimmed(root) == [f"{plan.ZOO}/m/model.safetensors"]
    assert slim.slim(root) == slim.slimmed(root)  # the next run finishes it
    assert f"{plan.ZOO}/m/model.safetensors" not in _git(root, "ls-files").stdout
    exclude = root / ".git" / "info" / "exclude"
    exclude.write_text(exclude.read_text().replace(slim.END + "\n", ""))  # someone cut the block's end
    slim.unslim(root)
    assert _git(root, "ls-files", "-s").stdout == staged and _git(root, "status", "--porcelain").stdout == before
    assert slim.BEGIN not in exclude.read_text() and plan.ZOO not in exclude.read_text()


def test_carry_folders_are_ignored_by_git():
    for rel in (plan.CARRY_DIR, plan.WHEEL_DIR):
        assert subprocess.run(["git", "check-ignore", "-q", f"{rel}/x"], cwd=ROOT).returncode == 0


def test_a_tree_too_big_for_a_part_is_reported(tmp_path):
    calls = plan.build_plan(_git_root(tmp_path), tree=plan.TRAVEL_MAX - plan.MIB)
    assert any("64 MiB" in line for line in plan.check_plan(calls, plan.TRAVEL_MAX - plan.MIB))


def test_parts_reassemble_byte_for_byte_and_a_lost_part_is_named(tmp_path, monkeypatch):
    root = _git_root(tmp_path)
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(10_000))
    manifest = prepare.split_file(src, root, 3000)
    assert [p["bytes"] for p in manifest["parts"]] == [3000, 3000, 3000, 1000]
    assert plan.read_parts(root) == [".gpu/p01", ".gpu/p02", ".gpu/p03", ".gpu/p04"]
    stage = tmp_path / "stage"
    (stage / "g").mkdir(parents=True)
    for p in manifest["parts"]:  # what the prelude's cp does with each carried part
        for f in (root / ".gpu" / p["dir"]).iterdir():
            (stage / "g" / f.name).write_bytes(f.read_bytes())
    assert steps_model.assemble(stage, tmp_path / "out").read_bytes() == src.read_bytes()
    (stage / "g" / manifest["parts"][2]["file"]).unlink()
    assert steps_model.staged(stage)["missing"] == ["p03"]
    with pytest.raises(RetrospecError, match="p03"):
        steps_model.assemble(stage, tmp_path / "out2")
    calls = plan.build_plan(root)
    assert [p for c in calls for p in c.carry if "/p" in p] == plan.read_parts(root)


def test_prepare_makes_the_reference_and_parts_that_fit(tmp_path):
    root = _git_root(tmp_path)
    shared = tmp_path / "shared"
    (shared / "nq_open").mkdir(parents=True)
    (shared / "mbpp_sanitized.jsonl").write_text('{"prompt": "def f():"}\n')
    (shared / "nq_open" / "questions.jsonl").write_text('{"id": "1", "question": "q?", "answers": ["a"]}\n')
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(os.urandom(5000))
    got = prepare.prepare(root, gguf=gguf, target="zoo", shared=shared, log=lambda _m: None)
    assert got["parts"] == 1 and got["missing_wheels"] == list(prepare.WHEELS)
    ref = root / ".gpu" / "ref"
    assert (ref / "ref.pt").is_file() and (ref / "nq_open" / "questions.jsonl").is_file()
    assert plan.check_plan(plan.build_plan(root), plan.travelling_bytes(root)) == []


def test_every_step_dry_runs_and_reports(tmp_path, monkeypatch, capsys):
    """The rehearsal: each step of the plan on CPU with tiny models, then the report of all of them."""
    monkeypatch.setenv("RETROSPEC_GPU_STAGE", str(tmp_path / "stage"))
    out = tmp_path / "out"
    for step in ("tests", "kernels", "costmodel", "stage", "model", "bench", "train"):
        code = main(["step", step, "--dry-run", "--out", str(out / step), "--budget-s", "120"])
        result = json.loads((out / step / f"{step}.json").read_text())
        assert code == 0 and result["errors"] == {}, (step, result["errors"])
        assert result["dry_run"] and result["device"] == "cpu"
    figures = {s: json.loads((out / s / f"{s}.json").read_text())["figures"] for s in ("tests", "model", "bench")}
    assert figures["tests"]["identity_fp32"] and all(figures["tests"]["identity_fp32"].values())
    assert figures["model"]["logits_match"] is True
    cells = figures["bench"]["cells"]
    assert {"code/float32", "long/float32", "code/bfloat16"} <= set(cells)
    assert all(s["lossless"] for s in cells["code/float32"]["summary"])
    assert "longspec" in {s["method"] for s in cells["code/bfloat16"]["summary"]}  # the fp32 block, a bf16 target
    train = json.loads((out / "train" / "train.json").read_text())["figures"]
    assert set(train["longspec"]) == {"block", "features", "features-ttt"}  # three variants, equal tokens
    assert train["longspec"]["features-ttt"]["ttt"] == 3 and train["longspec"]["features"]["features"]
    assert train["returned_variant"] in train["longspec"] and set(train["eval"]) >= set(train["longspec"])
    returned = train["returned"]
    assert set(returned) == {"block.safetensors", "draft_vocab.json", "longspec.json", "manifest.json"}
    assert max(returned.values()) <= plan.FILE_BACK_MAX
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    md = capsys.readouterr().out
    assert md.count("DRY RUN") >= 6 and "PROJECTION" in md and "| sd |" in md


def test_a_real_step_without_cuda_is_one_line_and_exit_2(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["step", "kernels", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["step", "stage", "--dry-run", "--out", str(f)]) == 2
    assert main(["step", "nope", "--out", str(tmp_path)]) == 2
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("retrospec: error:") for line in err)


def test_report_refuses_a_folder_without_results(tmp_path):
    with pytest.raises(RetrospecError, match="no step results"):
        report.load([str(tmp_path)])


def test_plan_command_prints_every_call(capsys, monkeypatch):
    assert main(["plan", "--json", "--root", str(ROOT)]) == 2  # this checkout is not slim: too many calls
    err = capsys.readouterr().err.strip()  # too many calls for parts cut anew, or parts cut for a slim tree too big
    assert err.endswith("('make gpu' slims the tree first)") or err.endswith("to re-split the model)"), err
    heavy, whole = slim.heavy_files(ROOT), plan.travelling_bytes(ROOT)
    monkeypatch.setattr(plan, "slimmed", lambda root: heavy)
    monkeypatch.setattr(plan, "travelling_bytes", lambda root: whole - sum((ROOT / p).stat().st_size for p in heavy))
    assert main(["plan", "--json", "--root", str(ROOT)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["index"] for c in got["calls"]] == list(range(1, len(got["calls"]) + 1))
    assert [c["step"] for c in got["calls"] if not c["optional"]] == ["stage", "model", "train"]
    assert got["minutes"] <= plan.SESSION_S / 60


def test_the_watchdog_writes_what_was_measured_before_a_kill(tmp_path):
    import time

    from tools.gpu import common

    res, _ = common.start("train", True, 60)
    res.figures["corpus"] = {"output_tokens": 123}
    timer = common.watchdog(res, tmp_path, 0.05)
    timer.join(5)
    got = json.loads((tmp_path / "train.json").read_text())
    assert got["figures"]["corpus"]["output_tokens"] == 123 and got["notes"][0].startswith("watchdog: the step was")
    later = common.watchdog(res, tmp_path / "later", 30)
    later.cancel()
    time.sleep(0.05)
    assert not (tmp_path / "later").exists()  # cancelled: a step that finished writes its own JSON
