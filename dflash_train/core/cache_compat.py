"""The one place that reaches into transformers' cache layers (`transformers.cache_utils`).

The draft-verify loop on a hybrid target (Qwen3.5/3.6: gated-delta-net linear attention beside full
attention) must rewind the cache to the committed tokens. Attention layers are cropped; a linear-attention
layer keeps one state and no history, so its state is saved before a verify pass and put back after it.
transformers has no public rewind for such layers that works across our supported releases (5.25 added
`activate_past_recording(recurrent_states_to_keep=...)` + `crop`, which makes every verify pass record
per-token states), so this module snapshots exactly what a linear-attention layer holds, by name:

- its conv and recurrent states (`conv_states`, `recurrent_states`: dicts of tensors, every release);
- its own token count (`cumulative_length_linear`, from 5.25 on: `Cache.get_seq_length()` reads it when the
  first layer is a linear one, and the model derives positions from it).

It also gives the batched references' decoder attention layers that append into spare room (`spare_room`):
`DynamicLayer.update` concatenates a new tensor every step, which copies the whole cache per token (at 28
rows x 8 layers it was a third of plain decoding's time on the 2-core VM, bench/cold_cost.py).

What a release renames or adds here fails `tests/unit/core/test_cache_compat.py` on that release, which
`make test-newest` runs; setup.cfg bounds transformers to the releases it passed on (docs/compatibility.md).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

# what a linear-attention layer holds per state index, and the counters it keeps beside them
STATE_DICTS = ("conv_states", "recurrent_states")
COUNTERS = ("cumulative_length_linear",)


def recurrent_layers(cache: Any) -> list[Any]:
    """The layers of `cache` that keep a recurrent state (and so cannot be cropped)."""
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def attention_layers(cache: Any) -> list[Any]:
    """The layers of `cache` that keep every position (the attention part of a combined layer included)."""
    return [layer for layer in cache.layers if isinstance(layer, DynamicLayer)]


def rewindable(cache: Any) -> bool:
    """False when a sliding-window layer has already dropped old positions: cropping it would lose context."""
    return not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)


def attention_length(layer: Any) -> int:
    """Positions held by an attention layer (its attention part, for a combined layer)."""
    return int(DynamicLayer.get_seq_length(layer))


def crop_attention(layer: Any, keep: int) -> None:
    """Drop an attention layer's positions from `keep` on (only the attention part of a combined layer:
    a combined layer's own `crop` also rewinds its linear counter from 5.25 on, which `restore` owns)."""
    extra = attention_length(layer) - keep
    if extra > 0:
        DynamicLayer.crop(layer, -extra)


def seq_length(cache: Any) -> int:
    """Positions the cache holds, read from an attention layer where there is one (5.25's
    `Cache.get_seq_length()` returns the first layer's count, a 0-d tensor when that layer is linear)."""
    attention = attention_layers(cache)
    if attention:
        return attention_length(attention[0])
    return int(cache.get_seq_length())


Snapshot = list[tuple[Any, dict[str, Any]]]


def snapshot(layers: list[Any]) -> Snapshot:
    """Copies of everything the recurrent `layers` hold that a forward pass changes."""
    saved: Snapshot = []
    for layer in layers:
        held: dict[str, Any] = {name: {i: t.clone() for i, t in getattr(layer, name).items() if t is not None}
                                for name in STATE_DICTS}
        for name in COUNTERS:
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                held[name] = value.clone()
        saved.append((layer, held))
    return saved


def restore(saved: Snapshot) -> None:
    """Put the layers of a `snapshot` back as they were, in place (the tensors may be static addresses)."""
    for layer, held in saved:
        for name in STATE_DICTS:
            states = getattr(layer, name)
            for i, t in held[name].items():
                states[i].copy_(t)
        for name in COUNTERS:
            if name in held:
                getattr(layer, name).copy_(held[name])


class SpareLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of larger buffers: a step writes its positions into the spare
    room after them (the buffers grow by half when full) instead of concatenating new tensors. Whatever replaces
    the views (`crop` keeps them a prefix; `select_slots`, `batch_select_indices` make new tensors) is copied
    into new buffers on the next update, so every operation of the base class stays valid."""

    GROW = 1.5
    MIN_ROOM = 64

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # set by the initialization
        held = keys.shape[-2] if keys.numel() else 0
        n = held + key_states.shape[-2]
        room: tuple[torch.Tensor, torch.Tensor] | None = getattr(self, "_room", None)
        if room is None or not _fits(room, keys, values, held, n, key_states):
            size = max(n, int(held * self.GROW)) + self.MIN_ROOM
            shape = (*key_states.shape[:2], size, key_states.shape[3])
            room = (key_states.new_empty(shape), value_states.new_empty(shape))
            if held:
                room[0][..., :held, :] = keys
                room[1][..., :held, :] = values
            self._room = room
        room[0][..., held:n, :] = key_states
        room[1][..., held:n, :] = value_states
        self.keys, self.values = room[0][..., :n, :], room[1][..., :n, :]
        return self.keys, self.values


def _fits(room: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor, held: int, n: int,
          new: torch.Tensor) -> bool:
    """The room takes `n` positions of `new`'s rows and heads, and the layer's keys/values are still its prefix."""
    return n <= room[0].shape[-2] and room[0].shape[:2] == new.shape[:2] and (
        not held or (_prefix(keys, room[0]) and _prefix(values, room[1])))


def _prefix(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """`view` is `buffer[..., :k, :]` for some k (what `SpareLayer.update` and `DynamicLayer.crop` leave)."""
    return view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride() \
        and view.shape[:2] == buffer.shape[:2]


def spare_room(cache: Any) -> Any:
    """`cache` with its plain attention layers appending in place (`SpareLayer`); other layers as they are."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = SpareLayer
    return cache


def select_slots(cache: Any, rows: torch.Tensor, index: torch.Tensor) -> None:
    """Keep batch rows `rows` of an attention-only cache and, per kept row, the slots `index[row]` names (`[n, T']`),
    in that order: the batched references' decoder packs a row's live slots and drops finished rows this way."""
    if recurrent_layers(cache):
        raise ValueError("a recurrent layer's state cannot be re-sliced by slot")
    for layer in attention_layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        keys, values = layer.keys[rows], layer.values[rows]
        gather = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        layer.keys, layer.values = keys.gather(2, gather), values.gather(2, gather)
