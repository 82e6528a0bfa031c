"""Prompts of Speculative RAG (Wang et al., "Speculative RAG: Enhancing Retrieval Augmented Generation through
Drafting", ICLR 2025) — written for this project; the paper's text does not give its prompts.

Three texts, each rendered with the model's chat template when it has one (plain text otherwise):

- **Drafter** (one per document subset δ): documents, question Q, instruction; the assistant turn is
  ``"Rationale: β\\nAnswer: α"``. ``drafter_prompt`` ends with ``"Rationale:"`` so that generation starts inside
  the rationale; the same layout is the training target of ``retrospec train rag-drafter``.
- **Verifier** (one per draft, teacher-forced): ``[Q, α, β, R, "Yes"]`` as a conversation: user Q, assistant
  ``"Answer: α\\nExplanation: β"``, user R (``REFLECTION``), assistant ``"Yes"``. ``verifier_text`` returns the
  text and the character spans of α, β and "Yes" (scored as whatever token(s) cover it in context).
- **Answering** (``standard`` and ``closed-book``): documents (or none), the question, and an assistant turn that
  starts with ``"Answer:"``; the model writes the answer up to the end of the line.

Invariant: every span returned is a ``(start, end)`` slice of the returned text whose content is exactly the
string it stands for (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..chat import has_chat_template, render
from ..errors import RetrospecError
from .data import Passage

RATIONALE_TAG = "Rationale:"
ANSWER_TAG = "Answer:"
EXPLANATION_TAG = "Explanation:"
REFLECTION = "Do you think the explanation supports the answers? (Yes or No)"
YES = "Yes"
DRAFT_INSTRUCTION = ("Answer the question using the documents. First write \"Rationale:\" and the sentence of the "
                     "documents that supports the answer, then \"Answer:\" and the answer in a few words.")
ANSWER_INSTRUCTION = "Answer the question using the documents, in a few words."
CLOSED_BOOK_INSTRUCTION = "Answer the question in a few words."

Span = tuple[int, int]


def format_documents(passages: Sequence[Passage]) -> str:
    return "\n\n".join(f"Document [{i + 1}] (Title: {p.title}) {p.text}" if p.title else f"Document [{i + 1}] {p.text}"
                       for i, p in enumerate(passages))


def _user_turn(question: str, passages: Sequence[Passage], instruction: str) -> str:
    docs = format_documents(passages)
    return (f"{docs}\n\n" if docs else "") + f"Question: {question}\n{instruction}"


def _prompt(tokenizer, user: str, reply_start: str) -> str:
    """The conversation up to the assistant's reply, then ``reply_start`` (the reply's first words)."""
    if tokenizer is not None and has_chat_template(tokenizer):
        return render(tokenizer, [{"role": "user", "content": user}]) + reply_start
    return f"{user}\n\n{reply_start}"


def drafter_prompt(tokenizer, question: str, passages: Sequence[Passage]) -> str:
    """The drafter's input for one subset, ending with ``"Rationale:"``."""
    return _prompt(tokenizer, _user_turn(question, passages, DRAFT_INSTRUCTION), RATIONALE_TAG)


def draft_reply(rationale: str, answer: str) -> str:
    """The assistant turn the drafter writes (and is trained on), after the prompt's ``"Rationale:"``."""
    return f" {rationale}\n{ANSWER_TAG} {answer}"


def draft_spans(prompt: str, rationale: str, answer: str) -> tuple[str, Span, Span]:
    """``prompt + draft_reply(...)`` and the spans of β and α in it."""
    text = prompt + draft_reply(rationale, answer)
    b0 = len(prompt) + 1
    a0 = b0 + len(rationale) + len(f"\n{ANSWER_TAG} ")
    return text, (b0, b0 + len(rationale)), (a0, a0 + len(answer))


def parse_draft(generated: str) -> tuple[str, str, bool]:
    """Split the text written after ``"Rationale:"`` into (rationale, answer, complete). ``complete`` is False when
    no ``"Answer:"`` was written (the caller then asks for the answer explicitly)."""
    head, sep, tail = generated.partition(ANSWER_TAG)
    rationale = " ".join(head.split())
    if not sep:
        return rationale, "", False
    answer = tail.strip().split("\n", 1)[0].strip()
    return rationale, answer, bool(answer)


def answer_prompt(tokenizer, question: str, passages: Sequence[Passage]) -> str:
    """``standard`` (documents given) and ``closed-book`` (none): the prompt ends with ``"Answer:"``."""
    instruction = ANSWER_INSTRUCTION if passages else CLOSED_BOOK_INSTRUCTION
    return _prompt(tokenizer, _user_turn(question, passages, instruction), ANSWER_TAG)


def first_line(generated: str) -> str:
    return generated.strip().split("\n", 1)[0].strip()


def verifier_text(tokenizer, question: str, answer: str, rationale: str) -> tuple[str, dict[str, Span]]:
    """``[Q, α, β, R, "Yes"]`` for the verifier and the spans ``{"answer", "rationale", "yes"}`` in it."""
    reply = f"{ANSWER_TAG} {answer}\n{EXPLANATION_TAG} {rationale}"
    if tokenizer is not None and has_chat_template(tokenizer):
        messages = [{"role": "user", "content": f"Question: {question}"},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": REFLECTION},
                    {"role": "assistant", "content": YES}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        except Exception as exc:
            raise RetrospecError(f"the verifier's chat template rejected the scoring conversation: {exc}") from exc
    else:
        text = f"Question: {question}\n{reply}\n{REFLECTION} {YES}"
    q = text.find(question)
    r = text.find(reply, q + len(question)) if q >= 0 else -1
    y = text.rfind(YES)
    if q < 0 or r < 0 or y < r + len(reply):
        raise RetrospecError("the verifier's chat template changes message contents; cannot locate the scored spans")
    a0 = r + len(ANSWER_TAG) + 1
    b0 = r + len(reply) - len(rationale)
    return text, {"answer": (a0, a0 + len(answer)), "rationale": (b0, b0 + len(rationale)), "yes": (y, y + len(YES))}
