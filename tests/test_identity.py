"""Model identity (``identity.same_model``): an artefact built for a float32 target (a LongSpec block, a dense
datastore, a LoRA adapter) is accepted for that target's bfloat16 and float16 copies, as a GPU user loads it, and one
built for a bfloat16 copy is accepted for the float32 original; any other model is refused in any precision; two
float32 identities match exactly only; records written before ``weights_rms`` existed match exactly only; a corrupt
record is a refusal, never an exception."""

from __future__ import annotations

import copy

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
    legacy = {k: v for k, v in rec.items() if k != "weights_rms"}  # a record from before weights_rms
    assert same_model(legacy, target)
    if dtype == torch.bfloat16:  # its 4-digit digest moves (float16's may not, on these tiny models)
        assert model_identity(low)["fingerprint"] != rec["fingerprint"] and not same_model(legacy, low)


@pytest.mark.parametrize("dtype", (torch.float32, *LOW))
def test_another_model_is_refused_in_every_precision(arch, dtype):
    target = make(arch)
    rec = record(target)
    assert not same_model(rec, make(arch, seed=7).to(dtype))  # other weights, same shapes
    assert not same_model(rec, make(arch, hidden=64).to(dtype))  # another config
    nudged = copy.deepcopy(target)
    with torch.no_grad():  # one tensor moved by 2^-6 relative: 4x what rounding to bfloat16 may do
        nudged.model.layers[0].mlp.up_proj.weight.mul_(1 + 2.0 ** -6)
    assert not same_model(rec, nudged.to(dtype))


def test_a_float32_model_needs_its_exact_fingerprint():
    target = make("llama")
    forged = record(target) | {"fingerprint": "0123456789abcdef"}  # weights_rms intact, the fingerprint not
    assert not same_model(forged, target)
    assert same_model(forged, copy.deepcopy(target).to(torch.bfloat16))  # a lower precision reads the RMS values
    assert not same_model(forged | {"dtype": "bfloat16"} | {"weights_rms": [0.5] * len(forged["weights_rms"])},
                          target)  # a record from a bfloat16 model reads the RMS values too: these are not these


@pytest.mark.parametrize("bad", [None, {}, {"fingerprint": None}, "weights_rms-strings", "weights_rms-short",
                                 "dtype-unknown"])
def test_a_corrupt_record_is_a_refusal(bad):
    target = make("llama")
    low = copy.deepcopy(target).to(torch.bfloat16)
    rec = record(target)
    if bad == "weights_rms-strings":
        bad = rec | {"weights_rms": ["x"] * len(rec["weights_rms"])}
    elif bad == "weights_rms-short":
        bad = rec | {"weights_rms": rec["weights_rms"][:-1]}
    elif bad == "dtype-unknown":
        bad = rec | {"fingerprint": "0123456789abcdef", "dtype": "nn"}
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
