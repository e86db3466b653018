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

What a release renames or adds here fails `tests/unit/core/test_cache_compat.py` on that release, which
`make test-newest` runs; setup.cfg bounds transformers to the releases it passed on (docs/compatibility.md).
"""

from __future__ import annotations

from typing import Any

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
