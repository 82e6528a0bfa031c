"""``--device`` / ``--dtype`` (and the API's ``device=`` / ``dtype=``): where and how the target and draft load.

On this CPU: a bfloat16 run of every entry point works with the bundled float32 artefacts (the LongSpec block by
``identity.same_model``), the bench records where it ran, and CUDA asked for where there is none, a misspelt device
or dtype, are one line and exit 2. Token identity in 16 bits is not asserted: a k-token verification and a 1-token
step round differently there, and how depends on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

import retrospec
from retrospec.errors import RetrospecError
from retrospec.models import load_model, resolve_device, resolve_dtype

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_device_and_dtype_names():
    assert resolve_device("cpu") == torch.device("cpu") and resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16 and resolve_dtype("torch.float32") is torch.float32
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", ""):
        with pytest.raises(RetrospecError, match="--device must be"):
            resolve_device(bad)
    for bad in ("float64", "bf16", torch.int8, torch.float64, None):
        with pytest.raises(RetrospecError, match="--dtype must be"):
            resolve_dtype(bad)


@NO_CUDA
@pytest.mark.parametrize("argv", [
    ("generate", "--prompt", "x", "--device", "cuda"),
    ("bench", "--preset", "heldout", "--limit", "1", "--out", "{tmp}/b", "--device", "cuda:0"),
    ("profile", "--device", "cuda"),
    ("corpus", "generate", "--sources", "stdlib=1", "--out", "{tmp}/c", "--device", "cuda"),
    ("datastore", "build", "--kind", "suffix", "--corpus", "stdlib", "--out", "{tmp}/s", "--device", "cuda"),
])
def test_cuda_where_there_is_none_is_one_line(cli, tmp_path, argv):
    cli(*(a.format(tmp=tmp_path) for a in argv)).assert_user_error("no CUDA device")
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("flag, value, fragment", [("--dtype", "bf16", "invalid choice"),
                                                   ("--device", "gpu", "--device must be")])
def test_a_misspelt_device_or_dtype_is_one_line(cli, flag, value, fragment):
    cli("generate", "--prompt", "x", flag, value).assert_user_error(fragment)


@pytest.mark.parametrize("method", ["sd", "longspec", "pld"])
def test_generate_in_bfloat16_with_the_bundled_float32_artefacts(cli, method):
    run = cli("generate", "--prompt", "def wrap(text, width):", "--method", method, "--dtype", "bfloat16",
              "--max-new-tokens", "12", "--json")
    assert run.rc == 0, run.err
    got = json.loads(run.out)
    assert got["stats"]["method"] == method and 0 < got["stats"]["new_tokens"] <= 12
    assert got["stats"]["target_calls"] >= 1 and got["token_ids"]
    assert next(load_model("zoo", dtype=torch.bfloat16).model.parameters()).dtype == torch.bfloat16


def test_api_device_and_dtype():
    ref = retrospec.generate("def wrap(text, width):", target="zoo", method="ar", max_new_tokens=8)
    got = retrospec.generate("def wrap(text, width):", target="zoo", method="ar", max_new_tokens=8,
                             dtype="float32", device="cpu")
    assert got.token_ids == ref.token_ids  # the defaults, spelt out
    half = retrospec.generate("def wrap(text, width):", target="zoo", method="longspec", max_new_tokens=8,
                              dtype=torch.bfloat16)
    assert 0 < half.stats.new_tokens <= 8
    with pytest.raises(RetrospecError, match="--dtype must be"):
        retrospec.generate("x", target="zoo", method="ar", dtype="double")


def test_a_draft_loads_beside_its_target():
    """A draft given by name or path follows a loaded target's dtype (and device) unless told otherwise."""
    from retrospec.models import model_dir
    from retrospec.models.loading import _CACHE

    key = (str(model_dir("zoo-draft").resolve()), str(torch.bfloat16), "cpu")
    _CACHE.pop(key, None)  # an earlier test may have loaded it
    target = load_model("zoo", dtype=torch.bfloat16)
    res = retrospec.generate("def wrap(text, width):", target=target, draft="zoo-draft", method="sd",
                             max_new_tokens=6)
    assert res.stats.new_tokens > 0 and key in _CACHE
    assert next(_CACHE[key].model.parameters()).dtype == torch.bfloat16


def test_placement_of_odd_models():
    """A model without parameters, or with integer ones only, places its draft on the CPU in float32."""
    from retrospec.models import placement

    class Empty(torch.nn.Module):
        pass

    assert placement(Empty()) == {"device": torch.device("cpu"), "dtype": torch.float32}
    ints = torch.nn.Module()
    ints.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.int8), requires_grad=False)
    assert placement(ints) == {"device": torch.device("cpu"), "dtype": torch.float32}


def test_a_draft_on_another_device_is_refused():
    """Target and draft tensors meet in every step: a pair on two devices is one clear line (the meta device stands
    in for a GPU here)."""
    from conftest import tiny_llama

    from retrospec.models import LoadedModel, check_same_vocab

    target = LoadedModel(tiny_llama(), None, "tiny-target")
    elsewhere = LoadedModel(tiny_llama(seed=1).to("meta"), None, "tiny-draft")
    with pytest.raises(RetrospecError, match="is on meta, the target tiny-target on cpu"):
        check_same_vocab(target, elsewhere)
    check_same_vocab(target, LoadedModel(tiny_llama(seed=1), None, "tiny-draft"))


def test_bench_records_where_it_ran(cli, tmp_path):
    out = tmp_path / "bench"
    run = cli("bench", "--preset", "heldout", "--limit", "1", "--methods", "ar,longspec", "--dtype", "bfloat16",
              "--max-new-tokens", "8", "--no-warmup", "--out", out)
    assert run.rc == 0, run.err
    cfg = json.loads((out / "results.json").read_text())["config"]
    assert cfg["dtype"] == "bfloat16" and cfg["device"] == "cpu"
    assert "cpu, bfloat16" in (out / "report.md").read_text()
