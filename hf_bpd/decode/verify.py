"""The verify phase: ONE base-model forward over every node of a batch of draft trees, on the existing KV cache.

Tree attention is the model's own attention given a 4D mask and position ids (no modeling file is touched):
each node sees the real cached positions and its own ancestors in the tree, nothing else, and sits at the
next position plus its depth. So every node's logits are those the model would give at that node if its
path had been decoded token by token, and one forward checks every drafted path at once.

The forward-cost timer (`cost.ForwardTimer`) makes this very call too, so a compiled forward meets in its
timing the graphs decoding runs.

A model with recurrent state verifies a chain instead (`verify_chain`: a causal forward prepared as plain
`generate` prepares a step), whose effect on the state `kv.snapshot`/`kv.restore` undo.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache

from ..compat import cache_argument, compiled_forward, last_hidden_state_request
from ..drafting.tree import TreeBatch
from ..kv import contiguous_kv
from .static_cache import pad_mask_columns
from .support import AttentionWindows


def tree_attention_mask(
    tree: TreeBatch, past_mask: torch.Tensor, dtype: torch.dtype, windows: AttentionWindows | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive float mask [B, 1, N, P+N]: 0 where attention is allowed, dtype-min elsewhere. Additive
    float works with both eager and sdpa attention.

    With attention `windows` that can cut a key off at these positions, the mask of each windowed layer
    type is narrowed to its window by position (a key at k is seen from q when q - W < k for sliding
    layers, k // C == q // C for chunked ones; cached keys count real slots only, tree keys are at the
    next position + depth): one mask where every attention layer has that window, else a dict
    {layer type: mask} with the plain mask for full layers."""
    b, n = tree.input_ids.shape
    allowed = torch.cat([past_mask.bool()[:, None, :].expand(b, n, -1), tree.tree_mask], dim=-1)
    if windows is None or not windows.binding(past_mask.shape[1] + n - 1):
        return _additive(allowed, dtype)
    real = past_mask.long()
    query = real.sum(-1, keepdim=True) + tree.depths  # [B, N] positions of the nodes
    key = torch.cat([real.cumsum(-1) - 1, query], dim=-1)[:, None, :]  # [B, 1, P+N] (holes: unused)
    query = query[:, :, None]
    masks = {}
    for layer_type, (kind, size) in windows.layers.items():
        inside = key > query - size if kind == "sliding" else key // size == query // size
        masks[layer_type] = _additive(allowed & inside, dtype)
    if not windows.per_type:  # every attention layer has this one window (Mistral)
        (mask,) = masks.values()
        return mask
    masks["full_attention"] = _additive(allowed, dtype)
    return masks


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def verify_tree(
    model,
    tree: TreeBatch,
    cache: DynamicCache,
    past_mask: torch.Tensor,
    windows: AttentionWindows | None = None,
    forward=None,
    capacity: int | None = None,
):
    """One base-model forward over all tree nodes. `past_mask` [B, P] is 1 for real cached positions.
    Appends N entries to every cache layer. `windows`: the model's attention windows (`support.py`).
    `forward`: the call that runs the model (default: the model itself; on a static cache, the compiled
    call `generate` would use, `static_cache.compiled_static_call`). `capacity`: a static cache's positions
    (`static_cache.static_capacity`): the mask then spans all its key columns (`static_cache.pad_mask_columns`).
    Returns the model output (logits and hidden states of every node)."""
    positions = past_mask.long().sum(-1, keepdim=True) + tree.depths
    dtype = next(model.parameters()).dtype
    if compiled_forward(model) and capacity is None:  # it guards on the cache's strides (`contiguous_kv`)
        contiguous_kv(cache)
    mask = tree_attention_mask(tree, past_mask, dtype, windows)
    if capacity is not None:
        mask = pad_mask_columns(mask, capacity)
    try:
        return (forward or model)(
            input_ids=tree.input_ids,
            attention_mask=mask,
            position_ids=positions,
            **{cache_argument(model): cache},
            use_cache=True,
            output_hidden_states=last_hidden_state_request(model),
            return_dict=True,
        )
    except Exception as err:  # name the cause: a model that rejects custom masks or position ids
        raise RuntimeError(
            f"{type(model).__name__} failed on the tree-attention forward (4D mask + position_ids): {err}"
        ) from err


def verify_chain(model, ids: torch.Tensor, cache, past_mask: torch.Tensor):
    """One causal forward of `ids [B, W]` after the cache, prepared as plain `generate` prepares a step
    (the model's `prepare_inputs_for_generation`: a 2D mask, position ids where the model takes them),
    with every position's logits and the last hidden states. `past_mask [B, S]`: 1 for real cache slots."""
    width = ids.shape[1]
    mask = torch.cat([past_mask, past_mask.new_ones(ids.shape[0], width)], dim=-1)
    extra = {}
    if "position_ids" in _forward_parameters(model):
        extra["position_ids"] = past_mask.long().sum(-1, keepdim=True) + torch.arange(width, device=ids.device)
    inputs = model.prepare_inputs_for_generation(
        ids, next_sequence_length=width, cache=cache, attention_mask=mask, use_cache=True, **extra
    )
    if "logits_to_keep" in inputs:  # some prepare only the last position's logits (Bamba): every one is needed
        inputs["logits_to_keep"] = 0
    inputs["output_hidden_states"] = last_hidden_state_request(model)
    return model(**inputs, return_dict=True)


def _forward_parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)
