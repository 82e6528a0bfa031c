"""Chat prompts: messages -> the target's chat template -> prompt token ids, plus the template's end-of-turn ids.

A chat request is ordinary prompt ids plus a larger EOS set, so every method, lossless check and HF peer treats it
like any other prompt. Contract:
- ``chat_messages(prompt, messages, chat)``: the request's messages, validated (roles system / user / assistant,
  non-empty text content, at least one user message, not ending with the assistant's), or None for a raw completion.
  ``chat=True`` with a text prompt means one user message.
- ``build_chat_prompt(tokenizer, messages)``: ``apply_chat_template(..., tokenize=False, add_generation_prompt=True)``
  encoded with ``add_special_tokens=False``: exactly the ids of ``tokenize=True`` (tested) for messages that spell
  no control token. No chat template is a ``RetrospecError``. Content that spells a control token
  (``"hi<|im_end|>\\n<|im_start|>system ..."``) is encoded as plain text, never as that token: a message cannot
  forge a role or end a turn (transformers' ``tokenize=True`` would parse it).
- ``end_of_turn_ids(tokenizer)``: the tokenizer's EOS and any of ``END_OF_TURN_MARKERS`` that the template writes
  after a reply, each only if it is a single token; empty when there is none (the model's EOS ids then end turns).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import RetrospecError
from .text import encode, fits, special_texts

ROLES = ("system", "user", "assistant")
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_PROBE_USER = "retrospec probe question"
_PROBE_REPLY = "retrospec probe reply"


@dataclass(frozen=True)
class ChatPrompt:
    prompt_ids: list[int]  # the rendered conversation, ending with the assistant's generation prompt
    end_of_turn_ids: frozenset[int]  # add these to the request's EOS ids


def validate_messages(messages) -> list[dict]:
    """A clean copy of ``messages`` ({"role", "content"} only); ``RetrospecError`` says what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RetrospecError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RetrospecError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RetrospecError(f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise RetrospecError(f"messages[{i}] needs 'content' as a string, got {type(content).__name__}")
        if not content.strip():
            raise RetrospecError(f"messages[{i}] has empty content")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise RetrospecError("messages need at least one user message")
    if out[-1]["role"] == "assistant":
        raise RetrospecError("the last message is the assistant's; the model answers after a user message")
    return out


def chat_messages(prompt, messages, chat: bool) -> list[dict] | None:
    """Messages of one request: ``messages`` validated, or ``prompt`` as one user message when ``chat``; None for a
    raw completion (no chat template)."""
    if messages is not None:
        if prompt is not None:
            raise RetrospecError("pass either a prompt or messages, not both")
        return validate_messages(messages)
    if not chat:
        return None
    if not isinstance(prompt, str):
        raise RetrospecError("chat needs the prompt as text (it becomes one user message), not token ids")
    if not prompt.strip():
        raise RetrospecError("prompt is empty")
    return [{"role": "user", "content": prompt}]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], *, name: str = "the target") -> str:
    """The conversation as text, ending with the assistant's generation prompt."""
    if tokenizer is None:
        raise RetrospecError(f"{name} has no tokenizer; chat needs one with a chat template")
    if not has_chat_template(tokenizer):
        raise RetrospecError(f"{name} has no chat template; chat (--chat, messages=...) needs a chat model "
                             "(drop --chat for a raw completion)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja raise_exception(...) in the template, e.g. "System role not supported"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetrospecError(f"the chat template of {name} rejected the messages: {first}") from exc


def build_chat_prompt(tokenizer, messages: list[dict], *, name: str = "the target",
                      max_tokens: int | None = None) -> ChatPrompt:
    """Prompt ids of ``messages`` under the tokenizer's chat template, and the template's end-of-turn ids. Only the
    template writes control tokens: text in a message that spells one (``<|im_end|>``) is encoded as plain text.
    ``max_tokens``: a conversation too long to fit is refused before tokenizing."""
    if max_tokens is not None:
        fits(tokenizer, "".join(m["content"] for m in messages), max_tokens, "the messages")
    spelled = [t for t in special_texts(tokenizer) if any(t in m["content"] for m in messages)]
    if not spelled:
        ids = encode(tokenizer, render(tokenizer, messages, name=name), "the messages")
    else:
        ids = _encode_spelled(tokenizer, messages, spelled, name)
    return ChatPrompt(ids, end_of_turn_ids(tokenizer))


def _encode_spelled(tokenizer, messages: list[dict], spelled: list[str], name: str) -> list[int]:
    """``messages`` whose contents spell control tokens: each spelling is swapped for a placeholder the template
    passes through, the rendered text is encoded piece by piece, and each placeholder becomes its spelling encoded
    as plain text (``encode(..., special=False)``)."""
    text = "".join(m["content"] for m in messages)
    tag = next(f"\ue000{k}\ue001" for k in range(len(text) + 1) if f"\ue000{k}\ue001" not in text)
    marks = {f"{tag}{i}\ue002": t for i, t in enumerate(spelled)}  # placeholder -> the spelled control token
    find = re.compile("|".join(re.escape(t) for t in spelled))  # longest first: a spelling inside another loses
    back = {t: p for p, t in marks.items()}
    masked = [{**m, "content": find.sub(lambda hit: back[hit.group(0)], m["content"])} for m in messages]
    rendered = render(tokenizer, masked, name=name)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(re.escape(p) for p in marks) + ")", rendered):
        if piece in marks:
            ids += encode(tokenizer, marks[piece], "the messages", special=False)
        elif piece:
            ids += encode(tokenizer, piece, "the messages")
    return ids


def _single_token_id(tokenizer, marker: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(marker)
    if not isinstance(tid, int) or (tid == tokenizer.unk_token_id and marker != tokenizer.unk_token):
        return None
    return tid if tokenizer(marker, add_special_tokens=False)["input_ids"] == [tid] else None


def _after_reply(tokenizer) -> str:
    """What the template writes after an assistant reply (or after a user message when it refuses the probe)."""
    for probe, last in (([{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}],
                         _PROBE_REPLY),
                        ([{"role": "user", "content": _PROBE_USER}], _PROBE_USER)):
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        except Exception:
            continue
        if isinstance(text, str) and last in text:
            return text[text.rindex(last) + len(last):]
    return ""


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """Token ids that end an assistant turn under this tokenizer's chat template (see the module docstring)."""
    if not has_chat_template(tokenizer):
        return frozenset()
    tail = _after_reply(tokenizer)
    eos = getattr(tokenizer, "eos_token", None)
    ids = set()
    for marker in ((eos,) if isinstance(eos, str) and eos else ()) + END_OF_TURN_MARKERS:
        if marker in tail:
            tid = _single_token_id(tokenizer, marker)
            if tid is not None:
                ids.add(tid)
    return frozenset(ids)
