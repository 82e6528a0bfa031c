"""Request preparation: ``prepare`` turns a call into a ``Request``, the one hand-off to ``run.Run``.

The API (``api.generate`` / ``api.stream``), the bench (prompt rows and long-context rows), the server's worker and
training evaluation all call ``prepare``; nothing else builds a ``Request``. ``prepare`` validates every argument
(``RetrospecError`` on a user error), loads the target (a directory, a name or a loaded model), lets the method's
spec resolve its resources (``MethodSpec.resolve``: a draft LM, a LongSpec block), encodes the prompt and checks
that it fits. A ``Request`` holds loaded models, prompt ids and validated configs only (no text, templates or
files); ``options`` are the factory's checked keyword arguments.

Two branches: a prompt (text, token ids or chat messages; the chat template's end-of-turn id joins the EOS ids),
or a long ``context`` with the prompt as the query. Over a long context, RAPID (Chen, Feng, Ni, Li, Shieh, ICML
2025) and its baselines differ only in which prompt the target reads, which the drafter reads, and which rule
verifies:

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
from .chat import build_chat_prompt, chat_messages
from .config import DecodeConfig, SamplingConfig, check_stop
from .drafters import default_method, spec_of
from .drafters.magicdec import DEFAULT_SINK
from .drafters.registry import methods
from .errors import RetrospecError
from .gating import resolve as resolve_gating
from .models import LoadedModel, default_target, load_model, load_options
from .retrieval.context_retrieval import LongContextRetriever, RetrievalConfig, Retrieved
from .text import check_encodable, check_prompt_ids, encode


@dataclass
class Request:
    target: LoadedModel
    draft: LoadedModel | None
    method: str
    prompt_ids: list[int]
    sampling: SamplingConfig
    decode: DecodeConfig
    options: dict = field(default_factory=dict)
    rule: object = None  # an AcceptanceRule; None = the exact rule for the sampling mode
    info: dict = field(default_factory=dict)  # request-level stats (long context: retrieval_s, retrieved_tokens)
    eos_ids: frozenset[int] | None = None  # None = the target's own; chat adds the template's end-of-turn id
    gating: bool = True  # the decode loop's gate picks each step's draft budget (``gating``); False = always full
    fastpath: str | None = None  # the verifier's engine (``fastpath``): None = measured default, "off" = model as is

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end generation (the last one is kept in the output)."""
        return self.target.eos_ids() if self.eos_ids is None else self.eos_ids

    def drafter(self):
        """A fresh drafter: the method options plus ``target``, ``draft`` (``LoadedModel`` or None) and
        ``draft_model`` (the draft's torch module, or None)."""
        models = {"target": self.target, "draft": self.draft, "draft_model": self.draft.model if self.draft else None}
        return spec_of(self.method).build(**self.options | models)


def prepare(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None, chat: bool = False,
            target=None, draft=None, method: str | None = None, max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
            stop: tuple[str, ...] | list[str] = (), tokenizer=None, context: str | None = None,
            gating: bool | None = None, device=None, dtype=None, retrieved: Retrieved | None = None,
            **options) -> Request:
    """Validate everything and load what is needed (``RetrospecError`` on any user error); see ``api.generate``.
    ``method=None``: the target's default (``drafters.default_method``). ``options`` are the method's knobs
    (``drafters.registry``); with ``context`` also those of ``LongContextOptions``, and ``retrieved`` reuses a
    retrieval already run for this context and query (``retrieve``; the bench shares one per row)."""
    load = load_options(device, dtype)  # for a target and draft given by path or name
    if method is None:
        method = default_method(target, draft, context=context is not None)
    spec = spec_of(method)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    decode = DecodeConfig(max_new_tokens=max_new_tokens, stop_strings=check_stop(stop))
    _check_prompt_type(prompt)
    if not isinstance(chat, bool):
        raise RetrospecError(f"chat must be True or False, got {chat!r}")
    if context is not None and not isinstance(context, str):
        raise RetrospecError(f"context must be text, got {type(context).__name__}")
    if gating is not None and not isinstance(gating, bool):
        raise RetrospecError(f"gating must be True, False or None (auto), got {gating!r}")
    gating = resolve_gating(gating, sampling)
    if context is None:
        fields = _prompt_fields(prompt, messages, chat, spec, target, draft, tokenizer, load, options)
    elif messages is not None or chat:
        raise RetrospecError("chat messages do not combine with a long context: pass the query as the prompt (it "
                             "is wrapped in the chat template when the model has one)")
    else:
        fields = _context_fields(prompt, context, spec, target, draft, tokenizer, load, sampling, retrieved, options)
    return Request(method=method, sampling=sampling, decode=decode, gating=gating, **fields)


def _check_prompt_type(prompt) -> None:
    if prompt is not None and not isinstance(prompt, (str, list, tuple)):
        raise RetrospecError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")


def input_vocab_size(target) -> int:
    """Rows of the target's input embedding: a prompt's token ids must be below it."""
    return int(target.model.get_input_embeddings().weight.shape[0])


def _prompt_fields(prompt, messages, chat, spec, target, draft, tokenizer, load, options) -> dict:
    """The ``Request`` fields of a prompt without a long context."""
    opts = spec.check(options)
    if spec.context == "required":
        raise RetrospecError(f"method '{spec.name}' needs a long context (context=... / --context-file FILE)")
    msgs = chat_messages(prompt, messages, chat)  # None = a raw completion of ``prompt``
    if msgs is None and (prompt is None or isinstance(prompt, str) and not prompt.strip()
                         or not isinstance(prompt, str) and len(prompt) == 0):
        raise RetrospecError("prompt is empty")
    tgt = load_model(default_target() if target is None else target, role="target", tokenizer=tokenizer, **load)
    eos_ids = None  # None = the target's own EOS ids
    room = tgt.max_positions  # tokens the target can hold: text that cannot fit is refused before tokenizing
    if msgs is not None:
        chat_prompt = build_chat_prompt(tgt.tokenizer, msgs, name=f"target {tgt.path}", max_tokens=room)
        prompt_ids, eos_ids = chat_prompt.prompt_ids, tgt.eos_ids() | chat_prompt.end_of_turn_ids
    elif isinstance(prompt, str):
        if tgt.tokenizer is None:
            raise RetrospecError(f"target {tgt.path} has no tokenizer; pass token ids or tokenizer=...")
        prompt_ids = encode(tgt.tokenizer, prompt, max_tokens=room)
    else:
        prompt_ids = check_prompt_ids(prompt, input_vocab_size(tgt))
    if not prompt_ids:
        raise RetrospecError("prompt is empty")
    if room and len(prompt_ids) >= room:
        raise RetrospecError(f"prompt has {len(prompt_ids)} tokens but the target supports at most {room} positions")
    drf, opts = spec.resolve(tgt, draft, opts, load=load)  # a draft LM, a LongSpec block, ...
    return {"target": tgt, "draft": drf, "prompt_ids": prompt_ids, "options": opts, "eos_ids": eos_ids}


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


def _context_fields(query, context: str, spec, target, draft, tokenizer, load, sampling, retrieved,
                    options) -> dict:
    """The ``Request`` fields of a request with a long context: load models, retrieve, build prompts and the rule."""
    if not isinstance(query, str) or not query.strip():
        raise RetrospecError("a long-context request needs the query as non-empty text")
    check_encodable(query, "the query")
    check_encodable(context, "the long context")
    options = spec.check(options, extra=CONTEXT_OPTIONS, context=True)  # this method's knobs + context options
    long_opts = LongContextOptions.pop_from(options)
    tgt = load_model(default_target() if target is None else target, role="target", tokenizer=tokenizer, **load)
    if tgt.tokenizer is None:
        raise RetrospecError(f"target {tgt.path} has no tokenizer; long-context methods work on text")
    p = plan(spec.name, context, query, tgt.tokenizer, sampling, long_opts, retrieved)
    drf, options = spec.resolve(tgt, draft, options, context=True, load=load)  # default: the target itself
    for name, model, ids in (("target", tgt, p.target_prompt_ids),
                             ("draft", drf, p.drafter_options.get("draft_prompt_ids"))):
        if model is not None and ids is not None and model.max_positions and len(ids) >= model.max_positions:
            raise RetrospecError(f"the {name} prompt has {len(ids)} tokens but the {name} model supports at most "
                                 f"{model.max_positions} positions")
    return {"target": tgt, "draft": drf, "prompt_ids": p.target_prompt_ids, "options": options | p.drafter_options,
            "rule": p.rule, "info": p.info, "fastpath": None if long_opts.prefix_attention else "off"}
