"""Model identity (``identity.same_model``): an artefact built for a float32 target (a LongSpec block, a dense
datastore, a LoRA adapter) is accepted for that target's bfloat16 and float16 copies, as a GPU user loads it, and one
built for a bfloat16 copy is accepted for the float32 original; any other model is refused in any precision, however
close (a perturbation far below what rounding to 16 bits does, a fine-tune); two float32 identities match exactly
only; records written before the ``rounded`` digests existed match exactly only; a corrupt record is a refusal,
never an exception."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_llama, tiny_qwen2

from retrospec.errors import RetrospecError
from retrospec.identity import model_identity, same_model
from retrospec.models.longspec import LongSpecDraft, load_longspec, save_longspec
from retrospec.retrieval.store import check_compatible, target_meta

LOW = (torch.bfloat16, torch.float16)


def make(arch: str, **kw):
    return (tiny_llama if arch == "llama" else tiny_qwen2)(**kw)


def record(model) -> dict:
    """What an artefact stores: the identity as JSON would give it back."""
    return copy.deepcopy(model_identity(model))


@pytest.mark.parametrize("dtype", LOW)
def test_a_lower_precision_copy_is_the_same_model(arch, dtype):
    target = make(arch)
    rec = record(target)
    low = copy.deepcopy(target).to(dtype)
    assert same_model(rec, low) and same_model(rec, target)
    assert same_model(record(low), target)  # built on the copy, used with the original
    legacy = {k: v for k, v in rec.items() if k not in ("rounded", "dtype")}  # a record from before 2026-11-27
    assert same_model(legacy, target)
    if dtype == torch.bfloat16:  # its 4-digit digest moves (float16's may not, on these tiny models)
        assert model_identity(low)["fingerprint"] != rec["fingerprint"] and not same_model(legacy, low)


def test_copies_in_the_two_16_bit_dtypes_are_told_apart():
    """Double rounding: a float16 copy rounded to bfloat16 is not always the bfloat16 copy. The check refuses rather
    than guesses (documented)."""
    target = make("llama")
    half, brain = copy.deepcopy(target).to(torch.float16), copy.deepcopy(target).to(torch.bfloat16)
    if any(not torch.equal(p.to(torch.bfloat16), q) for p, q in zip(half.parameters(), brain.parameters())):
        assert not same_model(record(brain), half)


def perturbed(model, scale: float, seed: int = 3):
    """A copy with every weight moved by N(0, scale) relative noise: a stand-in for a fine-tune."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g))
    return out


@pytest.mark.parametrize("dtype", (torch.float32, *LOW))
def test_another_model_is_refused_in_every_precision(arch, dtype):
    target = make(arch)
    rec = record(target)
    assert not same_model(rec, make(arch, seed=7).to(dtype))  # other weights, same shapes
    assert not same_model(rec, make(arch, hidden=64).to(dtype))  # another config
    assert not same_model(rec, perturbed(target, 0.01).to(dtype))  # a fine-tune-sized change
    # 1e-4 relative: a quarter of what rounding to bfloat16 may do, yet some weights round the other way
    assert not same_model(rec, perturbed(target, 1e-4).to(dtype))


def test_a_lora_fine_tune_of_the_real_target_is_not_its_base():
    """The bundled RAG drafter (SmolLM2 + a merged LoRA) against SmolLM2's recorded identity, in bfloat16: its
    per-tensor RMS values differ from the base's by at most 5e-5 relative, the rounded digests do not lie."""
    from retrospec.models import load_model, model_dir

    meta = json.loads((model_dir("smollm2-135m-rag-drafter") / "retrospec_adapter.json").read_text())
    base = meta["base_identity"]
    assert same_model(base, load_model("smollm2-135m", dtype=torch.bfloat16).model)
    assert not same_model(base, load_model("smollm2-135m-rag-drafter", dtype=torch.bfloat16).model)


def test_a_float32_pair_needs_the_fingerprint_and_the_rounded_digest():
    target = make("llama")
    forged = record(target) | {"fingerprint": "0123456789abcdef"}  # rounded digests intact, the fingerprint not
    assert not same_model(forged, target)
    assert same_model(forged, copy.deepcopy(target).to(torch.bfloat16))  # a 16-bit copy reads the rounded digests
    close = perturbed(target, 1e-5)  # 4 digits of RMS cannot see it, the bfloat16 digest does
    assert model_identity(close)["fingerprint"] == record(target)["fingerprint"]
    assert not same_model(record(target), close)


@pytest.mark.parametrize("bad", [None, {}, {"fingerprint": None}, "a string", "rounded-string", "rounded-none",
                                 "dtype-unknown"])
def test_a_corrupt_record_is_a_refusal(bad):
    target = make("llama")
    low = copy.deepcopy(target).to(torch.bfloat16)
    rec = record(target) | {"fingerprint": "0123456789abcdef"}
    if bad == "rounded-string":
        bad = rec | {"rounded": "x"}
    elif bad == "rounded-none":
        bad = rec | {"rounded": {"bfloat16": None, "float16": None}}
    elif bad == "dtype-unknown":
        bad = rec | {"dtype": "nn"}
        assert not same_model(bad, target)
        return
    assert not same_model(bad, low)


def test_artefacts_of_a_float32_target_load_on_its_bfloat16_copy(arch, tmp_path):
    """The loaders' own checks: a LongSpec block and a dense store's metadata, built for the float32 target."""
    target = make(arch)
    low = copy.deepcopy(target).to(torch.bfloat16)
    block = LongSpecDraft.for_target(target, window=4)
    out = save_longspec(block, target, tmp_path / "blk", target_path="tiny-target")
    loaded = load_longspec(out, low)
    assert loaded.uses(low) and next(loaded.parameters()).dtype == torch.bfloat16
    with pytest.raises(RetrospecError, match="another target"):
        load_longspec(out, make(arch, seed=7).to(torch.bfloat16))

    meta = {"kind": "dense", "tokenizer": {}, "target": target_meta(target, "tiny-target")}
    check_compatible(meta, tmp_path / "store", model=low)
    with pytest.raises(RetrospecError, match="another target model"):
        check_compatible(meta, tmp_path / "store", model=make(arch, seed=7).to(torch.bfloat16))
