"""KV-cache layers that write in place: Hugging Face's dynamic layers without the per-step ``torch.cat``.

``transformers``' ``DynamicLayer`` concatenates the whole cache with the new states at every forward,
so one decoding step copies every cached key and value of every layer (on the embedded Gemma with a
600-token prompt: ~6 ms of a ~100 ms step). These layers keep the states in a buffer of spare capacity
(doubled when full) and expose views of its filled part: an update writes only the new positions, a
rollback (``crop``) only moves the length. Sliding-window layers keep every state (a rollback may need
the ones that left the window) and show attention the last ``window - 1 + new`` of them, as
``DynamicSlidingWindowLayer`` does with past recording on. Shapes: (batch, kv_heads, positions, head_dim).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

_MIN_CAPACITY = 256  # positions allocated at first use, beyond what the first update needs


class KVBuffer:
    """Keys and values with spare capacity along the position axis."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write ``keys``/``values`` (b, h, n, d) after the filled part; returns the new length."""
        end = self.length + keys.shape[-2]
        if self.keys is None or end > self.keys.shape[-2]:
            capacity = max(end + _MIN_CAPACITY, 2 * (0 if self.keys is None else self.keys.shape[-2]))
            self.keys = self._grow(self.keys, keys, capacity)
            self.values = self._grow(self.values, values, capacity)
        self.keys[..., self.length:end, :] = keys
        self.values[..., self.length:end, :] = values
        self.length = end
        return end

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        new = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
        if old is not None:
            new[..., : self.length, :] = old[..., : self.length, :]
        return new

    def view(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[..., start : self.length, :], self.values[..., start : self.length, :]

    def drop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} of {self.length} cached positions")
        self.length -= n


class _InPlace:
    """The in-place part shared by both layers: states in a :class:`KVBuffer`; ``_show(new)`` sets the
    views attention reads after ``new`` positions were appended (0 after a rollback)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffer = KVBuffer()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.buffer.append(key_states, value_states)
        self._show(key_states.shape[-2])
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a count <= 0, as ``DynamicCache.crop(-n)`` passes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got {tokens_to_remove}")
        if self.is_initialized:
            self.buffer.drop(-tokens_to_remove)
            self._show(0)


class InPlaceLayer(_InPlace, DynamicLayer):
    """A full-attention layer: ``DynamicLayer``'s interface, states in a :class:`KVBuffer`."""

    def _show(self, new: int) -> None:
        self.keys, self.values = self.buffer.view()

    def get_seq_length(self) -> int:
        return self.buffer.length if self.is_initialized else 0


class InPlaceSlidingWindowLayer(_InPlace, DynamicSlidingWindowLayer):
    """A sliding-window layer: keeps every state, attention sees the last ``window - 1 + new`` of them."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window, **kwargs)
        self.record_past = True  # rollback always works: nothing is ever discarded

    def _show(self, new: int) -> None:
        self.cumulative_length = self.buffer.length
        visible = self.sliding_window - 1 + new  # what get_mask_sizes announced
        self.keys, self.values = self.buffer.view(max(0, self.buffer.length - visible))


def use_in_place_layers(cache) -> None:
    """Swap a fresh ``DynamicCache``'s layers (built from a config, or replicated lazily) for the
    in-place ones above; other layer types (e.g. linear attention) are kept as they are."""
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = InPlaceLayer
    layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        if getattr(layer, "is_initialized", False):
            raise ValueError("use_in_place_layers needs an empty cache")
        if type(layer) is DynamicSlidingWindowLayer:
            layers[i] = InPlaceSlidingWindowLayer(sliding_window=layer.sliding_window)
        elif type(layer) is DynamicLayer:
            layers[i] = InPlaceLayer()


def filled_states(cache) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Views of every layer's filled keys and values (b, kv_heads, positions, head_dim), after a prefill into
    a cache of in-place layers (:func:`use_in_place_layers`). A cache without layers, or a layer of another
    type or one the prefill never filled (a layer sharing another's states), is a ``ValueError``."""
    if not cache.layers:
        raise ValueError("the cache has no layers")
    states = []
    for i, layer in enumerate(cache.layers):
        buffer = getattr(layer, "buffer", None) if getattr(layer, "is_initialized", False) else None
        if buffer is None:
            raise ValueError(f"cache layer {i} ({type(layer).__name__}) was not filled with keys and values")
        states.append(buffer.view())
    return tuple(states)


def fill_from(cache, states: tuple[tuple[torch.Tensor, torch.Tensor], ...], n: int) -> None:
    """Fill an empty ``cache`` of in-place layers with the first ``n`` (>= 1) positions of ``states`` (as
    :func:`filled_states` returns them), through ``update``, the call a prefill makes: sliding-window
    layers end in the state a prefill of those positions leaves."""
    held = min(keys.shape[-2] for keys, _ in states) if states else 0
    if not 0 < n <= held:
        raise ValueError(f"cannot fill {n} positions from states of {held}")
    if cache.get_seq_length() != 0:
        raise ValueError("fill_from needs an empty cache")
    for i, (keys, values) in enumerate(states):
        cache.update(keys[..., :n, :], values[..., :n, :], i)
