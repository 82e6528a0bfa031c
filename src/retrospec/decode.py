"""The speculative decoding loop, and the naive autoregressive generator that is its test oracle.

The loop works on token ids: it yields the committed ids of each verification step as soon as they are committed
(streaming). Stop strings are the caller's business (close the generator); EOS ids and ``max_new_tokens`` are
handled here.

Loop invariant: the target's KV cache holds every committed token except the last one, the root of the next draft
tree. One step = draft (drafter.propose) -> one target forward over [root, *tree] (Verifier.score) -> acceptance
rule -> commit the accepted path to the cache -> feedback (drafter.observe, and the gate).

Timing uses ``device_clock``, which waits for the device on CUDA (else asynchronous launches would be timed and the
gate's step costs wrong). Gating (``gating.Gate``) picks each step's node budget (0 = a plain step); it changes
what is drafted, never what is accepted, so every output guarantee holds with or without it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .acceptance import AcceptanceRule, GreedyMatch, RejectionSampling
from .config import SamplingConfig
from .drafters.base import DecodeContext, Drafter, NoDraft, TargetViews, state_bytes
from .gating import Gate, profile_for
from .sampling import make_generator, probs_from_logits
from .text import check_prompt_ids
from .tree import depths, within_depth
from .types import SpecStats
from .fastpath import device_clock
from .verify import PrefillMemo, Verifier


def default_rule(sampling: SamplingConfig) -> AcceptanceRule:
    return GreedyMatch() if sampling.greedy else RejectionSampling()


def draft_room(max_new_tokens: int, new_tokens: int, positions_left: int) -> tuple[int, int]:
    """(nodes, depth) a step may draft: the positions left in the model bound the tree's nodes (each is written to
    the target's cache while it is verified), the new tokens still allowed bound its depth (an accepted path longer
    than that would be cut), each less the step's recovered or bonus token (never below 0). Bounding the depth, not
    the nodes, by the tokens left keeps a tree drafter's full width to the end of a generation."""
    depth = max(0, min(max_new_tokens - new_tokens, positions_left) - 1)
    return (max(0, positions_left - 1) if depth else 0), depth


def speculative_generate(
    target: torch.nn.Module,
    drafter: Drafter,
    prompt_ids: list[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    stats: SpecStats | None = None,
    rule: AcceptanceRule | None = None,
    prefill_memo: PrefillMemo | None = None,
    gating: bool = False,
    fastpath: str | None = None,
) -> Iterator[list[int]]:
    """Yield committed token ids step by step, filling ``stats``. ``prefill_memo``: see ``verify.PrefillMemo``.
    ``gating=True`` lets the gate pick each step's budget (the entry points decide with ``gating.resolve``).
    ``fastpath``: the verifier's engine (``fastpath.engine_for``; None = measured default, "off" = the target as is)."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    prompt_ids = check_prompt_ids(prompt_ids, int(target.get_input_embeddings().weight.shape[0]))
    stats = stats if stats is not None else SpecStats()
    rule = rule or default_rule(sampling)
    stats.rule, stats.lossless = rule.name, rule.lossless
    gen = make_generator(sampling.seed)
    TargetViews.declared(drafter.needs)
    want = tuple(drafter.feature_layers) if "layer_states" in drafter.needs else "hidden_states" in drafter.needs
    verifier = Verifier(target, want_hidden=want, fastpath=fastpath)
    max_pos = getattr(target.config, "max_position_embeddings", None) or 1 << 30
    stats.prompt_tokens = len(prompt_ids)
    gate = Gate(profile_for(target), drafter.name, enabled=gating and not isinstance(drafter, NoDraft))
    stats.gating = gate.enabled

    def pick(p_rows: torch.Tensor) -> torch.Tensor:  # logits -> what the rule consumes
        return p_rows if sampling.greedy else probs_from_logits(p_rows, sampling)

    clock = device_clock(next(target.parameters()).device)  # the step costs feed the gate: measured, not launched
    t0 = clock()
    # Prefill all but the last prompt token: the last one is the root of the first step, so the first target call
    # both finishes the prompt and verifies a draft (one target forward fewer than prefill-then-decode).
    if len(prompt_ids) > 1:
        verifier.prefill(prompt_ids[:-1], prefill_memo)
    views = TargetViews(kv=verifier.kv if "target_kv" in drafter.needs else None)  # read-only (MagicDec copies)
    hidden_view = "layer_states" if isinstance(want, tuple) else "hidden_states"
    if verifier.want_hidden and verifier.last_hidden is not None:
        setattr(views, hidden_view, verifier.last_hidden[-1])  # [H] or [n, H]
    ctx = DecodeContext(tokens=list(prompt_ids), prompt_len=len(prompt_ids), sampling=sampling, generator=gen,
                        target=views, eos_ids=frozenset(eos_ids))
    drafter.prefill(ctx)
    stats.prefill_s = clock() - t0
    t_start = clock()
    try:
        done = False
        while not done:
            if len(ctx.tokens) >= max_pos:  # the model has no position left for another token
                break
            t = clock()
            room, ctx.max_depth = draft_room(max_new_tokens, stats.new_tokens, max_pos - len(ctx.tokens))
            given = gate.choose(room, len(ctx.tokens))
            tree = within_depth(drafter.propose(ctx, given), ctx.max_depth)
            t_draft = clock()
            logits = verifier.score(ctx.tokens[-1], tree)  # [1 + N, V]
            t_verify = clock()
            step = rule.accept(tree, pick(logits), gen)  # reads its decision back: one sync (greedy, chains)
            verifier.commit(step.accepted_nodes)
            gate.update(given, len(tree), step.accepted_nodes, t_draft - t, clock() - t_draft,
                        len(ctx.tokens), depth_bound=ctx.max_depth < given)
            if gate.enabled:
                stats.record_shape(given, gated=given == 0 and room > 0)
            stats.draft_s += t_draft - t
            stats.verify_s += t_verify - t_draft
            toks = tree.tokens[step.accepted_nodes].tolist() + [step.next_token]
            depth = len(tree) if tree.is_chain else int(depths(tree.parents).max())
            stats.record_step(depth, len(tree), len(step.accepted_nodes))
            drafter.observe(len(step.accepted_nodes), len(tree))
            for i, tok in enumerate(toks):  # cut at EOS / max_new_tokens
                if tok in eos_ids or stats.new_tokens + i + 1 >= max_new_tokens:
                    toks = toks[: i + 1]
                    done = True
                    break
            ctx.tokens.extend(toks)
            if verifier.want_hidden:  # the row that produced the new root
                setattr(views, hidden_view, verifier.last_hidden[([0] + [a + 1 for a in step.accepted_nodes])[-1]])
            stats.new_tokens += len(toks)
            yield toks
    finally:
        stats.decode_s = clock() - t_start
        stats.draft_state_bytes, stats.target_kv_bytes = state_bytes(drafter), verifier.kv.nbytes()
        gate.finish()


@torch.inference_mode()
def autoregressive_generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """The oracle: recompute the whole sequence each step (no cache, no drafting). Slow and obviously right."""
    gen = make_generator(sampling.seed)
    ids = list(prompt_ids)
    out: list[int] = []
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        # [V], back on the CPU: the oracle decides there whatever the model's device (a CPU model: no copy)
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].cpu()
        tok = int(logits.argmax()) if sampling.greedy else int(
            torch.multinomial(probs_from_logits(logits, sampling), 1, generator=gen))
        ids.append(tok)
        out.append(tok)
        if tok in eos_ids:
            break
    return out
