"""Long-context requests: which prompt the target reads, which the drafter reads, and which rule verifies.

RAPID (Chen, Feng, Ni, Li, Shieh, ICML 2025) and its baselines differ only in these three choices:

| method   | target reads                   | drafter                                         | rule                   |
|----------|--------------------------------|-------------------------------------------------|------------------------|
| lc       | template(full context, query)  | none (autoregressive)                           | exact                  |
| rag      | template(retrieved, query)     | none (autoregressive)                           | exact                  |
| sd       | template(full context, query)  | draft LM over the same full prompt              | exact (eta = 0)        |
| magicdec | template(full context, query)  | the target over sinks + window (StreamingLLM)   | exact                  |
| rapid    | template(full context, query)  | draft LM over template(retrieved, query)        | exact if eta = 0, else |
|          |                                |                                                 | RAPID's p_hat (LOSSY)  |

The draft LM defaults to the target itself (self-speculation); any causal LM with the target's vocabulary works
(a larger one = upward speculation). ``ContextTemplate`` formats ``{context}`` and ``{query}``, as one user message
under the tokenizer's chat template when it has one (``chat=False`` turns that off). Retrieval is timed and reported
as ``retrieval_s`` / ``retrieved_tokens``. The target verifies on the engine's copy with ``attention.prefix_block``
(exact, much cheaper than masked ``sdpa`` on CPU); ``prefix_attention=False`` runs the target as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import AcceptanceRule
from .acceptance_rapid import make_rapid_rule
from .config import SamplingConfig
from .drafters import spec_of
from .drafters.magicdec import DEFAULT_SINK
from .drafters.registry import methods
from .errors import RetrospecError
from .models import check_same_vocab, default_target, load_model, placement
from .request import Request
from .text import check_encodable, encode
from .retrieval.context_retrieval import LongContextRetriever, RetrievalConfig, Retrieved

DEFAULT_TEMPLATE = "{context}\n\n{query}"


@dataclass(frozen=True)
class ContextTemplate:
    text: str = DEFAULT_TEMPLATE  # must contain {context} and {query}
    chat: bool = True  # use the tokenizer's chat template when it has one

    def __post_init__(self) -> None:
        if "{context}" not in self.text or "{query}" not in self.text:
            raise RetrospecError("a context template needs both {context} and {query}")

    def render(self, context: str, query: str, tokenizer=None) -> str:
        body = self.text.replace("{context}", context).replace("{query}", query)  # no str.format: code has braces
        if self.chat and tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                                 add_generation_prompt=True)
        return body


@dataclass(frozen=True)
class LongContextOptions:
    """Every long-context knob, validated (CLI flags and API keyword arguments map 1:1 onto these fields)."""

    eta: float = 0.0  # RAPID's retrieval-augmented target strength; > 0 is LOSSY
    chunk_tokens: int = 512
    retrieval_tokens: int | None = None
    min_retrieval_tokens: int = 1024
    max_retrieval_fraction: float = 1 / 24
    similarity_floor: float = 0.3
    piece_tokens: int | None = 64
    embedder: object = None  # None = bundled all-MiniLM-L6-v2; a path; or an object with encode/count/max_tokens
    sink: int = DEFAULT_SINK
    window: int | None = None
    template: ContextTemplate = field(default_factory=ContextTemplate)
    prefix_attention: bool = True  # verify over the long cache with attention.prefix_block (exact; cheaper on CPU)

    def __post_init__(self) -> None:
        if not self.eta >= 0:
            raise RetrospecError(f"eta must be >= 0, got {self.eta}")
        if self.sink < 0:
            raise RetrospecError(f"sink must be >= 0, got {self.sink}")
        if self.window is not None and self.window < 1:
            raise RetrospecError(f"window must be >= 1, got {self.window}")
        self.retrieval  # validates the retrieval knobs

    @property
    def retrieval(self) -> RetrievalConfig:
        return RetrievalConfig(chunk_tokens=self.chunk_tokens, similarity_floor=self.similarity_floor,
                               retrieval_tokens=self.retrieval_tokens, min_tokens=self.min_retrieval_tokens,
                               max_fraction=self.max_retrieval_fraction, piece_tokens=self.piece_tokens)

    @classmethod
    def pop_from(cls, options: dict) -> "LongContextOptions":
        """Take this class's fields out of a keyword dict (``None`` values = defaults)."""
        names = set(cls.__dataclass_fields__)
        given = {k: options.pop(k) for k in list(options) if k in names}
        if isinstance(given.get("template"), str):
            given["template"] = ContextTemplate(given["template"])
        return cls(**{k: v for k, v in given.items() if v is not None})


# the options every request with a context takes (eta, sink and window too: a run may set them for all its methods;
# ``plan`` refuses eta > 0 for any method but rapid)
CONTEXT_OPTIONS = tuple(LongContextOptions.__dataclass_fields__)


@dataclass
class LongContextPlan:
    target_prompt_ids: list[int]
    drafter_options: dict  # extra factory options (draft_prompt_ids, sink, window, eta, ...)
    rule: AcceptanceRule | None  # None = the engine's default (exact) rule
    retrieved: Retrieved | None
    info: dict  # goes into SpecStats: retrieval_s, retrieved_tokens


def retrieve(method: str, context: str, query: str, tokenizer, options: LongContextOptions) -> Retrieved | None:
    """Run retrieval when ``method`` needs it (rag, rapid); None otherwise."""
    if spec_of(method).retrieval:
        return LongContextRetriever(tokenizer, options.embedder, options.retrieval).retrieve(context, query)


def plan(method: str, context: str, query: str, tokenizer, sampling: SamplingConfig,
         options: LongContextOptions | None = None, retrieved: Retrieved | None = None) -> LongContextPlan:
    """Prompts, drafter options and rule of one long-context request; ``retrieved`` reuses one retrieval."""
    spec = spec_of(method)
    if spec.context == "never":
        raise RetrospecError(f"method {method!r} does not take a long context; use one of "
                             f"{', '.join(methods(context=True))}")
    if tokenizer is None:
        raise RetrospecError("long-context methods need the target's tokenizer")
    if not context.strip():
        raise RetrospecError("the long context is empty")
    options = options or LongContextOptions()
    if options.eta > 0 and spec.knob("eta") is None:
        raise RetrospecError(f"eta applies to method 'rapid' only (got method {method!r})")
    if spec.retrieval and retrieved is None:
        retrieved = retrieve(method, context, query, tokenizer, options)
    tmpl = options.template
    full_ids = encode(tokenizer, tmpl.render(context, query, tokenizer))
    short_ids = encode(tokenizer, tmpl.render(retrieved.text, query, tokenizer)) if retrieved is not None else None
    drafter_options: dict = {"prefill_prompt": True} if spec.draft == "lm" else {}
    if spec.draft == "lm" and spec.retrieval:  # rapid: the draft reads the retrieved context
        drafter_options["draft_prompt_ids"] = short_ids
    drafter_options.update({k: getattr(options, k) for k in ("eta", "sink", "window") if spec.knob(k)})
    info = {"retrieval_s": retrieved.seconds, "retrieved_tokens": retrieved.tokens} if retrieved is not None else {}
    rule = make_rapid_rule(options.eta, sampling) if options.eta > 0 else None
    return LongContextPlan(target_prompt_ids=short_ids if spec.retrieval and spec.draft == "none" else full_ids,
                           drafter_options=drafter_options, rule=rule, retrieved=retrieved, info=info)


def prepare_long_request(query, context: str, *, target, draft, method: str, sampling: SamplingConfig, decode,
                         tokenizer=None, gating: bool = True, load: dict | None = None, **options):
    """``api.prepare`` for a request with a long context: load models (``load``: ``load_model``'s device and dtype),
    retrieve, build prompts and the rule."""
    load = load or {}
    if not isinstance(query, str) or not query.strip():
        raise RetrospecError("a long-context request needs the query as non-empty text")
    check_encodable(query, "the query")
    check_encodable(context, "the long context")
    spec = spec_of(method)
    options = spec.check(options, extra=CONTEXT_OPTIONS, context=True)  # this method's knobs + context options
    long_opts = LongContextOptions.pop_from(options)
    tgt = load_model(default_target() if target is None else target, role="target", tokenizer=tokenizer, **load)
    if tgt.tokenizer is None:
        raise RetrospecError(f"target {tgt.path} has no tokenizer; long-context methods work on text")
    drf = None
    if spec.draft == "lm":
        # default: self-speculation; a draft loads beside the target unless told otherwise
        drf = tgt if draft is None else load_model(draft, role="draft", **(placement(tgt) | load))
        check_same_vocab(tgt, drf)
    elif draft is not None:
        users = [m for m in methods(context=True) if spec_of(m).draft == "lm"]
        raise RetrospecError(f"method '{method}' takes no draft model (--draft applies to {' and '.join(users)})")
    p = plan(method, context, query, tgt.tokenizer, sampling, long_opts)
    for name, model, ids in (("target", tgt, p.target_prompt_ids),
                             ("draft", drf, p.drafter_options.get("draft_prompt_ids"))):
        if model is not None and ids is not None and model.max_positions and len(ids) >= model.max_positions:
            raise RetrospecError(f"the {name} prompt has {len(ids)} tokens but the {name} model supports at most "
                                 f"{model.max_positions} positions")
    opts = options | p.drafter_options
    return Request(tgt, drf, method, p.target_prompt_ids, sampling, decode, opts, rule=p.rule, info=p.info,
                   gating=gating, fastpath=None if long_opts.prefix_attention else "off")
