"""Text at the edges of the engine: encoding user text, and token ids back to final text with stop strings.

The one place that turns a request's text into ids and ids into the text a caller sees (API, server and CLI).

Contracts:
- ``encode(tokenizer, text)``: text that cannot be encoded (a lone surrogate such as ``"\\udcff"``, a non-string)
  is a user error (``RetrospecError``), never a tokenizer ``TypeError``; text that cannot fit in ``max_tokens`` is
  refused before the tokenizer sees it.
- ``check_prompt_ids``: token ids given by a caller are integers inside the vocabulary.
- ``TextStream``: token ids in, final text deltas out. Each push decodes a short window (new tokens plus a few
  before them for context), so a long generation costs O(new tokens) per step. A trailing U+FFFD (an incomplete
  UTF-8 character) is held back until completed. Stop strings follow OpenAI: the text ends where the first one
  starts, and a tail that may begin one is held back until it cannot. Deltas never change once returned; after
  ``finish`` they concatenate to ``sent``, the final text.
"""

from __future__ import annotations

from .errors import RetrospecError


def check_encodable(text: str, what: str = "the prompt") -> str:
    """``text`` unchanged when it is a string that UTF-8 can encode; a ``RetrospecError`` otherwise."""
    if not isinstance(text, str):
        raise RetrospecError(f"{what} must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RetrospecError(f"{what} holds text that cannot be encoded as UTF-8 ({exc.reason} at position "
                             f"{exc.start})") from None
    return text


def encode(tokenizer, text: str, what: str = "the prompt", *, max_tokens: int | None = None,
           special: bool = True) -> list[int]:
    """Token ids of ``text`` (no special tokens added). ``special=False`` encodes text that spells a special token
    (``<|im_end|>``) as plain text instead of as that token. ``max_tokens``: text too long to fit in that many
    tokens is refused *before* tokenizing (``fits``), so an oversized prompt costs no tokenizer time or memory."""
    if max_tokens is not None and isinstance(text, str):
        fits(tokenizer, text, max_tokens, what)
    check_encodable(text, what)
    kwargs = {} if special else {"split_special_tokens": True}
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])


SAFETY = 4  # slack over the bound below, for normalizers that drop characters


def fits(tokenizer, text: str, max_tokens: int, what: str = "the prompt") -> None:
    """Refuse ``text`` when it cannot fit in ``max_tokens`` tokens, judged without tokenizing: no token of the
    vocabulary spells more than ``longest_token_chars`` characters, so a text ``SAFETY`` times longer than
    ``max_tokens`` such tokens needs more than ``max_tokens`` tokens."""
    bound = max_tokens * longest_token_chars(tokenizer) * SAFETY
    if len(text) > bound:
        raise RetrospecError(f"{what} is too long: {len(text)} characters cannot fit in the {max_tokens} tokens "
                             "the target supports")


_LONGEST: dict[int, tuple[object, int]] = {}


def longest_token_chars(tokenizer) -> int:
    """The most UTF-8 bytes any vocabulary entry spells (an upper bound on the characters one token covers)."""
    hit = _LONGEST.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    longest = max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=1)
    _LONGEST[id(tokenizer)] = (tokenizer, max(1, longest))
    return max(1, longest)


def special_texts(tokenizer) -> tuple[str, ...]:
    """The strings a tokenizer turns into special (control) tokens when it parses text, longest first."""
    found = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
             if getattr(t, "special", False) and getattr(t, "content", "")}
    found |= {t for t in getattr(tokenizer, "all_special_tokens", ()) or () if isinstance(t, str) and t}
    return tuple(sorted(found, key=lambda t: (-len(t), t)))


def check_prompt_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """Token ids as a list of ints, each in [0, vocab_size); ``RetrospecError`` otherwise."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, (list, tuple)):
        raise RetrospecError(f"{what} must be text or a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RetrospecError(f"{what} token ids must be integers; item {i} is {t!r}")
        if not 0 <= t < vocab_size:
            raise RetrospecError(f"{what} token id {t} (item {i}) is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


class TextStream:
    """Final text deltas from token ids (see the module docstring)."""

    CONTEXT = 5  # tokens decoded before the new ones, so a token's leading space / merge is decoded as in context

    def __init__(self, tokenizer, stops: tuple[str, ...] | list[str] = ()):
        self.tok = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self._start = 0  # window start: decoding ids[_start:] gives the context text + the pending text
        self._done = 0  # ids[:_done] are decoded into ``text``
        self.text = ""  # decoded text so far (complete characters), stop strings not applied
        self.sent = ""  # final text returned so far
        self.stopped = False  # a stop string was found; the text ends where it starts

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """Add committed token ids; returns the new final text (may be empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        before = self._decode(self.ids[self._start:self._done])
        now = self._decode(self.ids[self._start:])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.text += now[len(before):]
            self._start, self._done = max(0, len(self.ids) - self.CONTEXT), len(self.ids)
        return self._emit(hold=True)

    def finish(self, full_text: str | None = None) -> str:
        """The last delta: pending tokens are decoded as they are (a trailing U+FFFD included). ``full_text`` (the
        whole output decoded at once) replaces the incremental text when it extends what was sent."""
        if not self.stopped:
            rest = self._decode(self.ids[self._start:])[len(self._decode(self.ids[self._start:self._done])):]
            self.text += rest
            self._done = len(self.ids)
            if full_text is not None and full_text.startswith(self.sent):
                self.text = full_text
        return self._emit(hold=False)

    def _emit(self, hold: bool) -> str:
        if self.stopped:
            return ""
        text = self.text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]  # where stop strings start
        if hits:
            self.stopped, text = True, text[:min(hits)]
        elif hold:
            held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - held]
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""
