"""The target <-> draft vocabulary map of a draft with a reduced vocabulary (``draft_vocab.json``): one helper for
the drafter (``drafters.small_lm``), the trainer (``train.real_draft``) and ``bench.hf_peers.full_vocab_draft``.

Invariants: ``ids`` [Vd] are distinct target ids; ``to_draft`` [V] maps every target id to a draft row: its own row
when covered, else the row of target id ``unk_target_id`` (0) when that is covered, else row 0; ``covered`` [V] says
which target ids have a row. ``scatter`` puts draft logits at their target ids with ``fill`` (-inf: q = 0 off the
subset, so both acceptance rules stay exact) elsewhere.
"""

from __future__ import annotations

import torch


class VocabMap:
    def __init__(self, ids, target_vocab: int, unk_target_id: int = 0):
        self.ids = torch.as_tensor(ids, dtype=torch.long)  # [Vd] target id of each draft row
        self.target_vocab = int(target_vocab)
        to_draft = torch.full((self.target_vocab,), -1, dtype=torch.long, device=self.ids.device)  # [V]
        to_draft[self.ids] = torch.arange(len(self.ids), device=self.ids.device)
        self.covered = to_draft >= 0  # [V] bool
        unk = int(to_draft[unk_target_id]) if bool(self.covered[unk_target_id]) else 0
        self.to_draft = to_draft.masked_fill(~self.covered, unk)  # [V] draft row read for each target id

    def to(self, device) -> VocabMap:
        out = object.__new__(VocabMap)
        out.target_vocab = self.target_vocab
        out.ids, out.to_draft, out.covered = self.ids.to(device), self.to_draft.to(device), self.covered.to(device)
        return out

    def scatter(self, logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """[..., Vd] draft logits -> [..., V] with ``fill`` at target ids the draft does not cover."""
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), fill)  # [..., V]
        return full.index_copy_(-1, self.ids, logits)
