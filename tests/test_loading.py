"""Model loading from the user's side: ``load_model`` on checkpoint directories, caching, wrapping model objects,
vocabulary checks, and a clear ``RetrospecError`` (never a raw transformers/safetensors exception) for bad input.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from retrospec import LoadedModel, RetrospecError, load_model
from retrospec.models import check_same_vocab

from conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def paths(saved_models):
    return saved_models


def copy_of(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def assert_load_error(path, *fragments, role="target") -> str:
    with pytest.raises(RetrospecError) as info:
        load_model(path, role=role)
    msg = str(info.value)
    assert msg.strip() and "\n" not in msg.strip(), f"message must be one line: {msg!r}"
    for frag in fragments:
        assert frag.lower() in msg.lower(), f"{frag!r} not in {msg!r}"
    return msg


def test_loaded_model_properties(paths):
    m = load_model(paths.target)
    assert isinstance(m, LoadedModel)
    assert m.vocab_size == paths.vocab_size
    assert m.max_positions == paths.max_positions
    assert m.tokenizer is not None and len(m.tokenizer) == paths.vocab_size
    assert paths.eos_id in m.eos_ids()
    assert not m.model.training
    assert next(m.model.parameters()).dtype == torch.float32


def test_same_path_returns_cached_object(paths, monkeypatch):
    first = load_model(paths.target)
    assert load_model(paths.target) is first
    assert load_model(str(paths.target)) is first
    assert load_model(f"{paths.target}/") is first
    assert load_model(paths.target / ".." / paths.target.name) is first
    monkeypatch.chdir(paths.target.parent)
    assert load_model(paths.target.name) is first
    assert load_model(first) is first  # a LoadedModel passes through


def test_distinct_directories_are_distinct(paths):
    assert load_model(paths.target) is not load_model(paths.draft, role="draft")


def test_wrapping_a_transformers_model(paths):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(paths.target)
    wrapped = load_model(hf)
    assert wrapped.model is hf
    assert wrapped.tokenizer is not None  # found next to the weights via name_or_path
    assert wrapped.vocab_size == paths.vocab_size


def test_check_same_vocab(paths):
    target = load_model(paths.target)
    check_same_vocab(target, load_model(paths.draft, role="draft"))  # no error
    with pytest.raises(RetrospecError, match="vocab"):
        check_same_vocab(target, load_model(paths.draft_other_size, role="draft"))
    with pytest.raises(RetrospecError, match="tokenizer"):
        check_same_vocab(target, load_model(paths.draft_other_tokens, role="draft"))


# --- bad directories ------------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    assert str(missing) in assert_load_error(missing, "not found")
    assert_load_error(missing, "draft", role="draft")


def test_path_is_a_file(paths):
    assert_load_error(paths.target / "config.json", "not a directory")


def test_directory_without_config(tmp_path, paths):
    d = tmp_path / "weights_only"
    d.mkdir()
    shutil.copy(paths.target / "model.safetensors", d)
    assert str(d) in assert_load_error(d, "config.json")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "missing"])
def test_corrupt_or_missing_weights(paths, tmp_path, damage):
    d = copy_of(paths.target, tmp_path)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    if damage == "garbage":
        weights.write_bytes(b"\x00\x01not safetensors" * 64)
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 3])
    elif damage == "empty":
        weights.write_bytes(b"")
    else:
        weights.unlink()
    assert str(d) in assert_load_error(d, "could not load")


def test_corrupt_config(paths, tmp_path):
    d = copy_of(paths.target, tmp_path)
    (d / "config.json").write_text("{ this is not json")
    assert_load_error(d, "could not load")


def test_corrupt_tokenizer(paths, tmp_path):
    d = copy_of(paths.target, tmp_path)
    (d / "tokenizer.json").write_text("{ broken")
    assert_load_error(d, "tokenizer")


def test_failed_load_is_not_cached(paths, tmp_path):
    d = copy_of(paths.target, tmp_path)
    good = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b"junk" * 100)
    assert_load_error(d)
    (d / "model.safetensors").write_bytes(good)  # the user fixes the file and tries again
    m = load_model(d)
    ref = load_model(paths.target)
    assert torch.equal(m.model.lm_head.weight, ref.model.lm_head.weight)


def test_directory_without_tokenizer_loads_without_one(paths, tmp_path):
    d = tmp_path / "no_tok"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(paths.target / f, d)
    m = load_model(d)
    assert m.tokenizer is None
    # text prompts then need a tokenizer: a clear error, not an AttributeError
    from retrospec import generate

    with pytest.raises(RetrospecError, match="tokenizer"):
        generate("hello", target=d, method="ar", max_new_tokens=4)
    assert 1 <= len(generate([5, 6, 7], target=d, method="ar", max_new_tokens=4).token_ids) <= 4


def test_a_loaded_cpu_model_lives_in_one_anonymous_arena(paths, tmp_path, monkeypatch):
    """``models.pages``: the weights leave the checkpoint file's mapping for one anonymous arena (huge pages where
    the kernel gives them); the model computes the same bits, stays tied, every tensor has a storage of its own (it
    saves and loads back); ``RETROSPEC_HUGE_PAGES=0`` leaves the weights where transformers put them."""
    from transformers import AutoModelForCausalLM

    from retrospec.models import pages

    if not pages.enabled():
        pytest.skip("no madvise(MADV_HUGEPAGE) here")
    tied = tiny_llama(seed=3)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    tied.save_pretrained(tmp_path / "tied")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    loaded = load_model(tmp_path / "tied").model
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, plain(ids).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ptrs = sorted((p.data_ptr(), p.numel() * p.element_size()) for p in loaded.parameters())
    span = ptrs[-1][0] + ptrs[-1][1] - ptrs[0][0]
    assert span <= sum(n for _, n in ptrs) + len(ptrs) * pages.ALIGN  # packed side by side, one arena
    assert len({p.untyped_storage().data_ptr() for p in loaded.parameters()}) == len(ptrs)  # a storage each
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    region = next(m for m in maps if int(m[0].split("-")[0], 16) <= ptrs[0][0] < int(m[0].split("-")[1], 16))
    assert len(region) < 6 or not region[5].startswith("/")  # anonymous: no file behind it
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, plain(ids).logits)
    monkeypatch.setenv("RETROSPEC_HUGE_PAGES", "0")
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    before = [p.data_ptr() for p in kept.parameters()]
    assert pages.place_weights(kept) == 0 and [p.data_ptr() for p in kept.parameters()] == before
