"""Decoding on a static cache (`generate(..., cache_implementation="static")` or a `StaticCache` passed in).

On a GPU plain `generate`'s fastest decoding is a static cache, whose forwards transformers compiles and
replays as CUDA graphs: every tensor keeps its shape and address from step to step. hf_bpd verifies its
trees on such a cache the same way:

- the cache is preallocated to `capacity` positions; a tree of N nodes is written at the next N
  positions, and the tree mask spans all `capacity` key columns (those past the tree masked), so the
  mask's shape does not change with the context;
- after acceptance the kept nodes' keys and values are copied, in place, to the front of the tree slot
  and the layers' length is put back with the cache API (`crop(-dropped)`): stale entries past it are
  masked until a later forward overwrites them;
- where `generate` itself would compile (transformers' own test: a compileable cache on a GPU, or a
  `compile_config` that asks for every device), the tree forward runs through the model's compiled call
  (`get_compiled_call`, the one `generate` uses) and trees are padded to a few sizes (`GRAPH_TREE_SIZES`),
  so each size is one captured graph (`tree.batch_trees(pad_to=...)`). Pad nodes attend to the context
  and themselves only: no real node sees them, and they are dropped with the rejected ones.

One row, full attention: a static cache with sliding-window layers, a batch or a recurrent state is
refused up front (`check_static_supported`).

Greedy calls can instead run each whole step (heads, tree, forward, accept, compaction) as one captured
device function: `captured.py` (`generate(..., captured_step=True)`)."""

from __future__ import annotations

from bisect import bisect_left

import torch
from transformers.cache_utils import StaticLayer

# tree sizes a compiled static forward is padded to: one captured graph each
GRAPH_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def is_static(cache) -> bool:
    """Whether `cache` is a preallocated cache of full-attention static layers."""
    layers = getattr(cache, "layers", None)  # a StaticCache of a windowed model holds sliding layers: not this
    return bool(layers) and all(type(x) is StaticLayer for x in layers)


def static_capacity(cache) -> int | None:
    """Positions a static cache holds (None for any other cache)."""
    if not is_static(cache):
        return None
    return min(layer.max_cache_len for layer in cache.layers)


def check_static_supported(
    model, input_ids: torch.Tensor, cache, windows, recurrent: bool, max_length: int | None = None
) -> None:
    """Refuse, naming the reason, a static-cache call this module would not decode exactly, or one whose
    cache cannot hold the `max_length` tokens asked for (all but the last are cached)."""
    if not is_static(cache):
        layers = sorted({type(x).__name__ for x in getattr(cache, "layers", [])})
        raise ValueError(
            f"hf_bpd.generate serves a static cache of full-attention layers (StaticLayer), got {layers}: "
            "use the default cache (cache_implementation='dynamic') for this model"
        )
    if input_ids.shape[0] > 1:
        raise ValueError(
            f"hf_bpd.generate serves a static cache for one row, got a batch of {input_ids.shape[0]}: "
            "use the default cache for batches"
        )
    if windows is not None or recurrent:
        raise ValueError(
            f"hf_bpd.generate serves a static cache for full-attention models only; {type(model).__name__} has "
            "attention windows or a recurrent state: use the default cache"
        )
    capacity = static_capacity(cache)
    if max_length is not None and capacity < max_length - 1:
        raise ValueError(
            f"a static cache of {capacity} positions cannot hold a prompt of {input_ids.shape[1]} tokens and "
            f"{max_length - input_ids.shape[1]} new ones: give it max_cache_len >= {max_length - 1}"
        )


def compiled_static_call(model, generation_config, model_kwargs: dict):
    """The compiled forward `generate` would decode with on this call (`get_compiled_call`), or None
    where it would not compile: the tree forwards then follow plain decoding's choice."""
    criteria = getattr(model, "_valid_auto_compile_criteria", None)  # generate's own test (transformers 5)
    if criteria is None or not criteria(model_kwargs, generation_config):
        return None
    return model.get_compiled_call(generation_config.compile_config)


def graph_tree_size(n: int, room: int) -> int:
    """The padded size of a tree of `n` nodes for a compiled static forward: the smallest of
    `GRAPH_TREE_SIZES` that holds it, within the `room` left in the cache."""
    i = bisect_left(GRAPH_TREE_SIZES, n)
    size = GRAPH_TREE_SIZES[i] if i < len(GRAPH_TREE_SIZES) else n
    return max(n, min(size, room))


def pad_mask_columns(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """An additive tree mask [B, 1, N, P + N] widened to the static cache's `capacity` key columns, the new
    ones masked (the cache's slots past the tree: empty or stale)."""
    missing = capacity - mask.shape[-1]
    if missing < 0:
        raise ValueError(f"a tree forward over {mask.shape[-1]} positions does not fit a static cache of {capacity}")
    if missing == 0:
        return mask
    fill = mask.new_full((*mask.shape[:-1], missing), torch.finfo(mask.dtype).min)
    return torch.cat([mask, fill], dim=-1)
