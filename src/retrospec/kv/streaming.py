"""StreamingLLM KV cache: attention sinks + a recent window (Xiao et al., ICLR 2024), for MagicDec's drafter (Chen et
al., 2024: "MagicDec: breaking the latency-throughput tradeoff for long context generation with speculative decoding").
``SinkWindowCache`` keeps the keys/values of the first ``sink`` and the ``window`` most recent committed positions in a
transformers ``DynamicCache`` (``.cache``). Keys keep RoPE at their original positions and new queries use their true
``position_ids``; transformers computes the mask from cache indices, which a compressed cache needs.
``from_layers`` starts from another cache's sink and window slices (the target's prefill); the drafter appends and
marks committed tokens (``mark_committed``), appends draft tokens, ``rollback``s them before the next step, and
``evict``s committed entries between the sinks and the window.

Invariant (tested): after ``evict()``, ``positions == [0 .. sink-1] + [n - window .. n - 1]`` where n is the number
of committed positions seen (or all of them while n <= sink + window), and ``len(self) == len(positions)``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .cache import KVCache


class SinkWindowCache:
    def __init__(self, config, sink: int = 4, window: int = 1024):
        if sink < 0 or window < 1:
            raise ValueError(f"need sink >= 0 and window >= 1, got sink={sink}, window={window}")
        self.sink, self.window = sink, window
        self.cache = DynamicCache(config=config)
        self.positions: list[int] = []  # original position of every committed entry, cache order
        self.seen = 0  # committed positions seen so far (the next committed token's position)

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    @classmethod
    def from_layers(cls, config, layers: list[tuple[torch.Tensor, torch.Tensor]], sink: int, window: int,
                    ) -> "SinkWindowCache":
        """Copy the sink + window slices of ``layers`` ((keys, values) per layer, [b, h, n, d]) into a new cache."""
        self = cls(config, sink, window)
        n = int(layers[0][0].shape[-2]) if layers else 0
        keep = self._kept_positions(n)
        idx = torch.tensor(keep, dtype=torch.long)
        for layer_idx, (k, v) in enumerate(layers):
            i = idx.to(k.device)
            self.cache.update(k.index_select(-2, i).clone(), v.index_select(-2, i).clone(), layer_idx)
        self.positions, self.seen = keep, n
        return self

    def _kept_positions(self, n: int) -> list[int]:
        if n <= self.sink + self.window:
            return list(range(n))
        return list(range(self.sink)) + list(range(n - self.window, n))

    def mark_committed(self, count: int) -> None:
        """The last ``count`` entries just appended are committed tokens at positions seen, seen + 1, ..."""
        self.positions.extend(range(self.seen, self.seen + count))
        self.seen += count

    def rollback(self) -> None:
        """Drop every entry appended after the last committed one (the previous step's draft tokens)."""
        extra = len(self) - len(self.positions)
        if extra > 0:
            self.cache.crop(-extra)

    def evict(self) -> None:
        """Keep the sinks and the ``window`` most recent committed entries."""
        if len(self.positions) <= self.sink + self.window:
            return
        self.rollback()
        drop_to = len(self.positions) - self.window  # entries [sink, drop_to) go
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            layer.keys = torch.cat([layer.keys[..., : self.sink, :], layer.keys[..., drop_to:, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., : self.sink, :], layer.values[..., drop_to:, :]], dim=-2)
        self.positions = self.positions[: self.sink] + self.positions[drop_to:]

    layer_tensors = KVCache.layer_tensors
    nbytes = KVCache.nbytes  # sinks, window, and any draft entries not rolled back yet
