"""The Python API from the user's side: ``retrospec.generate`` / ``retrospec.stream`` on saved checkpoints.

Checks the result object, lossless greedy output (sd and pld token-identical to ar, and ar identical to the naive
oracle), streaming (pieces concatenate to the final text), seeded sampling, model reuse (paths, ``LoadedModel``,
transformers model objects) and that every bad knob raises ``RetrospecError`` with a one-line message.
"""

from __future__ import annotations

import math
import shutil

import pytest
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import retrospec
from retrospec import GenerationResult, LoadedModel, RetrospecError, SpecStats, generate, load_model, stream
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [
    "def dedent(text):\n    ",
    "import os\nclass Wrapper:\n    def __init__(self, width=70):\n        self.width = width\n",
    "for line in lines:\n    if line.strip():\n        yield line\nfor line in lines:\n",
    "é ü — 日本語 😀 ",  # multi-byte characters in the prompt
]


@pytest.fixture(scope="module")
def paths(saved_models):
    return saved_models


@pytest.fixture(scope="module")
def tgt(paths) -> LoadedModel:
    return load_model(paths.target)


@pytest.fixture(scope="module")
def drf(paths) -> LoadedModel:
    return load_model(paths.draft, role="draft")


def run(prompt, tgt, drf, method, **kw) -> GenerationResult:
    return generate(prompt, target=tgt, draft=drf if method == "sd" else None, method=method, **kw)


def test_public_names():
    for name in ("generate", "stream", "load_model", "LoadedModel", "RetrospecError", "GenerationResult",
                 "SpecStats"):
        assert hasattr(retrospec, name)


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_result_object(paths, method):
    res = generate(PROMPTS[0], target=str(paths.target), draft=str(paths.draft) if method == "sd" else None,
                   method=method, max_new_tokens=12)
    assert isinstance(res, GenerationResult)
    assert isinstance(res.text, str)
    assert isinstance(res.token_ids, list) and all(isinstance(t, int) for t in res.token_ids)
    assert isinstance(res.stats, SpecStats)
    st = res.stats
    assert st.method == method
    assert st.new_tokens == len(res.token_ids)
    assert 1 <= len(res.token_ids) <= 12
    assert math.isclose(st.mean_accepted_tokens, st.new_tokens / st.target_calls)
    assert st.accepted_tokens <= st.drafted_tokens
    assert st.prefill_s >= 0 and st.decode_s >= 0
    d = res.to_dict()
    assert d["token_ids"] == res.token_ids and d["text"] == res.text and d["stats"]["method"] == method


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_equals_naive_oracle(tgt, prompt):
    """token_ids are the generated ids only, and greedy ar is exactly the no-cache, recompute-everything oracle."""
    n = 24
    res = generate(prompt, target=tgt, method="ar", max_new_tokens=n)
    prompt_ids = tgt.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    oracle = autoregressive_generate(tgt.model, prompt_ids, sampling=SamplingConfig(), max_new_tokens=n,
                                     eos_ids=tgt.eos_ids())
    assert res.token_ids == oracle
    assert res.text == tgt.tokenizer.decode(oracle, skip_special_tokens=True)
    assert res.stats.target_calls == res.stats.new_tokens and res.stats.drafted_tokens == 0


@pytest.mark.parametrize("method,gamma", [("sd", 1), ("sd", 3), ("sd", None), ("sd", 12), ("pld", 2),
                                          ("pld", None)])
@pytest.mark.parametrize("gating", [False, None], ids=["ungated", "default"])
def test_greedy_is_lossless(tgt, drf, method, gamma, gating):
    accepted = 0
    for prompt in PROMPTS:
        ar = run(prompt, tgt, drf, "ar", max_new_tokens=40)
        res = run(prompt, tgt, drf, method, max_new_tokens=40, gamma=gamma, gating=gating)
        assert res.token_ids == ar.token_ids, prompt
        assert res.text == ar.text
        accepted += res.stats.accepted_tokens
        if gamma is not None:
            assert res.stats.drafted_tokens <= gamma * res.stats.target_calls
    if gating is False:  # the gate may (by timing) skip drafting on tiny models; ungated, drafts are always tried
        assert accepted > 0  # drafts were accepted: the comparison exercised speculation, not just fallbacks


def test_adaptive_gamma_is_lossless(tgt, drf):
    for prompt in PROMPTS[:2]:
        ar = run(prompt, tgt, drf, "ar", max_new_tokens=30)
        assert run(prompt, tgt, drf, "sd", max_new_tokens=30, adaptive_gamma=True).token_ids == ar.token_ids


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}], ids=["greedy", "sampled"])
def test_stream_pieces_concatenate_to_text(tgt, drf, method, sampling):
    for prompt in PROMPTS:
        s = stream(prompt, target=tgt, draft=drf if method == "sd" else None, method=method, max_new_tokens=30,
                   **sampling)
        pieces = list(s)
        assert all(isinstance(p, str) for p in pieces)
        assert s.result is not None
        assert "".join(pieces) == s.result.text
        assert s.result.stats.new_tokens == len(s.result.token_ids)
        if s.result.text:
            assert len(pieces) > 1 or len(s.result.token_ids) == 1  # streamed, not one blob at the end
        again = generate(prompt, target=tgt, draft=drf if method == "sd" else None, method=method,
                         max_new_tokens=30, **sampling)
        assert again.token_ids == s.result.token_ids


def test_abandoned_stream_leaves_models_usable(tgt, drf):
    before = run(PROMPTS[1], tgt, drf, "sd", max_new_tokens=20)
    it = iter(stream(PROMPTS[1], target=tgt, draft=drf, method="sd", max_new_tokens=20))
    next(it)
    it.close()
    assert run(PROMPTS[1], tgt, drf, "sd", max_new_tokens=20).token_ids == before.token_ids


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_seeded_sampling_is_reproducible(tgt, drf, method):
    kw = dict(temperature=1.0, top_p=0.95, top_k=40, max_new_tokens=20)
    outs = [tuple(run(PROMPTS[0], tgt, drf, method, seed=s, **kw).token_ids) for s in (0, 0, 1, 2, 3)]
    assert outs[0] == outs[1]
    assert len(set(outs)) > 1  # different seeds explore different continuations


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=tiny"])
def test_sampling_that_keeps_one_token_equals_greedy(tgt, drf, method, knob):
    greedy = run(PROMPTS[2], tgt, drf, "ar", max_new_tokens=25)
    sampled = run(PROMPTS[2], tgt, drf, method, max_new_tokens=25, temperature=1.3, seed=5, **knob)
    assert sampled.token_ids == greedy.token_ids


def test_token_id_prompts(tgt, drf):
    ids = tgt.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    for method in ("ar", "sd", "pld"):
        assert run(ids, tgt, drf, method, max_new_tokens=10).token_ids == \
            run(PROMPTS[0], tgt, drf, method, max_new_tokens=10).token_ids


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_position_limit(tgt, drf, method):
    """A prompt of max_positions - 1 tokens leaves room for exactly one new token; max_positions is refused."""
    limit = tgt.max_positions
    ids = [(7 * i) % 250 + 3 for i in range(limit - 1)]
    res = run(ids, tgt, drf, method, max_new_tokens=10)
    assert len(res.token_ids) == 1
    ids5 = ids[: limit - 6]
    assert run(ids5, tgt, drf, method, max_new_tokens=50).token_ids == run(ids5, tgt, drf, "ar",
                                                                            max_new_tokens=50).token_ids
    with pytest.raises(RetrospecError, match="positions"):
        run(ids + [5], tgt, drf, method, max_new_tokens=10)


# --- model objects and reuse ----------------------------------------------------------------------------------------


def test_loaded_models_paths_and_objects_agree(paths, tgt, drf):
    by_path = generate(PROMPTS[1], target=str(paths.target), draft=paths.draft, method="sd", max_new_tokens=20)
    by_loaded = generate(PROMPTS[1], target=tgt, draft=drf, method="sd", max_new_tokens=20)
    hf_target = AutoModelForCausalLM.from_pretrained(paths.target)
    hf_draft = AutoModelForCausalLM.from_pretrained(paths.draft)
    by_object = generate(PROMPTS[1], target=hf_target, draft=hf_draft, method="sd", max_new_tokens=20)
    assert by_path.token_ids == by_loaded.token_ids == by_object.token_ids
    assert by_path.text == by_object.text


def test_model_object_without_tokenizer(paths, tgt):
    model = transformers.LlamaForCausalLM(tgt.model.config)
    model.load_state_dict(tgt.model.state_dict())
    model.name_or_path = ""
    ids = tgt.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    expected = generate(PROMPTS[0], target=tgt, method="ar", max_new_tokens=10)
    assert generate(ids, target=model, method="ar", max_new_tokens=10).token_ids == expected.token_ids
    with pytest.raises(RetrospecError, match="tokenizer"):
        generate(PROMPTS[0], target=model, method="ar", max_new_tokens=10)
    tok = AutoTokenizer.from_pretrained(paths.target)
    with_tok = generate(PROMPTS[0], target=model, tokenizer=tok, method="ar", max_new_tokens=10)
    assert with_tok.token_ids == expected.token_ids and with_tok.text == expected.text


def test_paths_are_loaded_once_and_reused(paths, tmp_path, monkeypatch):
    target_dir, draft_dir = tmp_path / "t", tmp_path / "d"
    shutil.copytree(paths.target, target_dir)
    shutil.copytree(paths.draft, draft_dir)
    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(src, *args, **kwargs):
        calls.append(str(src))
        return original(src, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    first = generate(PROMPTS[0], target=str(target_dir), draft=str(draft_dir), method="sd", max_new_tokens=8)
    second = generate(PROMPTS[0], target=target_dir, draft=f"{draft_dir}/", method="sd", max_new_tokens=8)
    monkeypatch.chdir(tmp_path)
    third = generate(PROMPTS[0], target="t", draft="./d", method="sd", max_new_tokens=8)
    assert len(calls) == 2, calls  # target once, draft once
    assert first.token_ids == second.token_ids == third.token_ids
    assert load_model(target_dir) is load_model(str(target_dir)) is load_model("t")


# --- user errors ----------------------------------------------------------------------------------------------------


LONG = "value = compute(value, other_value)\n" * 200


@pytest.mark.parametrize("kwargs,fragment", [
    ({"method": "beam"}, "method"),
    ({"method": "hf-assisted"}, "method"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"gamma": 0}, "gamma"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "  \n\t "}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": LONG}, "positions"),
    ({"draft": None}, "draft"),
    ({"draft": "draft_other_size"}, "vocab"),
    ({"draft": "draft_other_tokens"}, "tokenizer"),
    ({"target": "missing"}, "not found"),
    ({"draft": "missing"}, "not found"),
    ({"target": "no_config"}, "config.json"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_user_errors_raise_retrospec_error(paths, tmp_path, kwargs, fragment):
    (tmp_path / "no_config").mkdir()
    named = {"draft_other_size": paths.draft_other_size, "draft_other_tokens": paths.draft_other_tokens,
             "missing": tmp_path / "missing", "no_config": tmp_path / "no_config"}
    args = {"prompt": PROMPTS[0], "target": paths.target, "draft": paths.draft, "method": "sd",
            "max_new_tokens": 8}
    args.update({k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()})
    prompt = args.pop("prompt")
    with pytest.raises(RetrospecError) as info:
        generate(prompt, **args)
    msg = str(info.value)
    assert "\n" not in msg.strip()
    assert fragment.lower() in msg.lower()
    with pytest.raises(RetrospecError):  # stream validates up front, before any iteration
        stream(prompt, **args)
