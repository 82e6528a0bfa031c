"""Chat: messages / ``chat=True`` / ``--chat`` apply the target's chat template and stop at its end-of-turn token.

On a tiny saved checkpoint with a ChatML template (``conftest.chat_models``): prompt ids equal
``apply_chat_template(..., tokenize=True)``; the end-of-turn id is found from the template (the tokenizer's EOS is
another token); greedy ar / sd / pld stop at ``<|im_end|>`` and are token-identical to the naive oracle run with
the same EOS ids; the bench gives every method, HF peers included, the same prompt ids and EOS ids; user errors
(no chat template, bad messages) are one-line ``RetrospecError`` / exit 2. Also: ``load_prompts`` with ``question``
rows, the ``chat`` preset, and the default draft of a named target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CHAT_STOP_MESSAGES, chatml_tokenizer

from retrospec import RetrospecError, generate, load_model, stream
from retrospec import api
from retrospec.chat import build_chat_prompt, chat_messages, end_of_turn_ids, validate_messages
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate
from retrospec.tasks import PRESETS, load_prompts, preset

pytestmark = pytest.mark.usefixtures("single_thread")

CONVERSATIONS = [
    [{"role": "user", "content": "Explain what a list comprehension is."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a loop over lines é ü 😀"}],
]
USER_PROMPTS = ["import os\nclass Wrapper:", "Summarise: text wraps at width.", "for line in lines:"]
NQ = Path(__file__).resolve().parents[2] / "shared" / "data" / "nq_open" / "questions.jsonl"


@pytest.fixture(scope="module")
def tok(chat_models):
    return load_model(chat_models.target).tokenizer


def oracle(chat_models, messages, n):
    """Naive greedy decoding of the chat-formatted prompt with EOS ids = the model's + <|im_end|>."""
    tgt = load_model(chat_models.target)
    ids = tgt.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    return autoregressive_generate(tgt.model, ids, sampling=SamplingConfig(), max_new_tokens=n,
                                   eos_ids=tgt.eos_ids() | {chat_models.im_end_id})


# --- prompt construction ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prompt_ids_equal_apply_chat_template(chat_models, tok, messages):
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert build_chat_prompt(tok, messages).prompt_ids == expected
    req = api.prepare(messages=messages, target=chat_models.target, method="ar")
    assert req.prompt_ids == expected
    assert req.stop_ids() == frozenset({chat_models.eos_id, chat_models.im_end_id})
    assert tok.decode(expected).endswith("<|im_start|>assistant\n")  # the generation prompt is added


def test_chat_flag_is_one_user_message(chat_models, tok):
    text = USER_PROMPTS[1]
    a = api.prepare(text, chat=True, target=chat_models.target, method="ar")
    b = api.prepare(messages=[{"role": "user", "content": text}], target=chat_models.target, method="ar")
    raw = api.prepare(text, target=chat_models.target, method="ar")
    assert a.prompt_ids == b.prompt_ids != raw.prompt_ids
    assert raw.eos_ids is None and raw.stop_ids() == frozenset({chat_models.eos_id})  # no chat: EOS unchanged


def test_end_of_turn_detection():
    tok = chatml_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tok) == {im_end}  # from the template; the EOS token <|endoftext|> is not in it
    # a template that closes turns with the EOS token itself (Llama-2 / Mistral style)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert end_of_turn_ids(tok) == {tok.eos_token_id}
    # a marker that is not a single token of the vocabulary is ignored
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    assert end_of_turn_ids(tok) == frozenset()
    tok.chat_template = None
    assert end_of_turn_ids(tok) == frozenset()


# --- generation stops at the end of the turn, losslessly -------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "sd", "pld"])
def test_generation_stops_at_end_of_turn(chat_models, method):
    n = chat_models.stop_step + 10
    res = generate(messages=CHAT_STOP_MESSAGES, target=chat_models.target,
                   draft=chat_models.draft if method == "sd" else None, method=method, max_new_tokens=n)
    assert res.token_ids[-1] == chat_models.im_end_id and len(res.token_ids) == chat_models.stop_step + 1
    assert res.token_ids == oracle(chat_models, CHAT_STOP_MESSAGES, n)
    assert "<|im_end|>" not in res.text and "<|im_start|>" not in res.text  # special tokens are skipped
    assert res.text == load_model(chat_models.target).tokenizer.decode(res.token_ids, skip_special_tokens=True)


def test_without_chat_the_same_ids_run_past_the_end_of_turn(chat_models, tok):
    ids = build_chat_prompt(tok, CHAT_STOP_MESSAGES).prompt_ids
    res = generate(ids, target=chat_models.target, method="ar", max_new_tokens=chat_models.stop_step + 4)
    assert res.token_ids[chat_models.stop_step] == chat_models.im_end_id
    assert len(res.token_ids) > chat_models.stop_step + 1  # the model's own EOS set does not end the turn


@pytest.mark.parametrize("method", ["sd", "pld"])
def test_greedy_chat_equals_oracle(chat_models, method):
    for text in USER_PROMPTS:
        messages = [{"role": "user", "content": text}]
        res = generate(text, chat=True, target=chat_models.target,
                       draft=chat_models.draft if method == "sd" else None, method=method, max_new_tokens=24)
        assert res.token_ids == oracle(chat_models, messages, 24), (method, text)


def test_stream_chat_pieces_concatenate(chat_models):
    s = stream(messages=CONVERSATIONS[2], target=chat_models.target, draft=chat_models.draft, method="sd",
               max_new_tokens=20)
    assert "".join(s) == s.result.text


# --- user errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "messages[0] must be a dict"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user"}], "'content' as a string"),
    ([{"role": "user", "content": 3}], "'content' as a string"),
    ([{"role": "user", "content": "  "}], "empty content"),
    ([{"role": "system", "content": "be nice"}], "at least one user message"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "last message"),
])
def test_bad_messages(chat_models, messages, fragment):
    with pytest.raises(RetrospecError) as e:
        generate(messages=messages, target=chat_models.target, method="ar", max_new_tokens=4)
    assert fragment.lower() in str(e.value).lower() and "\n" not in str(e.value)


def test_chat_argument_errors(chat_models):
    with pytest.raises(RetrospecError, match="either a prompt or messages"):
        chat_messages("x", [{"role": "user", "content": "y"}], chat=False)
    with pytest.raises(RetrospecError, match="as text"):
        generate([1, 2, 3], chat=True, target=chat_models.target, method="ar")
    with pytest.raises(RetrospecError, match="prompt is empty"):
        generate(target=chat_models.target, method="ar")
    with pytest.raises(RetrospecError, match="long context"):
        generate("q", chat=True, context="a document", target=chat_models.target, method="lc")
    assert validate_messages([{"role": "user", "content": "x", "name": "me"}]) == [{"role": "user", "content": "x"}]


def test_missing_chat_template_is_an_error(chat_models, saved_models):
    for target in (chat_models.no_template, saved_models.target):
        with pytest.raises(RetrospecError, match="no chat template"):
            generate("hi", chat=True, target=target, method="ar")


def test_cli_generate_chat(cli, chat_models):
    r = cli("generate", "--target", chat_models.target, "--draft", chat_models.draft, "--method", "sd", "--chat",
            "--prompt", CHAT_STOP_MESSAGES[0]["content"], "--max-new-tokens", 40, "--json")
    assert r.rc == 0, r.err
    obj = json.loads(r.out)
    assert obj["token_ids"] == oracle(chat_models, CHAT_STOP_MESSAGES, 40)
    assert obj["token_ids"][-1] == chat_models.im_end_id and "<|im_end|>" not in obj["text"]


def test_cli_chat_without_template(cli, chat_models, tmp_path):
    cli("generate", "--target", chat_models.no_template, "--method", "ar", "--chat", "--prompt",
        "hi").assert_user_error("no chat template")
    cli("bench", "--target", chat_models.no_template, "--methods", "ar,pld", "--preset", "chat", "--chat",
        "--limit", 1, "--out", tmp_path / "b").assert_user_error("no chat template")
    assert not (tmp_path / "b" / "results.json").exists()


# --- bench -----------------------------------------------------------------------------------------------------------


def test_bench_chat_is_lossless_with_the_same_eos(cli, chat_models, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": CHAT_STOP_MESSAGES[0]["content"], "answers": ["x"]}) + "\n"
                       + json.dumps({"prompt": USER_PROMPTS[0]}) + "\n")
    out = tmp_path / "bench"
    r = cli("bench", "--target", chat_models.target, "--draft", chat_models.draft, "--prompts", prompts, "--chat",
            "--methods", "ar,sd,pld,hf-assisted,hf-pld", "--max-new-tokens", 24, "--no-warmup", "--out", out)
    assert r.rc == 0, r.err
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["chat"] is True
    assert set(res["config"]["eos_ids"]) == {chat_models.eos_id, chat_models.im_end_id}
    assert all(s["lossless"] is True for s in res["summary"]), res["summary"]
    first = [r for r in res["runs"] if r["prompt_index"] == 0]
    assert len(first) == 5
    for run in first:  # every method, HF peers included, stops at the end of the turn
        assert run["token_ids"] == oracle(chat_models, CHAT_STOP_MESSAGES, 24), run["method"]
    assert "chat template" in (out / "report.md").read_text()


def test_bench_chat_preset(cli, chat_models, tmp_path):
    r = cli("bench", "--target", chat_models.target, "--draft", chat_models.draft, "--preset", "chat", "--chat",
            "--limit", 2, "--methods", "ar,sd", "--max-new-tokens", 8, "--no-warmup", "--out", tmp_path)
    assert r.rc == 0, r.err
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["prompts"] == 2 and all(s["lossless"] for s in res["summary"])


def test_load_prompts_question_rows(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"id": "q0", "question": "who wrote hamlet", "answers": ["Shakespeare"]}) + "\n"
                 + json.dumps({"prompt": "p", "question": "ignored"}) + "\n")
    rows = load_prompts(f)
    assert rows[0]["prompt"] == "who wrote hamlet" and rows[0]["answers"] == ["Shakespeare"]
    assert rows[1]["prompt"] == "p"
    f.write_text(json.dumps({"question": " "}) + "\n")
    with pytest.raises(RetrospecError, match="'prompt' or 'question'"):
        load_prompts(f)
    if NQ.is_file():
        nq = load_prompts(NQ)
        assert nq and all(r["prompt"] == r["question"] for r in nq)


def test_chat_preset():
    assert "chat" in PRESETS
    rows = preset("chat", 1000)
    assert 25 <= len(rows) <= 40
    texts = [r["prompt"] for r in rows]
    assert len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    assert {"explain", "summarise", "list", "rewrite", "howto", "knowledge", "code"} <= {r["kind"] for r in rows}
    assert preset("chat", 5) == rows[:5]


# --- default draft of a named target ---------------------------------------------------------------------------------


def test_default_draft_for_a_named_target(chat_models):
    from retrospec.models.named import lookup

    name = str(chat_models.target)  # a path, not a name: no paired draft
    with pytest.raises(RetrospecError, match="needs a draft"):
        api.prepare("x", target=name, method="sd")
    assert api.prepare("x", target=name, method="pld").draft is None
    assert lookup("smollm2-135m").draft == "smollm2-135m-draft"
