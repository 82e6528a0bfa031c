"""Text at the edges of the engine: encoding user text, and token ids back to final text with stop strings.

The one place that turns a request's text into ids and ids into the text a caller sees (API, server and CLI).

Contracts:
- ``encode(tokenizer, text)``: text that cannot be encoded (a lone surrogate such as ``"\\udcff"``, a non-string)
  is a user error (``RetrospecError``), never a tokenizer ``TypeError``.
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


def encode(tokenizer, text: str, what: str = "the prompt") -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return list(tokenizer(check_encodable(text, what), add_special_tokens=False)["input_ids"])


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
