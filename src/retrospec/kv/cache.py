"""KV cache for speculative decoding: preallocated, position-indexed, rollback by moving a length pointer.

``BufferLayer`` implements transformers' public ``CacheLayerMixin`` over a buffer [batch, kv_heads, capacity,
head_dim] that doubles when full; ``update`` writes in place and returns views of the filled prefix, so a step
copies only the new tokens (the gpt-fast layout: rejecting draft tokens is free).

``KVCache``, the engine's adapter: ``crop(length)`` forgets everything past ``length``; ``keep(start, offsets)``
keeps ``[0, start)`` plus ``start + o`` per offset (the root and the accepted path of a tree): a crop when the
offsets are contiguous, else one in-place gather per layer. Sliding-window or hybrid configs keep transformers' own
layer types (a window layer as ``WindowLayer``, which can roll back past its window), where ``keep`` of a
non-contiguous path is refused clearly.

Every supported transformers release (5.16 to 5.23) runs the same code here: nothing tests a version.

Invariant (tested): after ``keep``, the cache equals one computed from scratch on the committed tokens (a tree
forward with an ancestor mask and depth-based ``position_ids`` writes exactly what a chain forward would).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from ..errors import RetrospecError


def _filled(buffer: str) -> property:
    """A ``BufferLayer`` attribute: the first ``length`` positions of its ``buffer`` (None before the first write)."""

    def get(layer: "BufferLayer") -> torch.Tensor | None:
        b = getattr(layer, buffer, None)
        return None if b is None else b[:, :, : layer.length]

    def set_(layer: "BufferLayer", value) -> None:
        if value is not None:
            raise AttributeError("a BufferLayer's keys and values are views of its buffers (write through update)")

    return property(get, set_)


class BufferLayer(CacheLayerMixin):
    """One layer's keys/values in a growable preallocated buffer; ``keys``/``values`` are views of the filled part."""

    is_croppable = True
    is_sliding = False

    def __init__(self, initial_capacity: int = 256):
        super().__init__()
        self.capacity = initial_capacity
        self.length = 0
        self._k: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_zeros(b, h, self.capacity, d)
        self._v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], cap, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = cap

    # ``keys`` / ``values``: views of the filled part, made when read (a step moves ``length`` once a layer; a view
    # rebuilt each time would cost more than the reads); transformers' constructor sets them to None
    keys = _filled("_k")
    values = _filled("_v")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append(key_states, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [batch, kv_heads, n, head_dim] after the cached positions (growing when full) -> keys, values."""
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            self._grow(self.length + n)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self.keys, self.values

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``n`` more positions (growing when full) -> the whole buffers, for a program that writes the new
        keys / values at [length, length + n) itself; ``advance(n)`` then counts them."""
        if self.length + n > self.capacity:
            self._grow(self.length + n)
        return self._k, self._v

    def advance(self, n: int) -> None:
        """Count ``n`` positions written past the cached ones into the buffers ``reserve`` returned."""
        self.length += n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of tokens to drop from the end."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    @torch.inference_mode()
    def gather_tail(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions [0, start) followed by positions ``idx`` (all >= start); drop the rest. In inference mode:
        the buffers are inference tensors, which refuse in-place writes outside it (``Verifier.commit`` is)."""
        m = idx.numel()
        self._k[:, :, start : start + m] = self._k.index_select(2, idx)
        self._v[:, :, start : start + m] = self._v.index_select(2, idx)
        self.length = start + m

    def reset(self) -> None:
        self.length = 0


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer, recording its past (the states a window would drop stay until the next
    ``crop``, so rejected tokens can be rolled back past the window), whose ``update`` returns only the states the
    attention mask describes (``get_mask_sizes``: at most ``sliding_window - 1`` cached ones, then the new ones).
    transformers 5.23 returns exactly that itself; 5.16 and 5.17 return every recorded state when two forwards run
    without a ``crop`` between them (a prefill, then a step), which a mask of the advertised width does not fit."""

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.activate_past_recording()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]


class KeyBuffer:
    """Keys and values [b, kv_heads, C, d] in their first ``filled`` positions, with room after them, read (and
    written after ``filled``) in place: a LongSpec block's own keys (``run`` writes the new tokens' keys and values
    at [filled, filled + L) and attends over [0, filled + L); the caller leaves room for L more and passes
    ``past_allowed`` for the ``filled`` ones), or the target's last-layer cache buffers (``KVCache.last_buffers``),
    only read."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, filled: int):
        self.k, self.v, self.filled = k, v, filled


class KVCache:
    """The engine's handle on one model's KV cache (``.cache`` is what goes into ``past_key_values``)."""

    def __init__(self, model: torch.nn.Module):
        probe = DynamicCache(config=model.config)
        if probe.layers and all(type(layer) is DynamicLayer for layer in probe.layers):
            self.cache: Cache = Cache(layers=[BufferLayer() for _ in probe.layers])
        else:  # sliding-window / hybrid attention: keep transformers' own layer types, a window layer as WindowLayer
            # past recording keeps the states a window layer would drop until the next crop, so a rollback past
            # the window is possible (transformers refuses to crop such a layer otherwise)
            self.cache = Cache(layers=[WindowLayer(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer
                                       else layer for layer in probe.layers])
            self.cache.activate_past_recording()

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    def crop(self, length: int) -> None:
        extra = len(self) - length
        if extra > 0 or (extra == 0 and length > 0):  # crop(0): a no-op, but window layers trim to their window
            self.cache.crop(-extra)

    def keep(self, start: int, offsets: list[int]) -> None:
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
            return
        idx = torch.tensor([start + o for o in offsets], dtype=torch.long)
        for layer in self.cache.layers:
            if not isinstance(layer, BufferLayer):
                raise RetrospecError(
                    f"tree verification needs full-attention cache layers; this model uses {type(layer).__name__}"
                )
            if layer.is_initialized:
                layer.gather_tail(start, idx.to(layer.device))

    def last_layer(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (keys, values) [batch, kv_heads, seq, head_dim], or None before the first forward."""
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        return (layers[-1].keys, layers[-1].values) if layers else None

    def last_buffers(self) -> KeyBuffer | None:
        """The last layer's whole buffers [batch, kv_heads, capacity, head_dim] holding its ``filled`` positions, for
        code that reads them in place; None before the first forward or where the last layer is not a
        ``BufferLayer``. Read-only."""
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        if not layers or type(layers[-1]) is not BufferLayer:
            return None
        return KeyBuffer(layers[-1]._k, layers[-1]._v, layers[-1].length)

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [batch, kv_heads, seq, head_dim]; read-only views for drafters/tests."""
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]

    def nbytes(self) -> int:
        """Bytes of the cached keys/values (the filled positions; a buffer's spare capacity is not counted)."""
        return sum(t.numel() * t.element_size() for kv in self.layer_tensors() for t in kv)
