"""``retrospec zoo long`` (the long-context zoo target for RAPID) and the prefix + block verification attention."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import sharpen, tiny_llama, tiny_qwen2
from retrospec.attention import prefix_block
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters.rapid import RapidDrafter
from retrospec.models import load_model
from retrospec.tree import merge_sequences
from retrospec.types import DraftTree
from retrospec.verify import Verifier

pytestmark = pytest.mark.usefixtures("single_thread")


def test_task_example_masks_the_completion(saved_models):
    from retrospec.train.zoo import task_example

    tok = load_model(saved_models.target).tokenizer
    for kind in ("kv", "passkey", "facts"):
        ids, mask = task_example(tok, kind, 400, seed=3)
        assert len(ids) <= 401 and len(mask) == len(ids) - 1
        n = int(sum(mask))
        assert n >= 2 and mask[-n:] == [1] * n and ids[-1] == tok.eos_token_id
        assert tok.decode(ids[-n:-1]).strip(' ."') != ""


def test_build_long_zoo_smoke(saved_models, tmp_path):
    from retrospec.train.zoo import LongZooConfig, build_long_zoo

    tok = load_model(saved_models.target).tokenizer
    stream = np.array(tok(open(torch.__file__).read() * 3)["input_ids"], dtype=np.int64)
    base = saved_models.target.parent
    cfg = LongZooConfig(base=base, out=tmp_path / "zoo", steps=2, batch_size=2, lengths=(300,), draft_steps=2,
                        draft_intermediate=32, eval_n=1, eval_lengths=(300,), eval_base=False, log_every=1)
    manifest = build_long_zoo(cfg, log=lambda *_: None, stream=stream)
    out = tmp_path / "zoo"
    t_cfg = json.loads((out / "target-long" / "config.json").read_text())
    d_cfg = json.loads((out / "draft-long" / "config.json").read_text())
    assert t_cfg["max_position_embeddings"] == 65536 and d_cfg["intermediate_size"] == 32
    assert json.loads((out / "long.json").read_text())["target_long"]["steps"] == 2
    assert set(manifest["target_long"]["accuracy"]) == {"kv@300", "passkey@300", "facts@300"}
    drafter = load_model(out / "draft-long", role="draft")
    assert drafter.vocab_size == load_model(out / "target-long").vocab_size
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_prefix_block_attention_equals_sdpa(make):
    model = sharpen(make(seed=0, max_pos=512), 4.0)
    ids = torch.randint(0, 90, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = {}
    for impl in ("sdpa", prefix_block.ATTN_NAME):
        if impl == "sdpa":
            prefix_block.disable(model)
        else:
            assert prefix_block.enable(model)
        ver = Verifier(model)
        rows = [ver.prefill(ids[:80])]
        rows.append(ver.score(ids[80], DraftTree.chain(ids[81:92])))  # chain: the prefix + block path
        ver.commit([0, 1, 2])
        rows.append(ver.score(ids[84], DraftTree.empty()))  # one token: sdpa as before
        ver.commit([])
        rows.append(ver.score(ids[85], merge_sequences([[1, 2, 3], [1, 4], [5, 6, 7]])))  # tree: explicit mask
        outs[impl] = rows
    for a, b in zip(*outs.values()):
        assert torch.allclose(a, b, atol=1e-5)
    greedy = SamplingConfig()
    oracle = autoregressive_generate(model, ids[:60], sampling=greedy, max_new_tokens=20)
    prefix_block.enable(model)
    out = [t for c in speculative_generate(model, RapidDrafter(model, ids[40:60], gamma=8), ids[:60], sampling=greedy,
                                           max_new_tokens=20) for t in c]
    prefix_block.disable(model)
    assert out == oracle
    assert model.config._attn_implementation == "sdpa"


def _sampler_batches(saved_models, n: int, **over) -> list:
    from retrospec.train.zoo import LongZooConfig, MixSampler

    tok = load_model(saved_models.target).tokenizer
    stream = np.arange(20_000) % 250
    base = saved_models.target.parent
    cfg = LongZooConfig(base=base, out=base, **({"lengths": (300, 600), "batch_size": 4} | over))
    sampler = MixSampler(tok, stream, cfg, salt=1, tok_dir=saved_models.target)
    try:
        return [sampler.next() for _ in range(n)]
    finally:
        sampler.close()


def test_mix_sampler_same_batches_with_workers(saved_models):
    inline = _sampler_batches(saved_models, 4)
    pooled = _sampler_batches(saved_models, 4, workers=1)
    for a, b in zip(inline, pooled):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and torch.equal(a.is_task, b.is_task)


def test_mix_sampler_batch_tokens_sets_rows_per_length(saved_models):
    for b in _sampler_batches(saved_models, 6, batch_tokens=1200, task_fraction=0.5):
        length = b.ids.shape[1] - 1
        assert b.ids.shape[0] == 1200 // length
        assert int(b.is_task.sum()) == round(b.ids.shape[0] * 0.5)


def test_long_zoo_time_budget_and_kept_target(saved_models, tmp_path):
    """--seconds replaces the step count; --steps 0 keeps --init-target byte for byte and only trains the draft
    (here on labels), and the earlier stage's manifest is kept inside the new one."""
    from retrospec.train.zoo import LongZooConfig, build_long_zoo

    tok = load_model(saved_models.target).tokenizer
    stream = np.array(tok(open(torch.__file__).read() * 3)["input_ids"], dtype=np.int64)
    base = saved_models.target.parent
    first = build_long_zoo(LongZooConfig(base=base, out=tmp_path / "a", seconds=1.0, lengths=(300,), batch_size=2,
                                         draft_steps=1, draft_intermediate=32, eval_n=0, eval_base=False),
                           log=lambda *_: None, stream=stream)
    assert first["target_long"]["steps"] >= 1 and first["target_long"]["seconds"] >= 1.0
    second = build_long_zoo(LongZooConfig(base=base, out=tmp_path / "b", steps=0, init_target=str(
        tmp_path / "a" / "target-long"), init_draft=str(tmp_path / "a" / "draft-long"), draft_steps=2,
        draft_labels=True, lengths=(300,), batch_size=2, eval_n=0, eval_base=False), log=lambda *_: None,
        stream=stream)
    assert second["target_long"]["steps"] == 0 and second["draft_long"]["objective"] == "labels"
    assert second["previous_stage"]["target_long"]["steps"] == first["target_long"]["steps"]
    a, b = (tmp_path / d / "target-long" / "model.safetensors" for d in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("extra, needle", [
    (["--steps", "0"], "--init-target"),
    (["--lengths", "100,x"], "--lengths"),
    (["--lengths", "128"], ">= 256"),
    (["--device", "tpu"], "--device"),
    (["--init-draft", "/nonexistent/draft"], "--init-draft"),
    (["--workers", "-1"], "--workers"),
])
def test_zoo_long_bad_knobs_exit_2(saved_models, tmp_path, capsys, extra, needle):
    from retrospec.cli import main

    code = main(["zoo", "long", "--base", str(saved_models.target.parent), "--out", str(tmp_path / "z"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0] and err[0].startswith("retrospec: error:")
    assert not (tmp_path / "z").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_zoo_long_cuda_without_gpu_exit_2(saved_models, tmp_path, capsys):
    from retrospec.cli import main

    code = main(["zoo", "long", "--base", str(saved_models.target.parent), "--out", str(tmp_path / "z"),
                 "--device", "cuda"])
    assert code == 2 and "no CUDA device" in capsys.readouterr().err


def test_zoo_info_shows_both_manifests(capsys):
    from retrospec.cli import main

    assert main(["zoo", "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "zoo build" in info["zoo"]["command"]
    assert "target_long" in info["long"] and "zoo long" in info["long"]["command"]


def test_zoo_stream_round_trip(tmp_path, capsys):
    """``zoo stream`` writes the stdlib training split as a .npy stream that ``zoo long --stream-file`` reads."""
    from retrospec.cli import main
    from retrospec.stdlib_corpus import read_texts, stdlib_files

    out = tmp_path / "s.npy"
    assert main(["zoo", "stream", "--out", str(out)]) == 0
    stream = np.load(out)
    assert stream.dtype == np.uint16 and len(stream) > 100_000
    assert int((stream == 0).sum()) >= len(read_texts(stdlib_files("train")))  # one EOS (id 0) after each file
    assert main(["zoo", "stream", "--out", str(tmp_path / "s.txt")]) == 2
    assert main(["zoo", "stream", "--out", str(tmp_path / "missing" / "s.npy")]) == 2
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_build_long_zoo_on_cuda(saved_models, tmp_path):
    """The GPU path (bf16 autocast, workers) trains, distils and saves float16 weights loadable on the CPU."""
    from retrospec.train.zoo import LongZooConfig, build_long_zoo

    tok = load_model(saved_models.target).tokenizer
    stream = np.array(tok(open(torch.__file__).read() * 3)["input_ids"], dtype=np.int64)
    cfg = LongZooConfig(base=saved_models.target.parent, out=tmp_path / "zoo", steps=3, batch_size=2, lengths=(300,),
                        draft_steps=2, draft_intermediate=32, eval_n=0, eval_base=False, device="cuda", workers=1)
    manifest = build_long_zoo(cfg, log=lambda *_: None, stream=stream)
    assert manifest["target_long"]["device"].startswith("cuda") and manifest["draft_long"]["steps"] == 2
    assert load_model(tmp_path / "zoo" / "target-long").vocab_size == load_model(saved_models.target).vocab_size
