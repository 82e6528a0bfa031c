"""Python API: ``generate`` (one call, one result) and ``stream`` (text as soon as it is committed).

Both prepare the request with ``request.prepare`` (resolve models: paths, names, loaded models, the bundled zoo by
default; the method's resources through its spec, e.g. a named target's paired draft for ``sd``; validate every
knob; encode the prompt) and run it through ``run.Run``. Without a method, the target's default
(``drafters.default_method``: its bundled LongSpec block, else its paired draft, else prompt lookup). Chat (``messages=[...]``, or ``prompt`` with ``chat=True``): ``chat.build_chat_prompt``
applies the target's chat template and its end-of-turn token joins the EOS ids; text skips special tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from .request import Request, input_vocab_size, prepare  # noqa: F401 (the API's ``prepare``)
from .run import Run
from .types import GenerationResult


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
    transformers model), ``method`` ('ar', 'sd', 'pld', ...; default: the target's fastest lossless method,
    ``drafters.default_method``), ``max_new_tokens``, ``temperature`` (0 = greedy),
    ``top_p``, ``top_k``, ``seed``, ``stop`` (stop strings), ``gating`` (None = on except for seeded sampling;
    False: always the full draft; see ``retrospec.gating``) and the method's knobs (``gamma``, ``adaptive_gamma``,
    ``max_ngram``, ``datastore``, ``tree``, ...; an undeclared one is refused). ``device`` (``cpu``, ``cuda``,
    ``cuda:N``, ``auto``) and ``dtype`` (``float32`` default, ``bfloat16``, ``float16``, the CPU weight-only
    formats ``int8`` / ``int4`` / ``w8a8`` / ``w4a8`` (``retrospec.weight_only``), or ``gguf``: the blocks of the GGUF file the target was
    converted from, run natively (``models.gguf_native``)) apply to a target and a draft given as directories or
    names; loaded models run where and as they are. Greedy output of a lossless method is token-identical to ``ar``
    in the same format: in float32, and wherever the engine measured its matmuls row-invariant (the weight-only
    formats; ``fastpath.rows``), where a k-token verification is bitwise k one-token steps. Elsewhere (16-bit
    matmuls whose rows depend on the call) a near-tie may flip.

    Chat: ``messages=[{"role": "user", "content": ...}, ...]`` (roles system / user / assistant), or ``prompt`` with
    ``chat=True``; generation stops at the template's end-of-turn token. No chat template = ``RetrospecError``.

    Long context (RAPID and baselines): ``context`` (the document; ``prompt`` is the query; no chat/messages),
    ``method`` in lc | rag | sd | magicdec | rapid, ``draft`` (default the target itself), ``eta`` (> 0 = RAPID's
    LOSSY rule) and the other ``request.LongContextOptions`` fields.
    """
    s = stream(prompt, **kwargs)
    for _ in s.token_chunks():
        pass
    assert s.result is not None
    return s.result
