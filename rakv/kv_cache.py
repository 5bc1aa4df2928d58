"""A KV cache that grows in place: a forward writes its positions into spare capacity.

transformers' ``DynamicLayer`` concatenates: every forward copies the whole cache, each
layer's keys and values, to append a few positions. At 300 cached positions that was the
largest op of a SmolLM2 decode step (5.5 of 46 ms in int4), and a speculative round, which
crops and appends again, pays it twice. Here appending costs what it writes.

Invariants:
- A layer's ``keys`` and ``values`` are views [batch, kv_heads, length, dim] of the first
  ``length`` positions of a buffer [batch, kv_heads, capacity, dim]; positions past
  ``length`` are never read. ``crop`` (DynamicLayer's) shortens the views and keeps the
  buffer, so the positions a rejected draft wrote are overwritten by the next forward.
- The cached values are DynamicLayer's, bit for bit: the same tensors are copied in and
  attention reads them through the views (tests: the engine's outputs equal Hugging Face
  greedy decoding, which runs a DynamicCache).
- The capacity at least doubles when it runs out, so appending n positions one at a time
  copies O(n) positions in all; a cache holds at most twice the positions it caches.
- A ``DynamicCache`` in every other respect (``isinstance`` checks, cropping, the length).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_CAPACITY = 64  # positions a layer's first buffer holds at least


class GrowingLayer(DynamicLayer):
    """One layer's keys and values, appended in place (see the module's invariants)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [b, h, capacity, d]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append key/value states [b, h, T, d]; returns the views of all positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if self.buffers is None or needed > self.buffers[0].shape[-2] or not self._views_of_buffers(length):
            self._grow(length, needed, key_states, value_states)
        keys, values = self.buffers
        keys[:, :, length:needed] = key_states
        values[:, :, length:needed] = value_states
        self.keys, self.values = keys[:, :, :needed], values[:, :, :needed]
        return self.keys, self.values

    def reserve(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``num_new`` positions after the cached ones, for a writer outside torch
        (``rakv_attention_many``): the key and value buffers [b, h, capacity, d] and the
        length. The positions it writes become visible with ``extend``."""
        length = self.get_seq_length()
        if self.buffers is None or length + num_new > self.buffers[0].shape[-2] or not self._views_of_buffers(length):
            self._grow(length, length + num_new, self.keys, self.values)
        return self.buffers[0], self.buffers[1], length

    def extend(self, num_new: int) -> None:
        """The ``num_new`` positions written after ``reserve`` join the cached ones."""
        needed = self.get_seq_length() + num_new
        self.keys, self.values = self.buffers[0][:, :, :needed], self.buffers[1][:, :, :needed]

    def _views_of_buffers(self, length: int) -> bool:
        """Whether ``keys``/``values`` still view the buffers (nothing replaced them)."""
        return length == 0 or (self.keys.data_ptr() == self.buffers[0].data_ptr()
                               and self.values.data_ptr() == self.buffers[1].data_ptr())

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers of at least twice the capacity, holding the first ``length`` positions."""
        capacity = max(needed, MIN_CAPACITY, 2 * (self.buffers[0].shape[-2] if self.buffers is not None else 0))
        buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            batch, heads, _, dim = new.shape
            buffer = torch.empty(batch, heads, capacity, dim, dtype=new.dtype, device=new.device)
            if length:
                buffer[:, :, :length] = old
            buffers.append(buffer)
        self.buffers = (buffers[0], buffers[1])


class GrowingCache(DynamicCache):
    """A DynamicCache of ``GrowingLayer``s. ``layers``: (keys, values) per layer to start
    from, copied in (a restored prefix), or None for an empty cache."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
            return
        grown = []
        for keys, values in layers:
            layer = GrowingLayer()
            layer.update(keys, values)
            grown.append(layer)
        Cache.__init__(self, layers=grown)

    def grown_layers(self, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> list[GrowingLayer]:
        """The cache's first ``num_layers`` layers, an empty cache's made (no positions,
        buffers of [1, num_kv_heads, MIN_CAPACITY, head_dim]) as its first update makes them."""
        while len(self.layers) < num_layers:
            empty = torch.empty(1, num_kv_heads, 0, head_dim, dtype=dtype)
            self.update(empty, empty, len(self.layers))
        return self.layers[:num_layers]
