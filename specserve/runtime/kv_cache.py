"""A KV cache addressed by absolute position, usable by any Hugging Face causal LM.

Buffers grow by need (doubling, from `MIN_ALLOCATION` positions) up to the session's capacity, so a
short session holds little memory whatever context it may use. A forward writes its tokens' K/V at
[length, length + n); committing an accepted tree path copies those few slots down into contiguous
positions and moves `length`; rejected slots are simply overwritten next round (as in gpt-fast), so
there is no rollback machinery and no per-step copy of the whole cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specserve.errors import ResourceExhausted

MIN_ALLOCATION = 256  # positions allocated at first use; growth doubles from there


class PositionalLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = True
    # None in the base class until the first update; `lazy_initialization` sets them before any read.
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity  # most positions this layer may ever hold
        self.allocated = 0  # positions its buffers hold now
        self.length = 0
        # float64 copies of (keys, values) for exact attention (update_exact), valid up to exact_length
        self.exact: tuple[torch.Tensor, torch.Tensor] | None = None
        self.exact_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[3]))  # [B, H_kv, 0, D]
        self.values = value_states.new_zeros(self.keys.shape)
        self.is_initialized = True

    def _grow(self, end: int) -> None:
        """Reallocates to hold `end` positions (doubling, capped at capacity), keeping what is written."""
        size = min(self.capacity, max(end, 2 * self.allocated, MIN_ALLOCATION))
        batch, heads, _, head_dim = self.keys.shape
        keys = self.keys.new_zeros((batch, heads, size, head_dim))  # [B, H_kv, size, D]
        values = self.values.new_zeros(keys.shape)
        keys[:, :, : self.allocated] = self.keys
        values[:, :, : self.allocated] = self.values
        self.keys, self.values, self.allocated = keys, values, size

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states: [B, H_kv, n, D] -> all keys so far [B, H_kv, length + n, D] (and values)."""
        self.reserve(key_states.shape[-2], key_states)
        end = self.length + key_states.shape[-2]
        # narrow and copy_: what the slice assignments do, in fewer ops (this runs per layer per forward)
        self.keys.narrow(2, self.length, end - self.length).copy_(key_states)
        self.values.narrow(2, self.length, end - self.length).copy_(value_states)
        self.length = end
        return self.keys.narrow(2, 0, end), self.values.narrow(2, 0, end)

    def reserve(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for n positions at [length, length + n): the whole buffers [B, H_kv, allocated, D] each,
        keys and values alike. `like` [B, H_kv, n, D] names their shape, dtype and device at first use.
        The writer (`update`, or the compiled layers of runtime/fused_layers.py) moves `length` after."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        end = self.length + n
        if end > self.capacity:
            raise ResourceExhausted(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        if end > self.allocated:
            self._grow(end)
        return self.keys, self.values

    def update_exact(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update`, returning the keys and values in float64 from a copy kept beside the cache, so that
        attention in float64 converts only the new positions, not the whole cache, every forward.
        key_states: [B, H_kv, n, D] -> [B, H_kv, length + n, D] float64 each."""
        start = self.length
        self.update(key_states, value_states)
        end = self.length
        shadow = self.exact
        if shadow is not None and shadow[0].shape[2] == self.allocated and self.exact_length >= start:
            # The step's path (the copy is current up to here): only the new positions converted.
            # Narrow, not indexing: fewer ops per layer.
            n = end - start
            shadow[0].narrow(2, start, n).copy_(self.keys.narrow(2, start, n))
            shadow[1].narrow(2, start, n).copy_(self.values.narrow(2, start, n))
            self.exact_length = end
            return shadow[0].narrow(2, 0, end), shadow[1].narrow(2, 0, end)
        if shadow is None or shadow[0].shape[2] != self.allocated:
            keys = self.keys.new_zeros(self.keys.shape, dtype=torch.float64)  # [B, H_kv, allocated, D]
            values = torch.zeros_like(keys)
            if shadow is not None:
                kept = min(self.exact_length, shadow[0].shape[2])
                keys[:, :, :kept] = shadow[0][:, :, :kept]
                values[:, :, :kept] = shadow[1][:, :, :kept]
            shadow = self.exact = (keys, values)
        exact_keys, exact_values = shadow
        # Positions written by a plain `update` since (none on the paths that use this): converted now.
        fresh = min(self.exact_length, start)
        exact_keys[:, :, fresh:end] = self.keys[:, :, fresh:end]
        exact_values[:, :, fresh:end] = self.values[:, :, fresh:end]
        self.exact_length = end
        return exact_keys[:, :, :end], exact_values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length + tokens_to_remove) if tokens_to_remove < 0 else tokens_to_remove
        self.exact_length = min(self.exact_length, self.length)

    def reset(self) -> None:
        self.length = self.exact_length = 0


class FeatureBuffer:
    """Per position, the input of a hidden-state draft (specserve/eagle): the model's final hidden state
    after its last norm (what its LM head reads), or, with `layers`, those decoder layers' outputs side
    by side ([k * H], a fused draft's). Positions follow the cache's: written by the forward that writes
    their K/V, kept or dropped with them by `commit_path` and `truncate`."""

    def __init__(self, capacity: int, layers: Sequence[int] = ()) -> None:
        self.capacity = capacity
        self.layers = tuple(layers)
        self.allocated = 0
        self.length = 0
        self.states = torch.empty(0)  # [1, allocated, H] once written

    def update(self, states: torch.Tensor) -> None:
        """states: [n, H] for positions [length, length + n)."""
        end = self.length + states.shape[0]
        if end > self.capacity:
            raise ResourceExhausted(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        if end > self.allocated:
            size = min(self.capacity, max(end, 2 * self.allocated, MIN_ALLOCATION))
            grown = states.new_zeros((1, size, states.shape[-1]))  # [1, size, H]
            if self.allocated:
                grown[:, : self.allocated] = self.states
            self.states, self.allocated = grown, size
        self.states[0, self.length : end] = states
        self.length = end

    def committed(self) -> torch.Tensor:
        """[1, length, H], a view."""
        return self.states[:, : self.length]


class PositionalKVCache(Cache):
    def __init__(self, num_layers: int, capacity: int) -> None:
        # The same layers as the base class's `layers`, typed as what they are.
        self.positional_layers = tuple(PositionalLayer(capacity) for _ in range(num_layers))
        super().__init__(layers=list(self.positional_layers))
        self.capacity = capacity
        # The final hidden states of every position, kept only for a session whose draft reads them.
        self.features: FeatureBuffer | None = None

    def keep_features(self, layers: Sequence[int] = ()) -> None:
        """From now on forwards also store each position's final hidden state, or with `layers` those
        decoder layers' outputs side by side (before any is written: a buffer started late would lack
        the positions before it)."""
        if self.features is None:
            if self.length:
                raise ValueError("keep_features must be asked for before the first forward")
            self.features = FeatureBuffer(self.capacity, layers)
        elif self.features.layers != tuple(layers):
            raise ValueError(
                f"this cache keeps the features of layers {list(self.features.layers)}, not {list(layers)}"
            )

    def hidden_states(self) -> torch.Tensor:
        """[1, length, F] the features of the committed positions (a view); needs keep_features."""
        if self.features is None:
            raise ValueError("this cache keeps no hidden states (keep_features)")
        return self.features.states[:, : min(self.length, self.features.length)]

    @property
    def allocated(self) -> int:
        """Positions the buffers hold now (what the session costs in memory)."""
        return self.positional_layers[0].allocated

    def ensure_capacity(self, end: int) -> None:
        """Raises before a forward that would need more than `capacity` positions."""
        if end > self.capacity:
            raise ResourceExhausted(f"KV cache full: {end} positions needed, capacity {self.capacity}")

    @property
    def length(self) -> int:
        """Positions holding committed KV (between forwards every layer agrees)."""
        return self.positional_layers[0].length

    def truncate(self, length: int) -> None:
        for layer in self.positional_layers:
            layer.length = length
            layer.exact_length = min(layer.exact_length, length)
        if self.features is not None:
            self.features.length = min(length, self.features.length)

    @torch.inference_mode()  # the buffers were created inside the model's inference-mode forward
    def commit_path(self, start: int, node_indices: Sequence[int]) -> None:
        """Keeps the KV of tree nodes `node_indices` (written at start + index) as positions start, start+1...

        Everything after the kept path is dropped.
        """
        if list(node_indices) != list(range(len(node_indices))):  # a chain prefix needs no copy
            device = self.positional_layers[0].keys.device
            src = torch.tensor([start + i for i in node_indices], device=device)
            for layer in self.positional_layers:
                dst = slice(start, start + len(node_indices))
                layer.keys[:, :, dst] = layer.keys.index_select(2, src)
                layer.values[:, :, dst] = layer.values.index_select(2, src)
                if layer.exact is not None and layer.exact_length > start:
                    for shadow in layer.exact:
                        shadow[:, :, dst] = shadow.index_select(2, src)
            if self.features is not None:
                states = self.features.states
                states[:, start : start + len(node_indices)] = states.index_select(1, src)
        self.truncate(start + len(node_indices))

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed K/V of one layer: ([B, H_kv, length, D], same); views, no copy."""
        layer = self.positional_layers[layer_idx]
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]
