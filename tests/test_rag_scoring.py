"""Speculative RAG scoring primitives against hand-computed forwards on tiny models: batched greedy decoding
(``batched.greedy_batch``) equals one-at-a-time greedy row by row, with the raw log-probs of a fresh forward;
teacher-forced span log-probs (``rag.scoring.span_logprobs``) equal a hand-written sum over offsets; the prompts'
spans slice exactly to the strings they stand for; ρ_draft from generated log-probs equals the teacher-forced
rescoring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import VOCAB, sharpen, tiny_llama, tiny_qwen2
from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate
from retrospec.errors import RetrospecError
from retrospec.models.loading import load_model
from retrospec.batched import greedy_batch
from retrospec.speculative_rag.data import Passage
from retrospec.speculative_rag.pipeline import Draft, RagConfig, RagPipeline
from retrospec.speculative_rag.prompts import (ANSWER_TAG, RATIONALE_TAG, REFLECTION, answer_prompt, draft_reply, draft_spans,
                                   drafter_prompt, first_line, format_documents, parse_draft, verifier_text)
from retrospec.speculative_rag.scoring import span_logprobs, token_logprob_sum, token_spans

pytestmark = pytest.mark.usefixtures("single_thread")

PAD = VOCAB - 2
LENGTHS = (3, 7, 12, 20)
MAX_NEW = 10


# ---------------------------------------------------------------------------------------------------------------------
# greedy_batch


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    model = (tiny_llama if request.param == "llama" else tiny_qwen2)(seed=3)
    return sharpen(model, 8.0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist() for n in LENGTHS]


def _oracle(model, prompts, eos_ids=frozenset(), n=MAX_NEW):
    return [autoregressive_generate(model, p, sampling=SamplingConfig(), max_new_tokens=n, eos_ids=eos_ids)
            for p in prompts]


@torch.no_grad()
def _fresh_logprobs(model, prompt, tokens):
    """log p(tokens[t] | prompt + tokens[:t]) from a fresh full forward per step, and the top-2 margin."""
    out, margins = [], []
    for t, tok in enumerate(tokens):
        logits = model(input_ids=torch.tensor([list(prompt) + list(tokens[:t])])).logits[0, -1].double()  # [V]
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(2).values
        out.append(float(logp[tok]))
        margins.append(float(top[0] - top[1]))
    return out, margins


def test_greedy_batch_equals_one_at_a_time(tiny, prompts):
    ref = _oracle(tiny, prompts)
    out = greedy_batch(tiny, prompts, max_new_tokens=MAX_NEW, pad_id=PAD)
    assert out.tokens == ref
    assert all(len(r) == MAX_NEW for r in out.tokens) and out.steps == MAX_NEW - 1
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        fresh, margins = _fresh_logprobs(tiny, p, toks)
        assert min(margins) > 1e-3  # the argmax is no near tie: token-for-token equality means something
        np.testing.assert_allclose(lps, fresh, atol=1e-4, rtol=0)
    # the pad id is invisible: another pad id gives the same rows
    again = greedy_batch(tiny, prompts, max_new_tokens=MAX_NEW, pad_id=0)
    assert again.tokens == out.tokens
    np.testing.assert_allclose(np.array(again.logprobs), np.array(out.logprobs), atol=1e-5)


def _token_only_in_row(rows, row):
    """(step, token): a token that ``rows[row]`` emits at ``step`` >= 2 for the first time and no other row emits."""
    others = {t for i, r in enumerate(rows) if i != row for t in r}
    for step in range(2, len(rows[row]) - 1):
        tok = rows[row][step]
        if tok not in rows[row][:step] and tok not in others:
            return step, tok
    return None


def test_greedy_batch_per_row_eos_and_stop(tiny, prompts):
    free = _oracle(tiny, prompts)
    picks = [(i, _token_only_in_row(free, i)) for i in range(len(free))]
    picks = [(i, p) for i, p in picks if p is not None]
    assert len(picks) >= 2, free
    (eos_row, (eos_step, eos)), (stop_row, (stop_step, stop_tok)) = picks[0], picks[1]

    ref = _oracle(tiny, prompts, eos_ids=frozenset({eos}))
    assert len(ref[eos_row]) == eos_step + 1 and ref[eos_row][-1] == eos  # this row stops early...
    assert all(len(r) == MAX_NEW for i, r in enumerate(ref) if i != eos_row)  # ...the others run on

    calls = []

    def stop(row):
        calls.append(list(row))
        return row[-1] == stop_tok

    out = greedy_batch(tiny, prompts, max_new_tokens=MAX_NEW, eos_ids=frozenset({eos}), pad_id=PAD, stop=stop)
    want = [r[: stop_step + 1] if i == stop_row else r for i, r in enumerate(ref)]
    assert out.tokens == want
    assert out.tokens[eos_row][-1] == eos and out.tokens[stop_row][-1] == stop_tok
    assert out.steps == MAX_NEW - 1  # two rows finished early; the rest kept decoding
    assert all(len(lp) == len(t) for lp, t in zip(out.logprobs, out.tokens))
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        np.testing.assert_allclose(lps, _fresh_logprobs(tiny, p, toks)[0], atol=1e-4, rtol=0)
    assert calls and all(c[-1] != eos for c in calls)  # a row that ended at EOS is not asked whether to stop


def test_greedy_batch_edges(tiny, prompts):
    one = greedy_batch(tiny, prompts[1:2], max_new_tokens=1, pad_id=PAD)
    assert one.tokens == [_oracle(tiny, prompts[1:2], n=1)[0]] and one.steps == 0
    everyone_stops = greedy_batch(tiny, prompts, max_new_tokens=MAX_NEW, pad_id=PAD, stop=lambda row: True)
    assert [len(r) for r in everyone_stops.tokens] == [1] * len(prompts) and everyone_stops.steps == 0
    with pytest.raises(RetrospecError, match="non-empty"):
        greedy_batch(tiny, [[1, 2], []], max_new_tokens=3)
    with pytest.raises(RetrospecError, match="non-empty"):
        greedy_batch(tiny, [], max_new_tokens=3)
    with pytest.raises(RetrospecError, match="max_new_tokens"):
        greedy_batch(tiny, prompts, max_new_tokens=0)


# ---------------------------------------------------------------------------------------------------------------------
# span_logprobs


@pytest.fixture(scope="module")
def chat(chat_models):
    return load_model(chat_models.target)


@pytest.fixture(scope="module")
def plain_tok(chat_models):
    tok = load_model(chat_models.no_template).tokenizer
    assert not getattr(tok, "chat_template", None)
    return tok


@torch.no_grad()
def hand_span_logprob(model, tok, text, span):
    """Independent re-implementation: one forward of the text alone, sum over the tokens sharing a character with
    ``span`` (never token 0), of log_softmax(logits[t - 1])[ids[t]]."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
    want = set(range(*span))
    covered = [t for t, (s, e) in enumerate(enc["offset_mapping"]) if t > 0 and want & set(range(s, e))]
    return float(sum(logp[t - 1, ids[t]] for t in covered)), covered


def _offsets(tok, text):
    return tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def test_span_logprobs_equal_hand_computed(chat, plain_tok):
    model, tok = chat.model, chat.tokenizer
    q, a, b = "Who wrote Hamlet?", "William Shakespeare", "Shakespeare wrote the play Hamlet in about 1600."
    text, sp = verifier_text(tok, q, a, b)
    assert text.startswith("<|im_start|>user\n") and text.endswith("Yes<|im_end|>\n")
    some = text.index(" wrote") + 1  # "wrot": starts inside the token " w"
    the = text.index(" the") + 2  # "he play": starts inside " the"
    whole = (the - 2, the + 2)  # " the", exactly one token
    # (this BPE spells "Yes" / " Yes" as single-character tokens, so mid-token starts are taken from " w" / " the")
    spans = [sp["answer"], sp["rationale"], sp["yes"], (some, some + 4), (the, the + 7), whole]
    got = span_logprobs(model, tok, [text], [spans])
    assert got.shape == (1, len(spans)) and got.dtype == np.float64
    offsets = _offsets(tok, text)
    for s, span in enumerate(spans):
        want, covered = hand_span_logprob(model, tok, text, span)
        assert covered and got[0, s] == pytest.approx(want, abs=1e-5)
        assert token_spans(offsets, span) == covered
    # a span that starts mid-token is scored by the whole token that carries it
    _, mid = hand_span_logprob(model, tok, text, (some, some + 4))
    assert offsets[mid[0]][0] < some and text[slice(*offsets[mid[0]])] == " w"
    assert text[slice(*sp["yes"])] == "Yes"

    # without a chat template: "... (Yes or No) Yes" — the final "Yes" after a space, not the one in R
    ptext, psp = verifier_text(plain_tok, q, a, b)
    assert ptext.endswith(f"{REFLECTION} Yes") and psp["yes"] == (len(ptext) - 3, len(ptext))
    pspans = [psp["answer"], psp["rationale"], psp["yes"], (psp["yes"][0] - 1, psp["yes"][1])]  # " Yes" too
    pgot = span_logprobs(model, plain_tok, [ptext], [pspans])
    for s, span in enumerate(pspans):
        assert pgot[0, s] == pytest.approx(hand_span_logprob(model, plain_tok, ptext, span)[0], abs=1e-5)
    assert pgot[0, 3] < pgot[0, 2] < 0  # " Yes" adds the space token's log-prob
    # the tokenizer without a template is the same tokenizer: same scores for the same text
    assert span_logprobs(model, tok, [ptext], [pspans]) == pytest.approx(pgot, abs=1e-9)


def test_span_logprobs_batching_and_edges(chat, plain_tok):
    model, tok = chat.model, chat.tokenizer
    texts, spans = [], []
    for q, a, b in [("Who?", "Bach", "Bach wrote it."),
                    ("Where is the Louvre and what does it keep?", "Paris", "The Louvre in Paris keeps the Mona Lisa, "
                                                                         "painted by Leonardo da Vinci."),
                    ("When did the Titanic sink?", "1912", "It sank in April 1912.")]:
        for t in (tok, plain_tok):
            text, sp = verifier_text(t, q, a, b)
            texts.append(text)
            spans.append([sp["answer"], sp["rationale"], sp["yes"], (sp["yes"][0], sp["yes"][0])])
    lengths = {len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts}
    assert len(lengths) == len(texts)  # all different: right padding in the batched call
    together = span_logprobs(model, tok, texts, spans, batch_size=8)
    alone = np.concatenate([span_logprobs(model, tok, [t], [s], batch_size=1) for t, s in zip(texts, spans)])
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(span_logprobs(model, tok, texts, spans, batch_size=4), alone, atol=1e-5, rtol=0)
    assert (together[:, 3] == 0).all() and (together[:, :3] < 0).all()  # empty span: 0
    for i, (text, sp) in enumerate(zip(texts, spans)):
        assert together[i, 2] == pytest.approx(hand_span_logprob(model, tok, text, sp[2])[0], abs=1e-5)

    assert span_logprobs(model, tok, [], []).shape == (0, 0)
    with pytest.raises(RetrospecError, match="one list of spans per text"):
        span_logprobs(model, tok, texts[:2], spans[:1])
    with pytest.raises(RetrospecError, match="covers no token"):
        span_logprobs(model, tok, [texts[0]], [[(0, 1)]])  # only token 0: no left context, never scored
    with pytest.raises(RetrospecError, match="covers no token"):
        span_logprobs(model, tok, [texts[0]], [[(len(texts[0]) + 5, len(texts[0]) + 9)]])


def test_token_logprob_sum():
    offsets = [(0, 2), (2, 5), (5, 5), (5, 9)]
    lps = [-1.0, -2.0, -4.0, -8.0]
    assert token_logprob_sum(lps, offsets, (0, 5)) == -3.0  # a zero-width token at the span's edge does not count
    assert token_logprob_sum(lps, offsets, (5, 9)) == -8.0
    assert token_logprob_sum(lps, offsets, (1, 3)) == -3.0  # the first token counts
    assert token_logprob_sum(lps, offsets, (5, 5)) == 0.0
    assert token_spans(offsets, (0, 9)) == [1, 3]  # token 0 (no context) and the zero-width one excluded


# ---------------------------------------------------------------------------------------------------------------------
# prompts


DOCS = [Passage("p1", "Hamlet", "Hamlet is a tragedy by William Shakespeare."),
        Passage("p2", "", "The Globe Theatre was in London.")]


@pytest.mark.parametrize("templated", [True, False])
@pytest.mark.parametrize("q, a, b", [
    ("Who wrote Hamlet?", "William Shakespeare", "Hamlet is a tragedy by William Shakespeare."),
    ("Yes or no: is Paris in France?", "Yes", "Yes, Paris is in France. Yes"),  # "Yes" everywhere
    ("Q?", "a", ""),  # empty rationale
    ("user", "assistant", "Answer: nested Explanation: tags"),  # words of the template inside the messages
])
def test_verifier_text_spans(chat, plain_tok, templated, q, a, b):
    tok = chat.tokenizer if templated else plain_tok
    text, sp = verifier_text(tok, q, a, b)
    assert set(sp) == {"answer", "rationale", "yes"}
    assert text[slice(*sp["answer"])] == a and text[slice(*sp["rationale"])] == b
    assert text[slice(*sp["yes"])] == "Yes"
    assert sp["answer"][1] <= sp["rationale"][0] < sp["yes"][0]
    assert text.index(REFLECTION) < sp["yes"][0]
    if templated:
        assert text[sp["yes"][1]:] == "<|im_end|>\n"
    else:
        assert text == f"Question: {q}\n{ANSWER_TAG} {a}\nExplanation: {b}\n{REFLECTION} Yes"
    assert verifier_text(None, q, a, b) == verifier_text(plain_tok, q, a, b)


@pytest.mark.parametrize("templated", [True, False])
def test_drafter_prompt_and_draft_spans(chat, plain_tok, templated):
    tok = chat.tokenizer if templated else plain_tok
    prompt = drafter_prompt(tok, "Who wrote Hamlet?", DOCS)
    assert prompt.endswith(RATIONALE_TAG)
    assert "Document [1] (Title: Hamlet) Hamlet is a tragedy" in prompt and "Document [2] The Globe" in prompt
    assert prompt.startswith("<|im_start|>user\n") == templated
    for rationale, answer in [("Hamlet is a tragedy by William Shakespeare.", "William Shakespeare"),
                              ("", "x"), ("r", ""), ("Answer: tricky", "Answer: too")]:
        text, b, a = draft_spans(prompt, rationale, answer)
        assert text == prompt + draft_reply(rationale, answer) == f"{prompt} {rationale}\nAnswer: {answer}"
        assert text[slice(*b)] == rationale and text[slice(*a)] == answer
    ap = answer_prompt(tok, "Who wrote Hamlet?", DOCS)
    cb = answer_prompt(tok, "Who wrote Hamlet?", [])
    assert ap.endswith(ANSWER_TAG) and cb.endswith(ANSWER_TAG)
    assert "Document [1]" in ap and "Document" not in cb and "using the documents" not in cb
    assert format_documents([]) == ""


@pytest.mark.parametrize("generated, want", [
    (" Hamlet is a tragedy by William Shakespeare.\nAnswer: William Shakespeare\n",
     ("Hamlet is a tragedy by William Shakespeare.", "William Shakespeare", True)),
    (" Hamlet is a tragedy\nAnswer: Shakespeare", ("Hamlet is a tragedy", "Shakespeare", True)),  # no final newline
    (" it was written   around\n 1600 by him", ("it was written around 1600 by him", "", False)),  # no Answer:
    (" something\nAnswer:   \n", ("something", "", False)),  # empty answer
    (" something\nAnswer:", ("something", "", False)),
    (" two\nlines\nAnswer:  Paris \nsecond line\nAnswer: London", ("two lines", "Paris", True)),  # multi-line
    (" r\nAnswer:\n\n  Paris\nmore", ("r", "Paris", True)),  # the answer on a later line
    ("", ("", "", False)),
])
def test_parse_draft(generated, want):
    assert parse_draft(generated) == want


def test_first_line():
    assert first_line("  Paris\nLondon") == "Paris"
    assert first_line("\n\n  Paris  ") == "Paris"
    assert first_line("   ") == ""


# ---------------------------------------------------------------------------------------------------------------------
# ρ_draft: generated log-probs == teacher-forced rescoring


@torch.no_grad()
def _forced(model, prompt_ids, cont_ids):
    """The log-probs a greedy generator would have recorded for ``cont_ids`` after ``prompt_ids``."""
    ids = torch.tensor([list(prompt_ids) + list(cont_ids)])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [T, V]
    n = len(prompt_ids)
    return [float(logp[n - 1 + t, c]) for t, c in enumerate(cont_ids)]


@pytest.mark.parametrize("rationale, answer, tail", [
    ("some words", "foo", "\n"),
    ("Hamlet is a tragedy by William Shakespeare.", "William Shakespeare", "\nmore text"),
    ("the play", "1600", ""),
    ("Le café crème coûte 3 €.", "3 €", "\n"),  # multi-byte characters: byte tokens decode to partial text
])
def test_generated_logprob_equals_rescoring(chat, rationale, answer, tail):
    """``_generated_logprob`` sums the log-probs the drafter recorded while writing " β\\nAnswer: α..." after the
    prompt; ``span_logprobs`` re-runs a forward over ``prompt + " β\\nAnswer: α"`` tokenized as one text. They are
    equal when the joint tokenization splits at the prompt/continuation boundary (it does here: "Rationale:" ends
    with ":" and the byte-level pre-tokenizer starts a new word at the space) — checked, not assumed."""
    tok = chat.tokenizer
    pipe = RagPipeline(None, chat, chat, RagConfig())
    prompt = drafter_prompt(tok, "Who wrote Hamlet?", DOCS)
    continuation = draft_reply(rationale, answer) + tail
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(continuation, add_special_tokens=False)["input_ids"]
    text, b_span, a_span = draft_spans(prompt, rationale, answer)
    joint = tok(text + tail, add_special_tokens=False)["input_ids"]
    assert joint == p_ids + c_ids  # same tokens whether generated after the prompt or tokenized with it
    lps = _forced(chat.model, p_ids, c_ids)
    decoded = tok.decode(c_ids, skip_special_tokens=True)
    assert decoded == continuation
    assert parse_draft(decoded) == (rationale, answer, True)
    got = pipe._generated_logprob(c_ids, lps, decoded)
    want = span_logprobs(chat.model, tok, [text], [[b_span, a_span]])[0].sum()
    assert got == pytest.approx(want, abs=1e-3)
    # and by hand: exactly the continuation's tokens over β and α (the " " before β rides on β's first token)
    c_off = [(s - len(prompt), e - len(prompt)) for s, e in
             tok(text + tail, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][len(p_ids):]]
    b0, b1 = 1, 1 + len(rationale)
    a1 = len(draft_reply(rationale, answer))
    a0 = a1 - len(answer)
    picked = [lp for lp, (s, e) in zip(lps, c_off) if (s < b1 and e > b0) or (s < a1 and e > a0)]
    assert got == pytest.approx(sum(picked), abs=1e-5)


def test_draft_generated_vs_rescored(chat, monkeypatch):
    """``RagPipeline.draft`` with ``drafter_rescore`` off (ρ_draft from the generated log-probs) and on (a
    teacher-forced forward): equal log_draft for drafts that completed. A random tiny model never writes "Answer:",
    so the generator is replaced by one that 'writes' a chosen continuation with its true log-probs."""
    tok = chat.tokenizer
    docs = DOCS + [Passage("p3", "Bach", "Bach wrote the Brandenburg Concertos.")]
    subsets = [(0, 1), (1, 2), (0, 2)]
    replies = [" Hamlet is a tragedy by William Shakespeare.\nAnswer: William Shakespeare\n",
               " Bach wrote the Brandenburg Concertos in Köthen.\nAnswer: Bach in Köthen, 1721 ★<|im_end|>",
               " no answer tag at all"]  # completed, completed (ends with the end of turn), no "Answer:"

    def fake_generate(self, model, prompts, max_new, stop=None):
        rows = []
        for j, ids in enumerate(prompts):
            if len(prompts) == len(subsets):
                cont = tok(replies[j], add_special_tokens=False)["input_ids"]
            else:  # the follow-up for drafts without "Answer:": answer " Leipzig\n"
                cont = tok(" Leipzig\n", add_special_tokens=False)["input_ids"]
            rows.append((cont, _forced(model.model, ids, cont)))
        return rows

    monkeypatch.setattr(RagPipeline, "_generate", fake_generate)
    results = {}
    for rescore in (False, True):
        pipe = RagPipeline(None, chat, chat, RagConfig(drafter_rescore=rescore))
        results[rescore] = pipe.draft("Who wrote Hamlet?", docs, subsets)
    gen, res = results[False], results[True]
    assert [d.subset for d in gen] == [["p1", "p2"], ["p2", "p3"], ["p1", "p3"]]
    assert [(d.rationale, d.answer) for d in gen] == [(d.rationale, d.answer) for d in res] == [
        ("Hamlet is a tragedy by William Shakespeare.", "William Shakespeare"),
        ("Bach wrote the Brandenburg Concertos in Köthen.", "Bach in Köthen, 1721 ★"),  # multi-byte characters
        ("no answer tag at all", "Leipzig")]
    for j in (0, 1):  # completed drafts: generated == rescored
        assert gen[j].log_draft == pytest.approx(res[j].log_draft, abs=1e-3)
        assert gen[j].log_draft < 0
    assert gen[2].log_draft == pytest.approx(res[2].log_draft, abs=1e-5)  # a follow-up draft: rescored in both runs
    prompt = drafter_prompt(tok, "Who wrote Hamlet?", [docs[0], docs[2]])
    text, b, a = draft_spans(prompt, "no answer tag at all", "Leipzig")
    assert gen[2].log_draft == pytest.approx(span_logprobs(chat.model, tok, [text], [[b, a]])[0].sum(), abs=1e-5)
    assert gen[2].tokens == len(tok(replies[2], add_special_tokens=False)["input_ids"]) + len(
        tok(" Leipzig\n", add_special_tokens=False)["input_ids"])
    assert all(isinstance(d, Draft) and math.isfinite(d.log_draft) for d in gen + res)
