"""Every change hf_bpd makes to a model's KV cache, through the Cache API and the layers' own tensors only:
the one place a reader looks for what decoding does to a cache.

- before decoding: windowed layers keep every key (`keep_every_key`); full layers grow in place
  (`grow_in_place`, `GrowingLayer`) where the forward is eager;
- after a verification: keep the accepted tree entries of one row (`compact_cache`), of every row of a
  batch (`compact_rows`), or of a preallocated static cache, in place (`compact_static_cache`);
- batches: squeeze the holes rows' different acceptances left (`squeeze_holes`, when `HoleLedger` says
  they have cost what a squeeze does), drop finished rows (`drop_rows`);
- recurrent, convolutional and linear-attention state, which a forward overwrites and cannot be cropped:
  `snapshot` before a forward, `restore` after it, `drop_last` for the attention layers' new entries;
- a compiled forward's layout: `contiguous_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

from .compat import CACHE_NAMES


def keep_every_key(model_kwargs: dict) -> None:
    """Make the cache `generate` prepared keep every key of its windowed layers: each sliding/chunked cache
    layer (which keeps only the last W - 1 entries, so a tree's rejected entries would evict keys a later
    step needs) becomes a full `DynamicLayer`; the tree masks apply the windows instead (`support.py`).
    The returned cache then holds full layers: usable as is, the models build their windows from the
    config, not from the cache. A sliding layer that also keeps recurrent state (`hybrid_sliding`) becomes
    the full layer of the same kind, keeping its number of states."""
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if isinstance(cache, DynamicCache):
            for i, layer in enumerate(cache.layers):
                if getattr(layer, "is_sliding", False):
                    states = getattr(layer, "number_of_states", None)
                    full = DynamicLayer() if states is None else LinearAttentionAndFullAttentionLayer(states)
                    cache.layers[i] = full


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are the filled front of a buffer with room to grow: a forward
    writes its entries in place after them, where `DynamicLayer` concatenates, copying the whole layer,
    in every forward. On a CPU, where decoding is bound by memory bandwidth, that copy of every layer's
    cache grows with the context, and a tree's forward pays it as a one-token one does.

    `keys` and `values` stay what transformers and `kv.py` read and set: views of the buffer's first
    positions ([B, heads, length, dim], strided over the capacity). Cropping, compacting (`compact_cache`)
    or dropping the last entries sets a shorter view of the same buffer, and the next forward writes after
    it. Anything else that sets them (a batch's reorder, `squeeze_holes`, a copy) leaves a tensor that is
    not the buffer's front; the next forward then copies it into a new buffer, as a `DynamicLayer`'s
    forward copies every time. A buffer that is full is replaced by one with a quarter more room."""

    # positions added past what a buffer must hold when one is made: at least this many, or a quarter more
    MIN_ROOM = 256

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    @classmethod
    def adopting(cls, layer: DynamicLayer) -> GrowingLayer:
        """A growing layer holding what `layer` holds (its first forward moves that into a buffer)."""
        grown = cls()
        for name in ("keys", "values", "is_initialized", "device"):
            if hasattr(layer, name):
                setattr(grown, name, getattr(layer, name))
        return grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.key_buffer = _written_after(self.keys, self.key_buffer, key_states)
        self.values, self.value_buffer = _written_after(self.values, self.value_buffer, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


def _written_after(front: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor):
    """(`front` with `new` after it along the positions, the buffer that view is of): written in `buffer`
    where `front` is its first positions and room is left, else in a new buffer that `front` is copied to."""
    length = front.shape[-2] if front.dim() == 4 else 0  # an empty layer's tensors are 1-D
    end = length + new.shape[-2]
    if not _is_front_of(front, buffer, new) or end > buffer.shape[-2]:
        capacity = end + max(end // 4, GrowingLayer.MIN_ROOM)
        buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
        if length:
            buffer[..., :length, :].copy_(front)
    buffer[..., length:end, :].copy_(new)
    return buffer[..., :end, :], buffer


def _is_front_of(front: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor) -> bool:
    if buffer is None or buffer.shape[:-2] != new.shape[:-2] or buffer.shape[-1] != new.shape[-1]:
        return False
    if buffer.dtype != new.dtype or buffer.device != new.device:
        return False
    if front.dim() != 4:  # nothing kept yet: the buffer's front is empty
        return front.numel() == 0
    return (
        front.data_ptr() == buffer.data_ptr()
        and front.shape[:-2] == buffer.shape[:-2]
        and front.stride() == buffer.stride()
    )


def grow_in_place(model_kwargs: dict) -> None:
    """Make the cache `generate` prepared grow its full-attention layers in place (`GrowingLayer`), for
    decoding on an eager forward (a compiled forward copies each layer out to its own layout instead,
    `contiguous_kv`). Layers of other kinds (windowed, recurrent, quantised) are left as they are."""
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if isinstance(cache, DynamicCache):
            grow_layers(cache)


def grow_layers(cache: DynamicCache) -> None:
    """`grow_in_place` for one cache: its layers, and those it adds on its first forward (a cache made
    without a config)."""
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = GrowingLayer.adopting(layer)


def compact_cache(cache: DynamicCache, num_tree: int, keep: torch.Tensor) -> None:
    """Drop rejected tree entries: of the last `num_tree` entries of every layer keep only the tree
    indices `keep` (ascending, root first), moved to the front of the tree slot.

    Touches only the tree slot, so its cost does not grow with the context length, and leaves each layer
    a view of its old tensor (a compiled forward gets it copied out: `verify_tree`)."""
    dropped = num_tree - keep.numel()
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:  # a layer never written (not in real decoding)
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            start = t.shape[-2] - num_tree
            # `.to`: a model split over devices (device_map) keeps each layer's cache on its own
            t[..., start : start + keep.numel(), :] = t.index_select(-2, keep.to(t.device) + start)
            setattr(layer, name, t[..., : start + keep.numel(), :])
        if hasattr(layer, "cumulative_length"):  # sliding-window layers count tokens seen
            layer.cumulative_length -= dropped


def compact_rows(cache, num_tree: int, keep: torch.Tensor) -> None:
    """Of the last `num_tree` entries of every layer keep, per row, the tree indices `keep [B, K]` (row b's
    accepted nodes first; the rest of its K slots are holes its mask hides). In place, as
    `kv.compact_cache`: only the tree slot is touched, whatever the context length."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, heads, S, dim]
            start = t.shape[-2] - num_tree
            index = (keep.to(t.device) + start)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
            t[..., start : start + keep.shape[1], :] = t.gather(2, index)
            setattr(layer, name, t[..., : start + keep.shape[1], :])
        if hasattr(layer, "cumulative_length"):  # sliding-window layers count what they hold
            layer.cumulative_length -= num_tree - keep.shape[1]


@dataclass
class HoleLedger:
    """When to squeeze a batch's holes out (`squeeze_holes`). Each step a hole costs about what a real slot
    does (attention reads it, the cache's growth copies it), and a squeeze costs about one copy of the
    whole cache. So the ledger adds up, step by step, the holes the cache holds, and squeezes once that sum
    reaches the cache's length: the holes have then cost what a squeeze does. If holes grow by g a step,
    that squeezes at about sqrt(2 g S) holes for a cache of S slots, the period that minimises the two
    costs together; a fixed share of the cache would let a long cache carry many holes for many steps,
    and charge them to the steps after the drafted ones that made them, plain steps included."""

    slot_steps: int = 0  # holes summed over the steps since the last squeeze

    def due(self, holes: int, length: int) -> bool:
        """Whether to squeeze before this step, the cache holding `holes` holes in `length` slots."""
        self.slot_steps += holes
        return holes > 0 and self.slot_steps >= length

    def squeezed(self) -> None:
        """The holes were squeezed out (for this ledger's reason or another, a window): count again."""
        self.slot_steps = 0


def squeeze_holes(cache, past_mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Gather every row's real cache slots (in order) to the right end, dropping holes down to the longest
    row (`width` real slots, when the caller knows it on the host: then no synchronisation); returns the
    new mask (left-padded form)."""
    width = int(past_mask.long().sum(-1).max()) if width is None else width
    # a stable sort of 0/1 puts each row's holes first and its real slots after them, both in slot order
    index = torch.sort(past_mask.long(), dim=-1, stable=True).indices[:, -width:]
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            rows = index.to(t.device)[:, None, :, None]
            setattr(layer, name, t.gather(2, rows.expand(-1, t.shape[1], -1, t.shape[-1])))
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = width
    return past_mask.gather(1, index)


def drop_rows(cache, past_mask: torch.Tensor, hidden_last: torch.Tensor, keep: list[int]):
    """Keep only the cache rows `keep` (in that order): the cache (through its own `reorder_cache`, which
    beam search uses, so every layer kind drops them), the past mask and the last hidden states."""
    index = torch.tensor(keep, device=past_mask.device)
    cache.reorder_cache(index)
    return past_mask.index_select(0, index), hidden_last.index_select(0, index)


def compact_static_cache(cache, past_len: int, num_tree: int, keep: torch.Tensor) -> None:
    """Keep, of the `num_tree` entries written at `past_len`, the tree indices `keep` (ascending, root
    first), copied in place to the front of the tree slot (the tensors keep their address, as captured
    graphs need); the layers' length is then put back by the dropped entries with the cache API."""
    kept = keep.numel()
    if kept < num_tree:
        target = torch.arange(past_len, past_len + kept, device=keep.device)
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t.index_copy_(-2, target.to(t.device), t.index_select(-2, keep.to(t.device) + past_len))
        cache.crop(-(num_tree - kept))


def state_tensors(cache) -> list[tuple[dict, int]]:
    """Every conv / recurrent state of the cache, as (the layer's dict, state index)."""
    found = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                found += [(states, i) for i, t in states.items() if t is not None]
    return found


def token_counts(cache) -> list[torch.Tensor]:
    """The state layers' counts of the tokens they have seen (`cumulative_length_linear`, transformers 5.25
    on), which `get_seq_length` reads on such a layer: one per layer for the whole batch."""
    return [
        layer.cumulative_length_linear
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin) and hasattr(layer, "cumulative_length_linear")
    ]


def snapshot(cache) -> list[torch.Tensor]:
    """Copies of every state (`state_tensors` order), then of every token count: what a restore puts back."""
    return [states[i].clone() for states, i in state_tensors(cache)] + [n.clone() for n in token_counts(cache)]


def restore(cache, saved: list[torch.Tensor], rows: list[int] | None = None) -> None:
    """Put the snapshot back, in place (the layers keep their tensors' addresses): all rows, or `rows`.
    The token counts go back with all rows only: where some rows keep the forward, its attention entries
    stay (as holes for the others), and the counts must keep matching them."""
    tensors = state_tensors(cache)
    for (states, i), old in zip(tensors, saved):
        if rows is None:
            states[i].copy_(old)
        else:
            index = torch.tensor(rows, device=old.device)
            states[i].index_copy_(0, index, old.index_select(0, index))
    if rows is None:
        for count, old in zip(token_counts(cache), saved[len(tensors) :]):
            count.copy_(old)


def drop_last(cache, n: int) -> None:
    """Drop the last `n` attention entries of every layer holding keys and values (the state layers' conv
    and recurrent states are restored separately)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., : layer.keys.shape[-2] - n, :]
            layer.values = layer.values[..., : layer.values.shape[-2] - n, :]


def contiguous_kv(cache) -> None:
    """Copy out every layer's keys and values that are views (a prefill's transposed projections, a
    cropped cache). A compiled forward guards on its inputs' strides: with every cache it sees laid out
    alike, one graph serves each kind of forward (one token, a tree) at every length, and none is compiled
    in the middle of a decode for a layout its warm-up never met."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and not t.is_contiguous():
                setattr(layer, name, t.contiguous())
