"""Chunking and retrieval over a long context (RAPID): tiling, token bounds, budget, similarity floor, order."""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
import pytest

from rapid_fakes import FakeEmbedder
from retrospec.errors import RetrospecError
from retrospec.retrieval.chunks import Chunk, chunk_text, token_counter
from retrospec.retrieval.context_retrieval import LongContextRetriever, RetrievalConfig, join_chunks, select_chunks


@pytest.fixture(scope="module")
def tok():
    from retrospec.train.tokenizer import train_bpe

    return train_bpe([inspect.getsource(textwrap)], vocab_size=400)


def _doc(n: int = 30, needle_at: int = 17) -> str:
    paras = []
    for i in range(n):
        body = f"Paragraph {i} talks about ordinary weather and gardens and roads number {i}."
        if i == needle_at:
            body = "The zebra quantum lighthouse secret is kept in paragraph seventeen."
        paras.append(body + "\n")
    return "".join(paras)


def test_chunks_tile_the_text_within_the_token_bound(tok):
    text = inspect.getsource(textwrap) + "x = '" + "abc " * 400 + "'\n"  # ends with one very long line
    chunks = chunk_text(text, tok, max_tokens=64)
    assert "".join(c.text for c in chunks) == text
    count = token_counter(tok)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for prev, c in zip(chunks, chunks[1:]):
        assert c.start == prev.end
    assert all(c.tokens <= 64 for c in chunks)
    assert [c.tokens for c in chunks] == count([c.text for c in chunks])
    assert max(c.tokens for c in chunks) > 48  # packed, not one line per chunk
    assert chunk_text("", tok) == []
    with pytest.raises(ValueError):
        chunk_text(text, tok, max_tokens=0)


def test_budget_bounds():
    cfg = RetrievalConfig(min_tokens=1024, max_fraction=1 / 24)
    assert cfg.budget(16_000) == 1024  # lower bound wins for short contexts
    assert cfg.budget(48_000) == 2000  # 1/24 of the context once that is larger
    assert cfg.budget(600) == 600  # never more than the context
    assert RetrievalConfig(retrieval_tokens=300).budget(16_000) == 300
    paper = RetrievalConfig(min_tokens=4096, max_fraction=1 / 24)
    assert paper.budget(120_000) == 5000
    for bad in (dict(chunk_tokens=0), dict(similarity_floor=2.0), dict(retrieval_tokens=0), dict(max_fraction=0)):
        with pytest.raises(RetrospecError):
            RetrievalConfig(**bad)


def test_select_respects_floor_budget_and_document_order():
    chunks = [Chunk(i, 10 * i, 10 * i + 10, f"c{i}", 10) for i in range(6)]
    scores = np.array([0.9, 0.1, 0.8, 0.35, 0.29, 0.95])
    assert select_chunks(chunks, scores, budget=30, floor=0.3) == [0, 2, 5]  # best three, back in order
    assert select_chunks(chunks, scores, budget=100, floor=0.3) == [0, 2, 3, 5]  # 0.29 and 0.1 never
    assert select_chunks(chunks, scores, budget=100, floor=0.99) == []
    assert select_chunks(chunks, scores, budget=9, floor=0.0) == []  # nothing fits
    uneven = [Chunk(0, 0, 10, "a", 10), Chunk(1, 10, 35, "big", 25), Chunk(2, 35, 40, "c", 5)]
    assert select_chunks(uneven, np.array([0.5, 0.9, 0.3]), budget=30, floor=0.0) == [1, 2]  # skip, keep filling


def test_join_marks_gaps_between_non_adjacent_chunks():
    cs = [Chunk(0, 0, 3, "ab\n", 1), Chunk(1, 3, 5, "cd", 1), Chunk(4, 9, 11, "ef", 1)]
    assert join_chunks(cs) == "ab\ncd\nef"


def test_retriever_finds_the_needle_and_keeps_bounds(tok):
    doc = _doc()
    emb = FakeEmbedder(max_tokens=8)  # pieces smaller than chunks: a chunk is scored by its best piece
    cfg = RetrievalConfig(chunk_tokens=48, retrieval_tokens=100, similarity_floor=0.2)
    got = LongContextRetriever(tok, emb, cfg).retrieve(doc, "Where is the zebra quantum lighthouse secret?")
    assert "zebra quantum lighthouse" in got.text
    assert 0 < got.tokens <= got.budget == 100
    assert [c.index for c in got.chunks] == sorted(c.index for c in got.chunks)
    assert all(s >= 0.2 for s in got.scores)
    assert got.total_chunks == len(got.all_scores) > len(got.chunks)
    assert got.context_tokens >= got.tokens and got.seconds > 0
    # the floor excludes everything when nothing is similar enough, even with budget to spare
    none = LongContextRetriever(tok, emb, RetrievalConfig(chunk_tokens=48, similarity_floor=0.99))
    assert none.retrieve(doc, "unrelated words entirely").chunks == []
    with pytest.raises(RetrospecError):
        LongContextRetriever(None, emb)
