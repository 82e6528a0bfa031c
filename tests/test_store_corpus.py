"""The benchmark store corpus (``retrospec.bench.store_corpus``): budgets, leakage rules, determinism, and that
``datastore build --corpus`` reads what it writes."""

from __future__ import annotations

import json

import pytest
from conftest import chatml_tokenizer

from retrospec.bench.store_corpus import build_store_corpus, code_piece, first_sentences, main, write_store_corpus
from retrospec.errors import RetrospecError

CODE = [
    ("a.py", "import os\n\nX = 1\n\n@decorator\ndef one(x):\n    return x + 1\n\n\nclass Two:\n    def m(self):\n"
             "        return 2\n\n\ndef three():\n    pass\n"),
    ("b.py", "# no top-level blocks here\nY = [1, 2, 3]\n"),
    ("c.py", "def alpha():\n    return 'a'\n\n\ndef beta():\n    return 'b'\n"),
]


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture
def nq(tmp_path):
    """20 rows; rows 0..4 are 'the bench's'. Row 7 repeats row 1's passage text, row 9 shares row 2's title."""
    titles = [f"Article {i}" for i in range(20)]
    texts = [f"Passage {i} says that thing {i} happened. It was notable. Later it ended in year {1900 + i}."
             for i in range(20)]
    texts[7] = texts[1]
    titles[9] = titles[2]
    with (tmp_path / "passages.jsonl").open("w") as fh:
        for i in range(20):
            fh.write(json.dumps({"id": f"nq{i}", "title": titles[i], "text": texts[i]}) + "\n")
    with (tmp_path / "questions.jsonl").open("w") as fh:
        for i in range(20):
            fh.write(json.dumps({"id": f"nq{i}", "question": f"what happened to thing {i}", "answers": ["x"],
                                 "gold_passage": f"nq{i}"}) + "\n")
    return tmp_path


def build(tok, nq, **kw):
    args = dict(nq_dir=nq, code_tokens=10_000, passage_tokens=10_000, chat_tokens=10_000, skip=5, seed=0,
                stdlib_texts=CODE)
    return build_store_corpus(tok, **(args | kw))


def test_code_piece_starts_at_a_top_level_block():
    import random

    text = CODE[0][1]
    for seed in range(10):
        piece = code_piece(text, random.Random(seed), piece_chars=30)
        assert piece.startswith(("@decorator\ndef one", "class Two", "def three"))
        assert piece in text + "\n" or piece.rstrip() in text
    assert code_piece(CODE[1][1], random.Random(0), 100) is None


def test_first_sentences():
    assert first_sentences("One. Two. Three.", 9) == "One. Two."
    assert first_sentences("A long first sentence. Two.", 3) == "A long first sentence."


def test_rows_respect_the_bench_rows_and_are_disjoint(tok, nq):
    rows = build(tok, nq, chat_tokens=100)
    code = [r for r in rows if r["source"] == "code"]
    passages = [r for r in rows if r["source"] == "passage"]
    chat = [r for r in rows if r["source"] == "chat"]
    assert [r["ref"] for r in code] == ["a.py", "c.py"]  # b.py has no top-level block
    refs = [r["ref"] for r in passages + chat]
    assert len(refs) == len(set(refs))  # disjoint rows
    ids = {int(r[2:]) for r in refs}
    assert ids == set(range(5, 20)) - {7, 9}  # never a bench row, nor a copy of one, nor the same article
    # the order: code, passages, chat; every row's token count is right; chat turns are the template's rendering
    assert [r["source"] for r in rows] == ["code"] * 2 + ["passage"] * len(passages) + ["chat"] * len(chat)
    for r in rows:
        assert r["tokens"] == len(tok(r["text"], add_special_tokens=False)["input_ids"])
    for r in chat:
        q = f"what happened to thing {r['ref'][2:]}"
        assert r["text"].startswith(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\nPassage ")
    assert passages and chat
    assert build(tok, nq, chat_tokens=100) == rows  # deterministic
    assert build(tok, nq, chat_tokens=100, seed=1) != rows


def test_budgets(tok, nq):
    rows = build(tok, nq, code_tokens=1, passage_tokens=1, chat_tokens=0)
    assert [r["source"] for r in rows] == ["code", "passage"]  # stops as soon as a budget is reached
    assert build(tok, nq, code_tokens=0, passage_tokens=0, chat_tokens=0) == []
    with pytest.raises(RetrospecError, match="chat template"):
        tok2 = chatml_tokenizer()
        tok2.chat_template = None
        build(tok2, nq)
    with pytest.raises(RetrospecError, match="NQ-open file not found"):
        build(tok, nq / "missing")


def test_written_corpus_is_read_by_the_datastore_builder(tok, nq, tmp_path):
    from retrospec.retrieval.corpus import open_text_corpus

    out = tmp_path / "corpus.jsonl"
    summary = write_store_corpus(out, tok, nq_dir=nq, code_tokens=10_000, passage_tokens=10_000,
                                 chat_tokens=10_000, skip=5, stdlib_texts=CODE)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["documents"] == len(rows) and summary["tokens"] == sum(r["tokens"] for r in rows)
    assert list(open_text_corpus(str(out))) == [r["text"] for r in rows]


def test_main_errors(capsys, tmp_path):
    rc = main(["--out", str(tmp_path / "c.jsonl"), "--target", str(tmp_path / "nowhere")])
    assert rc == 2 and "retrospec: error:" in capsys.readouterr().err


def test_prompt_completion_rows_keep_where_the_completion_starts(tok, tmp_path):
    """The ids are the joined text's either way; ``split()`` marks the completion's first token (from offsets, or
    from the prompt encoded alone for a tokenizer without them), and eval samples only where the tokens to guess
    are the completion's, its first one included."""
    from retrospec.bench.datastore_eval import _sample_positions
    from retrospec.retrieval.corpus import open_text_corpus, tokenize

    prompt = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    rows = [{"prompt": prompt, "completion": "Hello, how are you today?"}, {"text": "plain text only, no prompt"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = open_text_corpus(str(tmp_path / "c.jsonl"))
    plain, split = (list(tokenize(docs, tok, progress=False)) for docs in (corpus, corpus.split()))
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert [d.ids.tolist() for d in plain] == [d.ids.tolist() for d in split]
    assert [d.index_from for d in plain] == [0, 0] and [d.index_from for d in split] == [n, 0]

    class NoOffsets:  # a tokenizer without character offsets (a Python one)
        def __call__(self, texts, **kw):
            if kw.get("return_offsets_mapping"):
                raise NotImplementedError
            return tok(texts, add_special_tokens=False)

    assert [d.index_from for d in tokenize(corpus.split(), NoOffsets(), progress=False)] == [n, 0]
    suffix = _sample_positions(split, 1000, 0, min_ctx=2, known=0)
    dense = _sample_positions(split, 1000, 0, min_ctx=1, known=1)
    last = len(split[0].ids) - 1
    assert {t for d, t in suffix if d == 0} == set(range(n - 1, last))  # guesses start at the first reply token
    assert {t for d, t in dense if d == 0} == set(range(n - 2, last))  # x_{t+1} (the last prompt token) filters
    assert min(t for d, t in suffix if d == 1) == 1 and min(t for d, t in dense if d == 1) == 0
