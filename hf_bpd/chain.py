"""A chain forward whose effect on the cache can be undone: what decoding a model with recurrent state
needs (`recurrent.py`), and what timing such a model's forwards needs (`cost.py`).

A recurrent, convolutional or linear-attention layer keeps a state that a forward overwrites: it cannot be
cropped like keys and values. So the states (transformers' `LinearAttentionCacheLayerMixin` cache layers)
are copied before the forward (`snapshot`) and put back after it (`restore`), and the attention layers'
new entries are dropped (`drop_last`).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .compat import last_hidden_state_request


def state_tensors(cache) -> list[tuple[dict, int]]:
    """Every conv / recurrent state of the cache, as (the layer's dict, state index)."""
    found = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                found += [(states, i) for i, t in states.items() if t is not None]
    return found


def snapshot(cache) -> list[torch.Tensor]:
    """Copies of every state (`state_tensors` order): what a restore puts back."""
    return [states[i].clone() for states, i in state_tensors(cache)]


def restore(cache, saved: list[torch.Tensor], rows: list[int] | None = None) -> None:
    """Put the snapshot back, in place (the layers keep their tensors' addresses): all rows, or `rows`."""
    for (states, i), old in zip(state_tensors(cache), saved):
        if rows is None:
            states[i].copy_(old)
        else:
            index = torch.tensor(rows, device=old.device)
            states[i].index_copy_(0, index, old.index_select(0, index))


def drop_last(cache, n: int) -> None:
    """Drop the last `n` attention entries of every layer holding keys and values (the state layers' conv
    and recurrent states are restored separately)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., : layer.keys.shape[-2] - n, :]
            layer.values = layer.values[..., : layer.values.shape[-2] - n, :]


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
