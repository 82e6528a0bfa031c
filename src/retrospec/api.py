"""Python API: ``generate`` (one call, one result) and ``stream`` (text as soon as it is committed).

Both resolve models (paths, names, loaded models; the bundled zoo by default; a named target's paired draft, e.g.
``zoo`` -> ``zoo-draft``, when ``sd`` gets none), validate every knob, encode the prompt, and run the request
through ``run.Run``. Chat (``messages=[...]``, or ``prompt`` with ``chat=True``): ``chat.build_chat_prompt``
applies the target's chat template and its end-of-turn token joins the EOS ids; text skips special tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from .chat import build_chat_prompt, chat_messages
from .config import DecodeConfig, SamplingConfig, check_stop
from .drafters import spec_of
from .drafters.longspec import longspec_options
from .errors import RetrospecError
from .gating import resolve as resolve_gating
from .long_requests import prepare_long_request
from .models import (check_same_vocab, default_target, load_model, load_options, paired_draft, paired_longspec,
                     placement)
from .request import Request
from .run import Run
from .text import check_prompt_ids, encode
from .types import GenerationResult


def prepare(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None, chat: bool = False,
            target=None, draft=None, method: str = "sd", max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
            stop: tuple[str, ...] | list[str] = (), tokenizer=None, context: str | None = None,
            gating: bool | None = None, device=None, dtype=None, **options) -> Request:
    """Validate everything and load what is needed (``RetrospecError`` on any user error); see ``generate``.
    ``options`` are the method's knobs (``drafters.registry``); with ``context`` also those of
    ``long_requests.LongContextOptions``."""
    load = load_options(device, dtype)  # for a target and draft given by path or name
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
    if context is not None:
        if messages is not None or chat:
            raise RetrospecError("chat messages do not combine with a long context: pass the query as the prompt (it "
                                 "is wrapped in the chat template when the model has one)")
        return prepare_long_request(prompt, context, target=target, draft=draft, method=method, sampling=sampling,
                                    decode=decode, tokenizer=tokenizer, gating=gating, load=load, **options)
    opts = spec.check(options)
    if spec.context == "required":
        raise RetrospecError(f"method '{method}' needs a long context (context=... / --context-file FILE)")
    msgs = chat_messages(prompt, messages, chat)  # None = a raw completion of ``prompt``
    if msgs is None and (prompt is None or isinstance(prompt, str) and not prompt.strip()
                         or not isinstance(prompt, str) and len(prompt) == 0):
        raise RetrospecError("prompt is empty")
    tgt = load_model(default_target() if target is None else target, role="target", tokenizer=tokenizer, **load)
    drf = None
    if spec.draft == "lm":
        draft = paired_draft(target) if draft is None else draft  # default/named target: its paired draft
        if draft is None:
            raise RetrospecError(f"method '{method}' needs a draft model (--draft DIR / draft=...)")
        drf = load_model(draft, role="draft", **(placement(tgt) | load))  # beside the target by default
        check_same_vocab(tgt, drf)
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
    if spec.draft == "block":  # ``draft`` is a LongSpec block (a directory, a name or a LongSpecDraft), not a draft LM
        block = paired_longspec(target) if draft is None else draft  # default/named target: its bundled block
        opts.update(longspec_options(block, tgt.model, opts.pop("gamma", None), opts.pop("tree", None)))
    return Request(tgt, drf, method, prompt_ids, sampling, decode, opts, eos_ids=eos_ids, gating=gating)


def _check_prompt_type(prompt) -> None:
    if prompt is not None and not isinstance(prompt, (str, list, tuple)):
        raise RetrospecError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")


def input_vocab_size(target) -> int:
    """Rows of the target's input embedding: a prompt's token ids must be below it."""
    return int(target.model.get_input_embeddings().weight.shape[0])


class GenerationStream:
    """Iterate for text pieces as they are committed; ``.result`` holds the full result afterwards."""

    def __init__(self, request: Request):
        self.request = request
        self.run = Run(request)
        self.stats = self.run.stats
        self.token_ids = self.run.token_ids
        self.result: GenerationResult | None = None

    @property
    def text(self) -> str:
        return self.run.text

    def _steps(self) -> Iterator[tuple[list[int], str]]:
        try:
            yield from self.run
        finally:
            self.result = GenerationResult(self.run.text, list(self.run.token_ids), self.stats)

    def token_chunks(self) -> Iterator[list[int]]:
        """Committed token ids per verification step (stop strings applied)."""
        for chunk, _ in self._steps():
            yield chunk

    def __iter__(self) -> Iterator[str]:
        for _, delta in self._steps():
            if delta:
                yield delta
        if self.run.last_delta:
            yield self.run.last_delta


def stream(prompt: str | list[int] | None = None, **kwargs) -> GenerationStream:
    """Like ``generate`` but returns a ``GenerationStream``; iterate it for text pieces."""
    return GenerationStream(prepare(prompt, **kwargs))


def generate(prompt: str | list[int] | None = None, **kwargs) -> GenerationResult:
    """Generate a continuation of ``prompt``, or the assistant's reply to ``messages``.

    Keyword arguments: ``target`` / ``draft`` (directory, model name such as ``"smollm2-135m"``, ``LoadedModel`` or
    transformers model), ``method`` ('ar', 'sd', 'pld', ...), ``max_new_tokens``, ``temperature`` (0 = greedy),
    ``top_p``, ``top_k``, ``seed``, ``stop`` (stop strings), ``gating`` (None = on except for seeded sampling;
    False: always the full draft; see ``retrospec.gating``) and the method's knobs (``gamma``, ``adaptive_gamma``,
    ``max_ngram``, ``datastore``, ``tree``, ...; an undeclared one is refused). ``device`` (``cpu``, ``cuda``,
    ``cuda:N``, ``auto``) and ``dtype`` (``float32`` default, ``bfloat16``, ``float16``) apply to a target and a draft
    given as directories or names; loaded models run where and as they are. Greedy token identity with ``ar`` holds
    in float32; in a 16-bit dtype a k-token verification and a 1-token step round differently, so near-ties may flip.

    Chat: ``messages=[{"role": "user", "content": ...}, ...]`` (roles system / user / assistant), or ``prompt`` with
    ``chat=True``; generation stops at the template's end-of-turn token. No chat template = ``RetrospecError``.

    Long context (RAPID and baselines): ``context`` (the document; ``prompt`` is the query; no chat/messages),
    ``method`` in lc | rag | sd | magicdec | rapid, ``draft`` (default the target itself), ``eta`` (> 0 = RAPID's
    LOSSY rule) and the other ``long_requests.LongContextOptions`` fields.
    """
    s = stream(prompt, **kwargs)
    for _ in s.token_chunks():
        pass
    assert s.result is not None
    return s.result
