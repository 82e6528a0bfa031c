"""Speculative RAG (Wang et al., "Speculative RAG: Enhancing Retrieval Augmented Generation through Drafting",
ICLR 2025): a small drafter writes one (rationale, answer) draft per subset of retrieved passages, a verifier LM
scores every draft in one batched forward and the best one is returned.

Answer-level, not token-level: this package reuses the embedder, FAISS and model loading, but not the speculative
decoding loop or ``DraftTree``. Layout: ``data`` (JSONL passages/questions, train/eval split) → ``index`` (build /
load / search) → ``subsets`` (k-means multi-perspective sampling) → ``prompts`` → ``batched`` (batched greedy
decoding) and ``scoring`` (teacher-forced span scores) → ``pipeline`` (methods) → ``bench``.

Python API::

    from retrospec import speculative_rag as rag

    rag.build_index("passages.jsonl", "runs/nq-index")                 # once
    pipe = rag.open_pipeline("runs/nq-index")                           # drafter / verifier: defaults below
    res = pipe.answer("who got the first nobel prize in physics")       # method="specrag"
    print(res.answer, res.timings, [(d.answer, d.score) for d in res.drafts])
"""

from __future__ import annotations

from .data import Passage, Question, read_passages, read_questions, select, split_of
from .index import PassageIndex, build_index, load_index
from .pipeline import METHODS, Draft, RagAnswer, RagConfig, RagPipeline

DEFAULT_DRAFTER = "smollm2-135m-rag-drafter"  # the bundled LoRA drafter; the verifier model when it is absent
DEFAULT_VERIFIER = "smollm2-135m"


def open_pipeline(index, *, drafter=None, verifier=DEFAULT_VERIFIER, embedder=None, dtype=None,
                  config: RagConfig | None = None) -> RagPipeline:
    """Load an index and the two models (directories, names, adapters or ``LoadedModel``s) into a pipeline.
    ``drafter=None``: the bundled ``smollm2-135m-rag-drafter`` when present, else the verifier model."""
    import torch

    from ..models.loading import load_model
    from ..models.named import lookup

    dtype = dtype or torch.float32
    if drafter is None:
        named = lookup(DEFAULT_DRAFTER)
        drafter = DEFAULT_DRAFTER if named is not None and named.ready() else verifier
    return RagPipeline(load_index(index, embedder=embedder) if not isinstance(index, PassageIndex) else index,
                       load_model(drafter, role="drafter", dtype=dtype),
                       load_model(verifier, role="verifier", dtype=dtype), config)


__all__ = ["Passage", "Question", "read_passages", "read_questions", "select", "split_of", "PassageIndex",
           "build_index", "load_index", "METHODS", "Draft", "RagAnswer", "RagConfig", "RagPipeline", "open_pipeline",
           "DEFAULT_DRAFTER", "DEFAULT_VERIFIER"]
