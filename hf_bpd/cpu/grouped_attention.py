"""Grouped-query attention without copying the cache: several query tokens with a mask, on the KV heads.

Why: with grouped-query attention (fewer key/value heads than query heads: SmolLM2, Gemma-3, Llama-3,
Qwen), transformers' `sdpa` attention runs a forward of several tokens with an attention mask by first
copying every layer's cached keys and values once per query head of their group (`repeat_kv`): a copy
of the whole cache, times the group size, in every layer of every such forward. Tree verification,
prompt lookup, assisted decoding and every batched step of a drafter are such forwards. On a CPU,
where decoding is bound by memory bandwidth, that copy grows with the context and the batch and can
cost more than the rest of the forward. One-token steps do not pay it: transformers folds the group's
query heads into the query dimension there (`pack_gqa`).

`grouped_sdpa_attention` does the same fold for any number of query tokens: the query [B, H, q, d]
becomes [B, H_kv, (H / H_kv) * q, d], the mask is repeated over the group (a mask is tiny beside the
cache), and attention runs on the cached heads as they are. Each (head, token) row attends to the same
keys with the same mask as before, so only the rounding of the kernel can differ, as it does between
any two batch shapes. Everything else (one token, no mask, a position bias, a compiled graph) goes to
transformers' own `sdpa` function unchanged.

It is registered with transformers' public `AttentionInterface` (and `AttentionMaskInterface`, with
`sdpa`'s masks) under `ATTENTION_NAME`; `grouped_attention(model)` switches a model's `sdpa` layers to it
inside a `with` block and back on exit. No modeling file is copied or changed.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils.import_utils import is_torchdynamo_compiling

ATTENTION_NAME = "hf_bpd_grouped_sdpa"
_SWITCH = threading.Lock()  # entering and leaving blocks from several threads must not interleave
_DEPTH: dict[int, int] = {}  # id(config) -> open blocks that switched it


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, with a masked forward of several query tokens folded onto the
    key/value heads instead of copying them per query head (module docstring). Same signature and
    output ([B, q, H, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, tokens, dim = query.shape
    if (
        groups == 1
        or tokens == 1  # transformers folds one token itself
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] not in (1, heads)
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or key.shape[1] * groups != heads
        or is_torchdynamo_compiling()  # compiled graphs keep the layout they were traced with
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    kv_heads, keys = key.shape[1], attention_mask.shape[-1]
    # heads are grouped kv-major (head h reads key/value head h // groups), so [B, H, q, d] is
    # [B, H_kv, groups, q, d]: rows (group member, token) of each key/value head
    folded_query = query.reshape(batch, kv_heads, groups * tokens, dim)
    rows = attention_mask.shape[0]
    if attention_mask.shape[1] == 1:
        folded_mask = attention_mask[:, :, None].expand(rows, 1, groups, tokens, keys).reshape(rows, 1, -1, keys)
    else:
        folded_mask = attention_mask.reshape(rows, kv_heads, groups * tokens, keys)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded_query, key, value, attn_mask=folded_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(out.shape[0], heads, tokens, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _switchable_configs(model: torch.nn.Module) -> list:
    """The distinct configs of `model`'s modules that select transformers' `sdpa` attention, or that an
    enclosing block already switched from it (a nested block joins them). None where the switch would not
    help (no grouped heads) or might change more than the attention function (`switch_is_transparent`)."""
    if not switch_is_transparent(model):
        return []
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation == "sdpa" or (implementation == ATTENTION_NAME and id(config) in _DEPTH):
            configs[id(config)] = config
    return list(configs.values())


def switch_is_transparent(model: torch.nn.Module) -> bool:
    """Whether switching `model` from `sdpa` changes nothing but the attention function, and helps: some
    layer has grouped heads the way transformers' attention interface sees them (`num_key_value_groups`),
    and no modeling file of its modules tests the implementation's name against "sdpa" (Falcon and a few
    others run their own code for `sdpa` and another path for any other name)."""
    if not any(getattr(module, "num_key_value_groups", 1) > 1 for module in model.modules()):
        return False
    return not any(_names_sdpa(type(module).__module__) for module in model.modules())


@functools.cache
def _names_sdpa(module_name: str) -> bool:
    source = getattr(sys.modules.get(module_name), "__file__", None)
    if source is None or not source.endswith(".py"):
        return False
    text = Path(source).read_text(encoding="utf-8", errors="replace")
    return any(test in text for test in ('== "sdpa"', '!= "sdpa"', "== 'sdpa'", "!= 'sdpa'", '"sdpa" in', '("sdpa"'))


def _set_own(config, implementation: str) -> None:
    # the setter also sets every sub-config unless told to keep its own: keep theirs (a vision tower
    # may be on `eager`)
    keep = {key: getattr(getattr(config, key, None), "_attn_implementation", None) for key in config.sub_configs}
    config._attn_implementation = {"": implementation, **keep}


@contextlib.contextmanager
def grouped_attention(model: torch.nn.Module):
    """Inside the block, `model`'s layers on transformers' `sdpa` attention run `grouped_sdpa_attention`;
    on exit they are back on `sdpa`. Layers on another attention (eager, flash) are left alone. Blocks
    nest, and the same model may be used by several threads' blocks at once."""
    with _SWITCH:
        configs = _switchable_configs(model)
        for config in configs:
            _DEPTH[id(config)] = _DEPTH.get(id(config), 0) + 1
            _set_own(config, ATTENTION_NAME)
    try:
        yield
    finally:
        with _SWITCH:
            for config in configs:
                _DEPTH[id(config)] -= 1
                if _DEPTH[id(config)] == 0:
                    del _DEPTH[id(config)]
                    _set_own(config, "sdpa")
