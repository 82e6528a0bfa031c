"""A corpus of the target's own outputs: prompt sources (``prompts``) and the batched, sharded,
resumable builder with its manifest (``build``). ``retrospec corpus generate`` is the command."""

from .build import CorpusBuilder, CorpusConfig, check_corpus, read_corpus
from .prompts import PromptRow, load_rows, parse_sources

__all__ = ["CorpusBuilder", "CorpusConfig", "check_corpus", "read_corpus", "PromptRow", "load_rows", "parse_sources"]
