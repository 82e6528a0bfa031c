"""Test doubles for RAPID tests: a bag-of-words embedder (no model) with the ``Embedder`` contract."""

from __future__ import annotations

import re
import zlib

import numpy as np


class FakeEmbedder:
    """Hashed bag of words, unit-normalised: cosine = word overlap. ``max_tokens`` words per piece."""

    name = "fake-bag-of-words"

    def __init__(self, max_tokens: int = 24, dim: int = 512):
        self.max_tokens = max_tokens
        self.dim = dim
        self.calls = 0

    def count(self, texts):
        return [len(t.split()) for t in texts]

    def encode(self, texts):
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for w in re.findall(r"\w+", text.lower()):
                out[i, zlib.crc32(w.encode()) % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms > 0, norms, 1.0)
