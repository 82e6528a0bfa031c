"""LongSpec block storage (``save_longspec(storage=...)``, ``retrospec train longspec-pack``): int8 / float16 /
bfloat16 round trips, the int8 block's logits close to the float block's, greedy decoding with an int8 block still
identical to the oracle (the target verifies every token), the storage recorded and checked at load, CLI errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_longspec import GREEDY, PROMPT, CheckedDrafter, make_target, mimic_pair, random_kv, randomized

from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.errors import RetrospecError
from retrospec.models.longspec import load_longspec, read_meta, save_longspec
from retrospec.models.quant import SCALE_SUFFIX
from retrospec.types import SpecStats

torch.set_num_threads(1)


def test_int8_round_trip_and_logits(arch, tmp_path):
    target = make_target(arch)
    block = randomized(target, window=5)
    full = save_longspec(block, target, tmp_path / "fp32")
    small = save_longspec(block, target, tmp_path / "int8", storage="int8")
    assert json.loads((full / "longspec.json").read_text())["storage"] == "float32"  # the default: block's dtype
    meta = read_meta(small)
    assert meta["storage"] == "int8"
    with safe_open(str(small / "block.safetensors"), "pt") as f:
        assert f.metadata()["storage"] == "int8"
    stored = load_file(small / "block.safetensors")
    assert stored["self_attn.q_proj.weight"].dtype == torch.int8 and stored["norm1.weight"].dtype == torch.float16
    ratio = (small / "block.safetensors").stat().st_size / (full / "block.safetensors").stat().st_size
    assert ratio < 0.35  # tiny matrices (32 columns): the header, row scales and biases weigh more than 1/4

    loaded = load_longspec(small, target)
    assert loaded.uses(target) and loaded.window == 5
    want = block.state_dict()
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32
        if k + SCALE_SUFFIX in stored:  # within half a quantisation step, row by row
            s = stored[k + SCALE_SUFFIX].float()
            assert bool(((v - want[k]).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()), k
        else:  # 1-D: float16 rounding
            torch.testing.assert_close(v, want[k], atol=0, rtol=2 ** -11)
    ids = torch.tensor([PROMPT])
    kv = random_kv(block, len(PROMPT))
    with torch.no_grad():
        a, b = block(ids, kv), loaded(ids, kv)
    assert not torch.equal(a, b)  # lossy...
    assert (a - b).abs().max() < 0.02 * a.abs().max()  # ...and close
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("storage,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                           ("float32", torch.float32)])
def test_float_storages(storage, dtype, tmp_path):
    target = make_target("llama")
    block = randomized(target, window=5)
    out = save_longspec(block, target, tmp_path / storage, storage=storage)
    assert read_meta(out)["storage"] == storage
    assert all(v.dtype == dtype for v in load_file(out / "block.safetensors").values())
    loaded = load_longspec(out, target)  # cast back to the target's dtype
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, block.state_dict()[k].to(dtype).float()), k


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 16, 16)}], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "mimic"])
def test_int8_block_greedy_equals_oracle(arch, mode, kind, tmp_path):
    if kind == "random":
        target = make_target(arch)
        block = randomized(target, window=8, std=0.1)
    else:
        target, block = mimic_pair(arch)
    block = load_longspec(save_longspec(block, target, tmp_path / "blk", storage="int8"), target)
    want = autoregressive_generate(target, PROMPT, sampling=GREEDY, max_new_tokens=40)
    stats = SpecStats()
    chunks = list(speculative_generate(target, CheckedDrafter(block, **mode), PROMPT, sampling=GREEDY,
                                       max_new_tokens=40, stats=stats))
    assert [t for c in chunks for t in c] == want
    if kind == "mimic":  # the int8 block is still a useful draft: whole drafts accepted
        assert max(len(c) for c in chunks) >= 3


def test_storage_recorded_and_checked(tmp_path):
    target = make_target("llama")
    block = randomized(target, window=5)
    with pytest.raises(RetrospecError, match="unknown LongSpec storage 'int4'"):
        save_longspec(block, target, tmp_path / "x", storage="int4")
    assert not (tmp_path / "x").exists()

    old = save_longspec(block, target, tmp_path / "old")  # a file from before "storage": loads as before
    meta = json.loads((old / "longspec.json").read_text())
    del meta["storage"]
    (old / "longspec.json").write_text(json.dumps(meta))
    assert torch.equal(load_longspec(old, target).self_attn.q_proj.weight, block.self_attn.q_proj.weight)

    meta["storage"] = "int4"
    (old / "longspec.json").write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="corrupt LongSpec block .*unknown storage 'int4'") as err:
        load_longspec(old, target)
    assert "\n" not in str(err.value)

    packed = save_longspec(block, target, tmp_path / "int8", storage="int8")
    meta = json.loads((packed / "longspec.json").read_text())
    meta["storage"] = "float32"  # int8 tensors behind a float label: never loaded as raw integers
    (packed / "longspec.json").write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="corrupt LongSpec block .*holds int8 tensors but"):
        load_longspec(packed, target)

    broken = save_longspec(block, target, tmp_path / "broken", storage="int8")
    state = load_file(broken / "block.safetensors")
    del state["mlp.up_proj.weight" + SCALE_SUFFIX]
    save_file(state, broken / "block.safetensors")
    meta = json.loads((broken / "longspec.json").read_text())
    meta["files"]["block.safetensors"] = (broken / "block.safetensors").stat().st_size
    (broken / "longspec.json").write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="corrupt LongSpec block .*has no scale"):
        load_longspec(broken, target)


def test_cli_pack(cli, saved_models, tmp_path):
    import retrospec
    from retrospec.models import load_model

    tgt = load_model(str(saved_models.target))
    src = save_longspec(randomized(tgt.model, window=16, std=0.1), tgt, tmp_path / "src", target_path="the-target")
    (src / "manifest.json").write_text(json.dumps({"steps": 7}) + "\n")
    out = tmp_path / "packed"
    run = cli("train", "longspec-pack", src, "--target", saved_models.target, "--out", out, "--storage", "int8")
    assert run.rc == 0, run.err
    assert "MiB ->" in run.out and "max abs weight error" in run.out and "(float32)" in run.out
    assert sorted(p.name for p in out.iterdir()) == ["block.safetensors", "longspec.json", "manifest.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == {"steps": 7, "packed": {"from": str(src), "storage": "int8"}}
    meta = read_meta(out)
    assert meta["storage"] == "int8" and meta["target"]["path"] == "the-target"
    error = float(run.out.split("max abs weight error: ")[1].split()[0])
    assert 0 < error < 0.01

    prompt = tgt.tokenizer("def wrap(text, width):", add_special_tokens=False)["input_ids"]
    want = autoregressive_generate(tgt.model, prompt, sampling=GREEDY, max_new_tokens=12)
    res = retrospec.generate(prompt, target=str(saved_models.target), draft=out, method="longspec",
                             max_new_tokens=12, gating=False, tree="3,3")
    assert res.token_ids == want

    back = tmp_path / "back"  # and back to float16 from int8: no manifest needed
    (out / "manifest.json").unlink()
    run = cli("train", "longspec-pack", out, "--target", saved_models.target, "--out", back, "--storage", "float16")
    assert run.rc == 0, run.err
    assert read_meta(back)["storage"] == "float16" and not (back / "manifest.json").exists()

    base = ["--target", saved_models.target, "--storage", "int8"]
    cli("train", "longspec-pack", tmp_path / "nope", *base, "--out", tmp_path / "o1").assert_user_error("not found")
    cli("train", "longspec-pack", src, *base, "--out", out).assert_user_error("already exists")
    cli("train", "longspec-pack", src, "--target", saved_models.target, "--out", tmp_path / "o2", "--storage",
        "int4").assert_user_error("storage")
    cli("train", "longspec-pack", src, "--target", tmp_path / "none", "--out", tmp_path / "o3", "--storage",
        "int8").assert_user_error("not found")
    cli("train", "longspec-pack", src, "--target", saved_models.draft, "--out", tmp_path / "o4", "--storage",
        "int8").assert_user_error("another target")
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir())
