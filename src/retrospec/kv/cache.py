"""Adapter over a ``transformers`` ``DynamicCache`` with the two operations speculative decoding needs.

- ``crop(length)``: drop everything past ``length`` (a rejected chain suffix) through the public ``Cache.crop``.
- ``keep(start, offsets)``: after a tree verification, keep positions ``[0, start)`` plus ``start + o`` for each
  offset (the root and the accepted path), dropping the siblings that were scored but rejected. A contiguous
  ``offsets = [0, 1, ..., k-1]`` is just a crop; otherwise each layer's keys/values are gathered once.

Invariant (tested): after ``keep``, the cache equals one computed from scratch on the committed tokens, because a
tree forward with an ancestor mask and depth-based ``position_ids`` writes exactly the keys/values a chain forward
of that path would. Only full-attention dynamic layers are supported; others are refused clearly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..errors import RetrospecError


class KVCache:
    def __init__(self, model: torch.nn.Module):
        self.cache = DynamicCache(config=model.config)

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    def crop(self, length: int) -> None:
        extra = len(self) - length
        if extra > 0:
            self.cache.crop(-extra)

    def keep(self, start: int, offsets: list[int]) -> None:
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        idx = torch.tensor([start + o for o in offsets], dtype=torch.long)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer or isinstance(layer, DynamicSlidingWindowLayer):
                raise RetrospecError(
                    f"tree verification needs full-attention cache layers; this model uses {type(layer).__name__}"
                )
            if not layer.is_initialized:
                continue
            idx_d = idx.to(layer.keys.device)
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx_d)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx_d)], dim=-2)

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [batch, kv_heads, seq, head_dim]; read-only views for drafters/tests."""
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]
