"""In-distribution datastore documents: the target's own greedy continuations of a prompt file (``--from-generations``).

Each document is prompt + continuation with ``index_from`` at the continuation: dense stores index only the keys
whose drafts are the target's own tokens (the paper's "response" datastore); suffix stores keep every token.

Invariant: documents come out in the prompt file's order, so the same prompts and target give the same store.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..batched import generate_batch
from ..errors import RetrospecError
from ..identity import model_identity
from ..retrieval.corpus import TokenDoc
from ..tasks import load_prompts

GENERATIONS_FILE = "generations.jsonl"


def generation_documents(prompts_path: str | Path, target, *, max_new_tokens: int = 128, batch_size: int = 32,
                         chat: bool = False, progress: bool = True) -> tuple[list[TokenDoc], list[dict], str]:
    """The target's (a ``LoadedModel``) own greedy continuations of the prompts in a jsonl file (``prompt`` field
    per line), decoded ``batch_size`` at a time, shortest first (``batched.generate_batch``: each row equals plain
    greedy decoding). With ``chat`` each prompt is one user message under the target's chat template, and a reply
    also ends at the template's end-of-turn token (as ``bench --chat`` decodes). Rows that already carry
    ``prompt_ids`` and ``completion_ids`` from the same target, ``max_new_tokens`` and ``chat`` (the
    ``generations.jsonl`` a previous ID build saved in its store) are reused. A row's ``stop`` is the EOS or
    end-of-turn token that ended its reply (None: cut at ``max_new_tokens``), kept out of the document (the builders
    add their own separator). Returns the documents, the rows to save, and a description."""
    if target.tokenizer is None:
        raise RetrospecError(f"--from-generations needs a target with a tokenizer ({target.path} has none)")
    prompts = load_prompts(prompts_path)
    fingerprint = model_identity(target.model)["fingerprint"]
    eos = target.eos_ids()
    if chat:
        from ..chat import build_chat_prompt, end_of_turn_ids

        eos = eos | set(end_of_turn_ids(target.tokenizer))
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    limit = target.max_positions or 1 << 30
    entries: list[list] = []  # [row, prompt ids, completion (None = to do), the token that ended it or None]
    reused = 0
    for row in prompts:
        if (row.get("target") == fingerprint and row.get("max_new_tokens") == max_new_tokens
                and bool(row.get("chat")) == chat
                and isinstance(row.get("prompt_ids"), list) and isinstance(row.get("completion_ids"), list)):
            entries.append([row, [int(t) for t in row["prompt_ids"]], [int(t) for t in row["completion_ids"]],
                            row.get("stop")])
            reused += 1
            continue
        if chat:
            ids = build_chat_prompt(target.tokenizer, [{"role": "user", "content": row["prompt"]}],
                                    name=f"target {target.path}").prompt_ids
        else:
            ids = target.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        if ids and len(ids) < limit:
            entries.append([row, list(ids), None, None])
    todo = sorted((i for i, e in enumerate(entries) if e[2] is None), key=lambda i: len(entries[i][1]))
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", disable=not progress, dynamic_ncols=True)
    for k in range(0, len(todo), batch_size):
        batch = todo[k:k + batch_size]
        room = min(max_new_tokens, limit - max(len(entries[i][1]) for i in batch))  # positions left in the model
        res = generate_batch(target.model, [entries[i][1] for i in batch], max_new_tokens=room, eos_ids=eos,
                             pad_id=pad)
        for i, out in zip(batch, res.tokens):
            stop = out[-1] if out and out[-1] in eos else None
            entries[i][2:] = [out[:-1] if stop is not None else out, stop]  # the builders add the separator EOS
        bar.update(len(batch))
    bar.close()
    docs = [TokenDoc(np.asarray(ids + out, dtype=np.int32), index_from=len(ids)) for _, ids, out, _ in entries]
    rows = [{"prompt": row["prompt"], "prompt_ids": ids, "completion_ids": out, "stop": stop, "target": fingerprint,
             "max_new_tokens": max_new_tokens, "chat": chat} for row, ids, out, stop in entries]
    generated = sum(len(out) for _, _, out, _ in entries)
    if not docs:
        raise RetrospecError(f"no usable prompts in {prompts_path}")
    desc = (f"greedy generations of {target.path} on {len(docs)} {'chat ' if chat else ''}prompts from {prompts_path} "
            f"(max {max_new_tokens} new tokens, batched {batch_size}, {generated} generated tokens"
            + (f", {reused} reused from the file" if reused else "") + ")")
    return docs, rows, desc


def as_decoded(docs: list[TokenDoc], rows: list[dict]) -> list[TokenDoc]:
    """``generation_documents``' documents with the token that ended each reply (``stop``: EOS or end of turn) put
    back, as decoding emits it."""
    return [d if row.get("stop") is None else TokenDoc(np.append(d.ids, row["stop"]).astype(np.int32), d.index_from)
            for d, row in zip(docs, rows)]


def save_generations(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
