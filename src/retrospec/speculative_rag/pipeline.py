"""Speculative RAG (Wang et al., "Speculative RAG: Enhancing Retrieval Augmented Generation through Drafting",
ICLR 2025): retrieve → cluster → draft in parallel → verify → pick, and its baselines and ablations.

``specrag``: retrieve the top ``docs`` passages; embed each with the question (``subsets.doc_embeddings``), k-means
them into ``per_draft`` clusters and sample ``drafts`` unique subsets with one document per cluster; the drafter
writes a (rationale β, answer α) per subset, all decoded as one batch; the verifier scores every draft in one
batched teacher-forced forward; the answer is the draft with the highest ``log ρ = log ρ_draft + log ρ_SC +
log ρ_SR`` (``scoring.py``). Answer-level: nothing here is lossless or goes through ``DraftTree``.

Methods (``METHODS``): ``specrag``; baselines ``standard`` (the verifier answers with all ``docs`` passages in its
prompt), ``drafter`` (best ρ_draft, no verifier call), ``closed-book`` (the verifier, no passages); ablations
``specrag-random-subsets`` / ``specrag-same-cluster`` (other subset sampling), ``specrag-random-select`` (a
uniformly random draft, no verifier call), ``specrag-no-sc`` / ``-no-sr`` / ``-no-draft`` (a score term dropped),
``specrag-sum`` (the paper's raw product, see Scores).

Scores: ``score_norm="mean"`` (the default) divides ``log ρ_draft`` and ``log ρ_SC`` by their token counts (a
per-token geometric mean) before summing; ``"sum"`` (``specrag-sum``) is the paper's raw product, which picks the
shortest rationale rather than the best-supported answer (a 40-token Wikipedia sentence scores ~100 nats under a
135M verifier, a 15-token one ~40).

Invariants: a draft whose answer is empty scores −inf and is picked only when every draft is empty; methods that
share a subset strategy share its drafts and verifier scores within ``answer_many`` (their latency is that of the
stages they use: ``drafter`` and ``specrag-random-select`` report no verify time); subset sampling is seeded by
(``seed``, question), so runs are reproducible.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..chat import end_of_turn_ids
from ..errors import RetrospecError
from ..batched import greedy_batch
from .data import Passage
from .prompts import (ANSWER_TAG, answer_prompt, draft_spans, drafter_prompt, first_line, parse_draft,
                      verifier_text)
from .scoring import span_logprobs, token_logprob_sum
from .subsets import doc_embeddings, make_subsets


@dataclass(frozen=True)
class Method:
    kind: str  # "specrag", "standard", "closed-book"
    subsets: str = "clustered"  # subsets.make_subsets strategy
    terms: tuple[str, ...] = ("draft", "sc", "sr")  # score terms summed (log space); () = random choice
    verify: bool = True  # whether the verifier scores the drafts
    norm: str | None = None  # "sum" | "mean" (per token); None = RagConfig.score_norm


METHODS: dict[str, Method] = {
    "specrag": Method("specrag"),
    "standard": Method("standard"),
    "drafter": Method("specrag", terms=("draft",), verify=False),
    "closed-book": Method("closed-book"),
    "specrag-random-subsets": Method("specrag", subsets="random"),
    "specrag-same-cluster": Method("specrag", subsets="same-cluster"),
    "specrag-random-select": Method("specrag", terms=(), verify=False),
    "specrag-no-sc": Method("specrag", terms=("draft", "sr")),
    "specrag-no-sr": Method("specrag", terms=("draft", "sc")),
    "specrag-no-draft": Method("specrag", terms=("sc", "sr")),
    "specrag-sum": Method("specrag", norm="sum"),  # the paper's raw product of probabilities (no length norm)
}
SCORE_NORMS = ("mean", "sum")


@dataclass
class RagConfig:
    docs: int = 10  # passages retrieved (n)
    drafts: int = 5  # subsets, one draft each (m)
    per_draft: int = 2  # documents per subset = clusters (k)
    max_rationale_tokens: int = 48
    max_answer_tokens: int = 24
    seed: int = 0
    drafter_rescore: bool = False  # re-run a teacher-forced drafter forward for ρ_draft (equal, slower)
    score_norm: str = "mean"  # "mean": ρ_draft and ρ_SC per token (geometric mean); "sum": the paper's raw product

    def validate(self) -> None:
        for name in ("docs", "drafts", "per_draft", "max_rationale_tokens", "max_answer_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RetrospecError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.score_norm not in SCORE_NORMS:
            raise RetrospecError(f"score-norm must be one of {', '.join(SCORE_NORMS)}, got {self.score_norm!r}")
        if self.per_draft > self.docs:
            raise RetrospecError(f"per-draft ({self.per_draft}) cannot exceed docs ({self.docs})")


@dataclass
class Draft:
    subset: list[str]  # passage ids, retrieval order
    rationale: str
    answer: str
    log_draft: float = 0.0
    log_sc: float | None = None
    log_sr: float | None = None
    score: float | None = None
    tokens: int = 0  # drafter tokens generated
    n_draft: int = 0  # drafter tokens of β and α (the per-token norm of log_draft)
    n_sc: int = 0  # verifier tokens of α and β (the per-token norm of log_sc)


@dataclass
class RagAnswer:
    question: str
    method: str
    answer: str
    drafts: list[Draft] = field(default_factory=list)
    chosen: int | None = None  # index into drafts
    retrieved: list[tuple[str, float]] = field(default_factory=list)  # (passage id, cosine)
    timings: dict[str, float] = field(default_factory=dict)  # retrieve_s, cluster_s, draft_s, verify_s, latency_s

    def to_dict(self) -> dict:
        d = asdict(self)
        for dr in d["drafts"]:
            for k in ("log_draft", "log_sc", "log_sr", "score"):
                if isinstance(dr[k], float) and not math.isfinite(dr[k]):
                    dr[k] = None
        return d


def resolve_methods(names) -> list[str]:
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise RetrospecError(f"unknown RAG method {', '.join(unknown) or '(none)'}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(names))


class RagPipeline:
    """Index + drafter + verifier, loaded once; ``answer`` / ``answer_many`` per question."""

    def __init__(self, index, drafter, verifier, config: RagConfig | None = None):
        self.index, self.drafter, self.verifier = index, drafter, verifier
        self.config = config or RagConfig()
        self.config.validate()
        for role, m in (("drafter", drafter), ("verifier", verifier)):
            if m.tokenizer is None:
                raise RetrospecError(f"the {role} has no tokenizer")

    # ---- stages -------------------------------------------------------------------------------------------------

    def _seed(self, question: str) -> int:
        return int(hashlib.sha1(f"{self.config.seed}:{question}".encode()).hexdigest()[:8], 16)

    def _ids(self, model, text: str) -> list[int]:
        ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = model.max_positions
        if limit and len(ids) + self.config.max_rationale_tokens + self.config.max_answer_tokens > limit:
            raise RetrospecError(f"a RAG prompt of {len(ids)} tokens does not fit {model.path}'s {limit} positions; "
                                 "use fewer --docs")
        return ids

    def _eos(self, model) -> frozenset[int]:
        return model.eos_ids() | end_of_turn_ids(model.tokenizer)

    def _generate(self, model, prompts: list[list[int]], max_new: int, stop=None) -> list[tuple[list, list]]:
        """Greedy rows and their log-probs; ``stop`` None: at the end of the first non-blank line."""
        tok = model.tokenizer
        stop = stop or (lambda row: "\n" in tok.decode(row, skip_special_tokens=True).strip())
        out = greedy_batch(model.model, prompts, max_new_tokens=max_new, eos_ids=self._eos(model),
                           pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0, stop=stop)
        return list(zip(out.tokens, out.logprobs))

    def draft(self, question: str, docs: list[Passage], subsets: list[tuple[int, ...]]) -> list[Draft]:
        """One draft per subset, all decoded together; ``log_draft`` filled (see ``scoring.py``)."""
        cfg, tok = self.config, self.drafter.tokenizer
        prompts = [drafter_prompt(tok, question, [docs[i] for i in s]) for s in subsets]
        ids = [self._ids(self.drafter, p) for p in prompts]

        def stop(row: list[int]) -> bool:
            text = tok.decode(row, skip_special_tokens=True)
            head, sep, tail = text.partition(ANSWER_TAG)
            if sep:
                return bool(tail.strip()) and "\n" in tail.lstrip()
            return len(row) >= cfg.max_rationale_tokens

        rows = self._generate(self.drafter, ids, cfg.max_rationale_tokens + cfg.max_answer_tokens, stop)
        drafts, redo = [], []
        for j, (s, (toks, lps)) in enumerate(zip(subsets, rows)):
            text = tok.decode(toks, skip_special_tokens=True)
            rationale, answer, complete = parse_draft(text)
            d = Draft([docs[i].id for i in s], rationale, answer, tokens=len(toks))
            if complete and not cfg.drafter_rescore:
                d.log_draft = self._generated_logprob(toks, lps, text)
            else:
                redo.append(j)
            drafts.append(d)
        missing = [j for j in redo if not drafts[j].answer]
        if missing:  # no "Answer:" written: ask for the answer after the rationale
            follow = [ids[j] + tok(f" {drafts[j].rationale}\n{ANSWER_TAG}", add_special_tokens=False)["input_ids"]
                      for j in missing]
            for j, (toks, _) in zip(missing, self._generate(self.drafter, follow, cfg.max_answer_tokens)):
                drafts[j].answer = first_line(tok.decode(toks, skip_special_tokens=True))
                drafts[j].tokens += len(toks)
        if redo:  # teacher-forced rescoring of the drafts whose tokens are not one generated sequence
            rows = [draft_spans(prompts[j], drafts[j].rationale, drafts[j].answer) for j in redo]
            scores = span_logprobs(self.drafter.model, tok, [r[0] for r in rows], [r[1:] for r in rows],
                                   batch_size=len(rows))
            for j, row in zip(redo, scores):
                drafts[j].log_draft = float(row.sum())
        for d in drafts:
            d.n_draft = _count(tok, d.rationale) + _count(tok, d.answer)
            if not d.answer:
                d.log_draft = -math.inf
        return drafts

    def _generated_logprob(self, toks: list[int], lps: list[float], text: str) -> float:
        """log P(β) + log P(α) from the generated tokens' own log-probs; spans found in the decoded text."""
        tok = self.drafter.tokenizer

        def complete(n: int) -> tuple[int, bool]:  # characters completed by toks[:n]; a partial one pending?
            decoded = tok.decode(toks[:n], skip_special_tokens=True)
            done = decoded.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to replacement characters
            return len(done), len(done) < len(decoded)

        offsets = []
        for t in range(len(toks)):  # character range of each generated token in ``text``, as tokenizer offsets
            start, _ = complete(t)  # give it: every byte token of a multi-byte character covers that character
            end, partial = complete(t + 1)
            offsets.append((start, max(start, end + partial)))
        cut = text.index(ANSWER_TAG)
        head = text[:cut]
        b_span = (len(head) - len(head.lstrip()), len(head.rstrip()))
        tail = text[cut + len(ANSWER_TAG):]
        a0 = cut + len(ANSWER_TAG) + len(tail) - len(tail.lstrip())
        a_span = (a0, a0 + len(tail.strip().split("\n", 1)[0].strip()))
        return token_logprob_sum(lps, offsets, b_span) + token_logprob_sum(lps, offsets, a_span)

    def verify(self, question: str, drafts: list[Draft]) -> None:
        """Fill ``log_sc`` and ``log_sr`` of every draft with an answer: one batched teacher-forced forward."""
        live = [d for d in drafts if d.answer]
        if not live:
            return
        texts, spans = zip(*(verifier_text(self.verifier.tokenizer, question, d.answer, d.rationale) for d in live))
        spans = [[sp["answer"], sp["rationale"], sp["yes"]] for sp in spans]
        scores = span_logprobs(self.verifier.model, self.verifier.tokenizer, texts, spans, batch_size=len(texts))
        for d, (a, b, yes) in zip(live, scores):
            d.log_sc, d.log_sr = float(a + b), float(yes)
            d.n_sc = _count(self.verifier.tokenizer, d.answer) + _count(self.verifier.tokenizer, d.rationale)

    def respond(self, question: str, docs: list[Passage]) -> str:
        """``standard`` (docs) and ``closed-book`` (no docs): the verifier answers directly, greedy, one line."""
        tok = self.verifier.tokenizer
        ids = self._ids(self.verifier, answer_prompt(tok, question, docs))
        (toks, _), = self._generate(self.verifier, [ids], self.config.max_answer_tokens)
        return first_line(tok.decode(toks, skip_special_tokens=True))

    # ---- methods ------------------------------------------------------------------------------------------------

    def answer(self, question: str, method: str = "specrag") -> RagAnswer:
        return self.answer_many(question, [method])[method]

    def answer_many(self, question: str, methods) -> dict[str, RagAnswer]:
        """Answer ``question`` with each method, sharing retrieval, subsets, drafts and scores where methods agree."""
        if not isinstance(question, str) or not question.strip():
            raise RetrospecError("the question is empty")
        methods = resolve_methods(methods)
        cfg = self.config
        need_docs = any(METHODS[m].kind != "closed-book" for m in methods)
        hits, retrieve_s = _timed(self.index.search, question, cfg.docs) if need_docs else ([], 0.0)
        docs = [p for p, _ in hits]
        retrieved = [(p.id, round(float(s), 4)) for p, s in hits]
        results: dict[str, RagAnswer] = {}
        shared: dict[str, tuple[list[Draft], dict]] = {}  # subset strategy -> (drafts, stage timings)
        emb, emb_s = None, 0.0
        for name in methods:
            m = METHODS[name]
            if m.kind != "specrag":
                standard = m.kind == "standard"
                text, gen_s = _timed(self.respond, question, docs if standard else [])
                timings = {"retrieve_s": retrieve_s if standard else 0.0, "cluster_s": 0.0, "draft_s": 0.0,
                           "verify_s": gen_s}
                results[name] = RagAnswer(question, name, text, retrieved=retrieved if standard else [],
                                          timings=_total(timings))
                continue
            if m.subsets not in shared:
                clustered = m.subsets != "random"
                if emb is None and clustered:
                    emb, emb_s = _timed(doc_embeddings, self.index.embedder, question, docs)  # [n, d]
                subsets, c_s = _timed(make_subsets, m.subsets, emb if emb is not None else np.zeros((len(docs), 1)),
                                      cfg.per_draft, cfg.drafts, self._seed(question))
                drafts, d_s = _timed(self.draft, question, docs, subsets)
                shared[m.subsets] = (drafts, {"cluster_s": (emb_s if clustered else 0.0) + c_s, "draft_s": d_s,
                                              "verify_s": None})
            drafts, stage = shared[m.subsets]
            if m.verify and stage["verify_s"] is None:
                stage["verify_s"] = _timed(self.verify, question, drafts)[1]
            picked = [replace(d, subset=list(d.subset), score=None) for d in drafts]
            chosen = self._choose(question, picked, m)
            timings = {"retrieve_s": retrieve_s, "cluster_s": stage["cluster_s"], "draft_s": stage["draft_s"],
                       "verify_s": stage["verify_s"] if m.verify else 0.0}
            results[name] = RagAnswer(question, name, picked[chosen].answer if chosen is not None else "", picked,
                                      chosen, retrieved, _total(timings))
        return results

    def _choose(self, question: str, drafts: list[Draft], m: Method) -> int | None:
        if not drafts:
            return None
        if not m.terms:  # random selection among drafts with an answer
            ok = [i for i, d in enumerate(drafts) if d.answer] or list(range(len(drafts)))
            return int(np.random.default_rng(self._seed(question)).choice(ok))
        mean = (m.norm or self.config.score_norm) == "mean"
        for d in drafts:
            parts = {"draft": d.log_draft / max(1, d.n_draft) if mean else d.log_draft,
                     "sc": d.log_sc / max(1, d.n_sc) if mean and d.log_sc is not None else d.log_sc, "sr": d.log_sr}
            d.score = -math.inf if not d.answer else float(sum(parts[t] for t in m.terms))
        return int(max(range(len(drafts)), key=lambda i: (drafts[i].score, -i)))


def _timed(fn, *args):
    """``(fn(*args), seconds it took)``."""
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(f" {text}", add_special_tokens=False)["input_ids"]) if text else 0


def _total(timings: dict) -> dict:
    timings = {k: round(float(v), 4) for k, v in timings.items()}
    timings["latency_s"] = round(sum(timings.values()), 4)
    return timings
