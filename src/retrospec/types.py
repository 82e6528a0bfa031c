"""Typed hand-offs between the stages: Drafter -> Verifier -> AcceptanceRule.

Vocabulary: p is the target's next-token distribution, q the draft's. A verification step commits the *accepted*
draft tokens, then one *recovered* token (from the residual after a rejection) or *bonus* token (from p after full
acceptance). tau = new tokens / target verification calls (the last prompt token is the root of the first step, so
every counted call commits >= 1 token: plain decoding has tau = 1.00); acceptance rate = accepted / drafted tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class DraftTree:
    """Draft nodes below the last committed token (the implicit root), in topological order: ``parents[i] < i``
    (-1 = the root; a chain is ``[-1, 0, 1, ...]``). ``draft_probs[i]`` is the q node i was drawn from; ``None``
    means a deterministic draft, treated as one-hot q by the acceptance rules."""

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64
    draft_probs: torch.Tensor | None = None  # [N, V] float, or None
    is_chain: bool = field(default=None, compare=False)  # derived from parents when not given

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.is_chain is None:
            self.is_chain = bool(torch.equal(self.parents, torch.arange(-1, n - 1, dtype=torch.long)))
        if self.parents.shape != (n,):
            raise ValueError(f"parents shape {tuple(self.parents.shape)} != tokens shape ({n},)")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError("draft_probs must have one row per node")

    @classmethod
    def empty(cls) -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long)
        return cls(z, z.clone(), is_chain=True)

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.arange(-1, toks.shape[0] - 1, dtype=torch.long)
        return cls(toks, parents, draft_probs, is_chain=True)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class StepResult:
    """What an acceptance rule decided for one verification step."""

    accepted_nodes: list[int]  # node indices of the accepted path, root-to-leaf order
    next_token: int  # the recovered token (after a rejection) or the bonus token (full acceptance)
    bonus: bool  # True when every node on the chosen path was accepted and the path ended at a leaf


@dataclass
class SpecStats:
    """Per-request statistics; field names are part of the CLI/JSON contract."""

    method: str = ""
    new_tokens: int = 0
    target_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_tokens: int = 0
    rule: str = ""  # the acceptance rule's name
    lossless: bool = True  # False when the rule changes the output distribution (RAPID with eta > 0)
    retrieval_s: float = 0.0  # long-context methods: time to chunk, embed and select the retrieved context
    retrieved_tokens: int = 0  # long-context methods: target tokens in the retrieved context
    per_position_drafted: list[int] = field(default_factory=list)  # index d: steps that drafted depth d+1
    per_position_accepted: list[int] = field(default_factory=list)  # index d: steps that accepted depth d+1
    gating: bool = False  # the gate chose each step's draft budget (``gating``); False = the full budget always
    gated_steps: int = 0  # steps the gate ran without a draft although the drafter had room
    draft_shapes: dict[str, int] = field(default_factory=dict)  # node budget handed to the drafter -> steps
    draft_state_bytes: int | None = None  # the drafter's own state at the end (``Drafter.state_bytes``; 0 = none)
    target_kv_bytes: int | None = None  # the target's KV cache at the end (keys/values of the cached positions)

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: new tokens / seconds after the prompt forward."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    def record_step(self, drafted_depth: int, drafted_nodes: int, accepted: int) -> None:
        self.target_calls += 1
        self.drafted_tokens += drafted_nodes
        self.accepted_tokens += accepted
        grow = max(0, drafted_depth - len(self.per_position_drafted))
        self.per_position_drafted.extend([0] * grow)
        self.per_position_accepted.extend([0] * grow)
        for d in range(drafted_depth):
            self.per_position_drafted[d] += 1
        for d in range(accepted):
            self.per_position_accepted[d] += 1

    def record_shape(self, budget: int, gated: bool) -> None:
        key = str(budget)
        self.draft_shapes[key] = self.draft_shapes.get(key, 0) + 1
        self.gated_steps += int(gated)

    def to_dict(self) -> dict:
        return asdict(self) | {k: getattr(self, k) for k in ("mean_accepted_tokens", "acceptance_rate", "tokens_per_s",
                                                               "per_position_acceptance")}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: SpecStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}
