"""The Speculative RAG drafter as a LoRA adapter: ``train_rag_drafter`` on a tiny chat model writes a complete
adapter directory (or nothing); ``load_model(adapter)`` is the base plus exactly the LoRA deltas of the saved file,
in a private copy (the cached base is untouched); a base with another identity is refused; an int8-packed adapter
loads within the int8 error bound; extractive rationales and the training examples' labels."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from retrospec.errors import RetrospecError
from retrospec.models.adapters import ADAPTER_META, INT8_WEIGHTS, PEFT_WEIGHTS, is_adapter_dir, pack_adapter
from retrospec.models.loading import load_model
from retrospec.speculative_rag.data import Passage, Question, split_of
from retrospec.speculative_rag.prompts import draft_reply, drafter_prompt
from retrospec.train.rag_drafter import RagDrafterConfig, build_examples, extractive_rationale, train_rag_drafter

pytestmark = pytest.mark.usefixtures("single_thread")

PASSAGES = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital of France. It lies on the Seine."},
    {"id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany."},
    {"id": "titanic", "title": "Titanic", "text": "The ship left Southampton. The Titanic sank in 1912."},
    {"id": "bach", "title": "Bach", "text": "Bach composed the Brandenburg Concertos."},
    {"id": "gold", "title": "Gold", "text": "Gold has the chemical symbol Au."},
    {"id": "tokyo", "title": "Tokyo", "text": "Tokyo is the capital of Japan."},
]
QUESTIONS = [  # t1, t2, t4, t6: train split; t3, e1: eval split (never used for training)
    {"id": "t1", "question": "What is the capital of France?", "answers": ["Paris"], "gold_passage": "paris"},
    {"id": "t2", "question": "When did the Titanic sink?", "answers": ["1912"], "gold_passage": "titanic"},
    {"id": "t4", "question": "Which river runs through Paris?", "answers": ["Seine"], "gold_passage": "paris"},
    {"id": "t6", "question": "What is the symbol of gold?", "answers": ["Ag"], "gold_passage": "gold"},  # no sentence
    {"id": "t3", "question": "Who composed the Brandenburg Concertos?", "answers": ["Bach"], "gold_passage": "bach"},
    {"id": "e1", "question": "What is the capital of Japan?", "answers": ["Tokyo"], "gold_passage": "tokyo"},
]
LORA_FILES = {"adapter_config.json", "adapter_model.safetensors", ADAPTER_META, "manifest.json"}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_question_ids_are_in_the_intended_splits():
    assert [split_of(q["id"]) for q in QUESTIONS] == ["train"] * 4 + ["eval"] * 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rag_adapter")
    return root, write_jsonl(root / "q.jsonl", QUESTIONS), write_jsonl(root / "p.jsonl", PASSAGES)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(chat_models, data):
    root, questions, passages = data
    base = load_model(chat_models.target)
    before = _snapshot(base.model)
    out = root / "adapter"
    logs = []
    manifest = train_rag_drafter(RagDrafterConfig(base=str(chat_models.target), questions=questions,
                                                  passages=passages, out=str(out), steps=2, accum=1,
                                                  dtype="float32", embedder=None, log_every=1), log=logs.append)
    return out, manifest, before, logs


def test_training_writes_an_adapter(trained, chat_models):
    out, manifest, before, logs = trained
    assert LORA_FILES <= {p.name for p in out.iterdir()} <= LORA_FILES | {"README.md"}  # + peft's model card
    assert is_adapter_dir(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".adapter.tmp")]
    weights = load_file(out / "adapter_model.safetensors")
    assert weights and all(v.dtype == torch.float16 for v in weights.values())
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())  # it trained
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(chat_models.target) and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    meta = json.loads((out / ADAPTER_META).read_text())
    assert meta["base"] == str(chat_models.target)
    assert set(meta["base_identity"]) == {"config_hash", "weights_digest", "fingerprint", "rounded", "dtype"}
    saved = json.loads((out / "manifest.json").read_text())
    assert saved == json.loads(json.dumps(manifest))
    assert manifest["steps"] == 2 and manifest["examples_seen"] == 2
    data = manifest["data"]
    assert data["split"] == "train" and data["questions"] == 4 and data["usable"] == 4  # eval questions unused
    assert data["no_rationale"] == 1 and data["examples"] == data["used"] == 3
    assert len(manifest["history"]) == 2 and manifest["loss_first"] > 0
    assert any("3 examples from 4 train-split questions" in line for line in logs)
    base = load_model(chat_models.target)
    assert all(torch.equal(v, before[k]) for k, v in base.model.state_dict().items())  # training used a copy


def test_adapter_loads_as_base_plus_lora_delta(trained, chat_models):
    out, _, before, _ = trained
    base = load_model(chat_models.target)
    tuned = load_model(out)
    assert tuned is load_model(out)  # cached
    assert tuned.model is not base.model and tuned.tokenizer is base.tokenizer and tuned.path == str(out)
    assert all(torch.equal(v, before[k]) for k, v in base.model.state_dict().items())  # the cached base: untouched

    weights = {k: v.float() for k, v in load_file(out / "adapter_model.safetensors").items()}
    scale = 16 / 8  # lora_alpha / r
    expected = _snapshot(base.model)
    modules = 0
    for key in weights:
        if not key.endswith("lora_A.weight"):
            continue
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = weights[key], weights[key.replace("lora_A", "lora_B")]  # [r, in], [out, r]
        expected[f"{name}.weight"] = expected[f"{name}.weight"] + (b @ a) * scale
        modules += 1
    assert modules == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    got = tuned.model.state_dict()
    assert set(got) == set(expected)
    for k, v in got.items():
        torch.testing.assert_close(v, expected[k], atol=1e-6, rtol=0, msg=k)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], before[q])  # a nonzero delta...
    assert (got[q] - before[q]).abs().max() < 0.05  # ...and a small one after 2 steps

    ids = torch.tensor([base.tokenizer("Question: What is the capital of France?")["input_ids"]])
    with torch.no_grad():
        want_model = type(base.model)(base.model.config)
        want_model.load_state_dict(expected)
        want = want_model.eval()(input_ids=ids).logits
        have = tuned.model(input_ids=ids).logits
        plain = base.model(input_ids=ids).logits
    torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    assert not torch.allclose(have, plain, atol=1e-6)


def test_adapter_loads_in_bfloat16(trained, chat_models):
    """``rag answer --dtype bfloat16``: the check and the merge use the float32 base and the merged model is then
    rounded once."""
    out, _, _, _ = trained
    tuned = load_model(out)
    half = load_model(out, dtype=torch.bfloat16)
    assert half is not tuned and next(half.model.parameters()).dtype == torch.bfloat16
    for k, v in half.model.state_dict().items():
        torch.testing.assert_close(v, tuned.model.state_dict()[k].to(torch.bfloat16), atol=0, rtol=0, msg=k)
    assert next(load_model(chat_models.target).model.parameters()).dtype == torch.float32


def test_adapter_for_another_base_is_refused(trained, chat_models, tmp_path):
    out, _, _, _ = trained
    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    meta = json.loads((forged / ADAPTER_META).read_text())
    meta["base_identity"]["fingerprint"] = "0123456789abcdef"
    (forged / ADAPTER_META).write_text(json.dumps(meta))
    with pytest.raises(RetrospecError) as err:
        load_model(forged)
    msg = str(err.value)
    assert "fingerprint 0123456789abcdef" in msg and "\n" not in msg
    assert load_model(chat_models.target).model is not None  # the base still loads

    other = tmp_path / "other-base"  # the recorded identity, but "base" now names a model with other weights
    shutil.copytree(out, other)
    meta = json.loads((other / ADAPTER_META).read_text())
    meta["base"] = str(chat_models.draft)
    (other / ADAPTER_META).write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="trained on another .* fingerprint"):
        load_model(other)

    headless = tmp_path / "headless"
    shutil.copytree(out, headless)
    (headless / ADAPTER_META).unlink()
    with pytest.raises(RetrospecError, match=f"no readable {ADAPTER_META}"):
        load_model(headless)

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RetrospecError, match="could not load adapter"):
        load_model(broken)


def test_int8_adapter_round_trip(trained, tmp_path):
    """``pack_adapter``: int8 weights under their own file name, the storage recorded; the merged model is within
    the int8 error bound of the float16 adapter's (per element: alpha/r * sum_k |B||dA| + |dB||A| + |dB||dA|)."""
    out, _, _, _ = trained
    packed = tmp_path / "int8"
    report = pack_adapter(out, packed)
    assert is_adapter_dir(packed) and (packed / INT8_WEIGHTS).is_file() and not (packed / PEFT_WEIGHTS).exists()
    assert report["bytes_after"] == (packed / INT8_WEIGHTS).stat().st_size < report["bytes_before"]
    meta = json.loads((packed / ADAPTER_META).read_text())
    assert meta["storage"] == "int8" and meta["base_identity"] == json.loads((out / ADAPTER_META).read_text())[
        "base_identity"]
    assert json.loads((packed / "manifest.json").read_text())["packed"]["storage"] == "int8"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    fp16, int8 = load_model(out).model.state_dict(), load_model(packed).model.state_dict()
    weights = {k: v.float() for k, v in load_file(out / "adapter_model.safetensors").items()}
    stored = load_file(packed / INT8_WEIGHTS)
    scale = 16 / 8  # lora_alpha / r
    checked = 0
    for key in weights:
        if not key.endswith("lora_A.weight"):
            continue
        kb = key.replace("lora_A", "lora_B")
        a, b = weights[key].abs(), weights[kb].abs()  # [r, in], [out, r]
        da = (stored[key + ".int8_scale"].float()[:, None] / 2).expand_as(a)  # [r, in]: |error| bound of A
        db = (stored[kb + ".int8_scale"].float()[:, None] / 2).expand_as(b)  # [out, r]
        bound = scale * (b @ da + db @ a + db @ da)  # [out, in]
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        diff = (int8[name] - fp16[name]).abs()
        assert bool((diff <= bound * (1 + 1e-4) + 1e-7).all()), name
        checked += 1
    assert checked == 2 * 7
    assert any(not torch.equal(int8[k], fp16[k]) for k in fp16)  # lossy
    assert max((int8[k] - fp16[k]).abs().max() for k in fp16) < 1e-3
    assert all(torch.equal(int8[k], fp16[k]) for k in fp16 if "proj" not in k)  # only adapted weights move

    with pytest.raises(RetrospecError, match="already exists"):
        pack_adapter(out, packed)
    with pytest.raises(RetrospecError, match="pack the original adapter"):
        pack_adapter(packed, tmp_path / "twice")
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    state = load_file(broken / INT8_WEIGHTS)
    del state[next(k for k in state if k.endswith(".int8_scale"))]
    save_file(state, broken / INT8_WEIGHTS)
    with pytest.raises(RetrospecError, match="could not load adapter .*has no scale"):
        load_model(broken)
    unknown = tmp_path / "unknown"
    shutil.copytree(packed, unknown)
    meta["storage"] = "int4"
    (unknown / ADAPTER_META).write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="unknown storage 'int4'"):
        load_model(unknown)


def test_failed_training_leaves_nothing(chat_models, data, tmp_path):
    root, questions, passages = data
    useless = write_jsonl(tmp_path / "q.jsonl", [q | {"answers": ["Zanzibar"]} for q in QUESTIONS])
    out = tmp_path / "adapter"
    cfg = RagDrafterConfig(base=str(chat_models.target), questions=useless, passages=passages, out=str(out),
                           steps=1, accum=1, dtype="float32")
    with pytest.raises(RetrospecError, match="no training examples"):
        train_rag_drafter(cfg, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]
    orphans = write_jsonl(tmp_path / "orphans.jsonl", [q | {"gold_passage": "elsewhere"} for q in QUESTIONS])
    with pytest.raises(RetrospecError, match="no training examples"):  # no usable question at all
        train_rag_drafter(RagDrafterConfig(**{**cfg.__dict__, "questions": orphans}), log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orphans.jsonl", "q.jsonl"]
    for bad, fragment in ((dict(steps=None), "exactly one"), (dict(steps=1, seconds=5.0), "exactly one"),
                          (dict(steps=0), "positive"), (dict(steps=None, seconds=0.0), "positive")):
        with pytest.raises(RetrospecError, match=fragment):
            train_rag_drafter(RagDrafterConfig(**{**cfg.__dict__, **bad}), log=lambda *_: None)
    out.mkdir()
    with pytest.raises(RetrospecError, match="already exists"):
        train_rag_drafter(cfg, log=lambda *_: None)


@pytest.mark.parametrize("text, answers, want", [
    ("Paris is the capital of France. It lies on the Seine.", ["Seine"], "It lies on the Seine."),
    ("Paris is the capital of France. It lies on the Seine.", ["paris"], "Paris is the capital of France."),
    ("Paris is the capital of France.  Paris is\nbig.", ["big"], "Paris is big."),  # whitespace normalised
    ("The ship left Southampton! Did it sink? Yes. In 1912 it sank.", ["1912"], "In 1912 it sank."),
    # sentences end before a capital or a digit only: "monks. later" stays one sentence, "c. 1200" does not
    ("It was founded c. 1200 by monks. later it grew.", ["grew"], "1200 by monks. later it grew."),
    ("Nothing relevant here.", ["Paris"], None),
    ("Paris.", ["", "  "], None),  # blank answers never match
    ("one two three four five Paris.", ["Paris"], None),  # longer than max_words
])
def test_extractive_rationale(text, answers, want):
    assert extractive_rationale(text, answers, max_words=5 if "five" in text else 60) == want


def test_build_examples_labels(chat_models):
    tok = load_model(chat_models.target).tokenizer
    passages = [Passage(p["id"], p["title"], p["text"]) for p in PASSAGES]
    questions = [Question(q["id"], q["question"], tuple(q["answers"]), q["gold_passage"]) for q in QUESTIONS[:3]]
    questions.append(Question("t9", "Orphan?", ("x",), "missing-passage"))  # gold passage not in the file
    examples, counts = build_examples(tok, questions, passages, seed=0, max_words=40)
    assert counts == {"questions": 4, "usable": 3, "no_rationale": 0, "examples": 3}
    rationale = {"t1": ("Paris is the capital of France.", "Paris"),
                 "t2": ("The Titanic sank in 1912.", "1912"),
                 "t4": ("It lies on the Seine.", "Seine")}
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for ex in examples:
        assert len(ex["ids"]) == len(ex["labels"])
        labeled = [t for t in ex["labels"] if t != -100]
        first = ex["labels"].index(labeled[0])
        assert all(t == -100 for t in ex["labels"][:first]) and ex["labels"][first:] == ex["ids"][first:]
        assert ex["ids"][-1] == im_end  # the end of turn is learned too
        b, a = rationale[ex["question"]]
        assert tok.decode(labeled[:-1]) == draft_reply(b, a)
        prompt = tok.decode(ex["ids"][:first])
        assert prompt.endswith("Rationale:") and prompt.count("Document [") == 2
        q = next(q for q in questions if q.id == ex["question"])
        gold = next(p for p in passages if p.id == q.gold_passage)
        assert f"{gold.text}" in prompt  # the gold passage and one hard negative, in some order
        assert prompt in (drafter_prompt(tok, q.question, [gold, p]) for p in passages if p.id != gold.id) or \
            prompt in (drafter_prompt(tok, q.question, [p, gold]) for p in passages if p.id != gold.id)
