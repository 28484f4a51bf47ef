"""Which models, inputs and `generate` options the tree-attention loop serves, decided before any forward.

Tree verification runs every drafted node in ONE forward: siblings share a position, each node attends
to the cache and its own ancestors (a 4D mask), and rejected nodes are dropped from the KV cache
afterwards. That is exact for attention layers that honour the mask and keep per-token keys and values.
It is not for:

- recurrent, convolutional or linear-attention state (Mamba, Jamba, Qwen3-Next, LFM2, Falcon-H1, ...):
  the forward would advance the state through siblings and rejected drafts as if they were one sequence;
- position biases built from a 2D mask (ALiBi: Falcon-alibi, Bloom, MPT): the model cannot take ours;
- attention windows (sliding, chunked, GPT-Neo's local layers): once context plus tree reach the window,
  the model drops or masks keys by *index*, not by a node's depth. Below the window they attend exactly
  like full attention, so a generation that stays below it is served and one that could reach it is
  refused up front (rather than halfway through);
- inputs other than token ids and their mask (`inputs_embeds`, images, `token_type_ids`, a filled cache):
  the loop would have to extend them to every tree node.

Every refusal names its reason and is raised before the prefill, so it costs no forward.
"""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache

from .compat import CACHE_NAMES, cache_argument

SUPPORTED_ATTENTION = ("sdpa", "eager")
# cache layer types that hold one key/value entry per token (what compaction and the tree mask assume);
# "dummy" layers hold nothing (KV sharing, attention-free MoE/MLP layers)
KV_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "dummy"}
WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}
# model kwargs `generate` itself prepares for a plain text prompt: the loop handles each of them
PREPARED_MODEL_KWARGS = {
    "attention_mask",
    "position_ids",
    "logits_to_keep",
    "use_cache",
    "cache_position",
    *CACHE_NAMES,
}
REFUSED_MODEL_TYPES = {
    "gemma3n": "AltUp keeps several hidden-state streams per token, which draft heads cannot read",
    "gemma3n_text": "AltUp keeps several hidden-state streams per token, which draft heads cannot read",
}


def layer_types(config) -> list[str]:
    """The cache layer type of every decoder layer, as transformers' `DynamicCache` derives them."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers 5: `layer_types`, else one sliding or full type for all layers
        found = getattr(config, "layer_types", None)
        if found is None:
            kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
            found = [kind] * getattr(config, "num_hidden_layers", 1)
        return ["dummy" if t in ("moe", "mlp") else t for t in found]
    return list(get_layer_types_and_kwargs(config)[0])


def attention_window(config) -> int | None:
    """The shortest attention window of any layer (sliding, chunked, or GPT-Neo's local layers), or None."""
    windows = []
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        for kind, kwargs in zip(*get_layer_types_and_kwargs(config)):
            if kind in WINDOWED_LAYER_TYPES:
                windows.append(int(kwargs["sliding_window"]))
    except ImportError:
        if "sliding_attention" in layer_types(config) and getattr(config, "sliding_window", None):
            windows.append(int(config.sliding_window))
        if "chunked_attention" in layer_types(config) and getattr(config, "attention_chunk_size", None):
            windows.append(int(config.attention_chunk_size))
    # GPT-Neo builds its local window into the attention module, not into the cache's layer types
    if "local" in (getattr(config, "attention_layers", None) or []):
        windows.append(int(config.window_size))
    return min(windows, default=None)


def check_model_supported(model) -> None:
    """Refuse, naming the reason, a model the tree-attention loop cannot decode exactly."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("hf_bpd.generate supports decoder-only causal LMs, not encoder-decoder models")
    text_config = config.get_text_config(decoder=True)
    for model_type in {config.model_type, text_config.model_type}:
        if model_type in REFUSED_MODEL_TYPES:
            raise ValueError(f"hf_bpd.generate does not support {model_type}: {REFUSED_MODEL_TYPES[model_type]}")
    stateful = [t for t in layer_types(text_config) if t not in KV_LAYER_TYPES]
    if getattr(model, "_is_stateful", False) or stateful:
        what = f"layers of type {sorted(set(stateful))}" if stateful else "a recurrent state"
        raise ValueError(
            f"{type(model).__name__} keeps {what} (recurrent, convolutional or linear attention): a tree forward "
            "would advance it through sibling and rejected drafts, so hf_bpd.generate cannot verify trees exactly "
            "on it; use plain generate"
        )
    if getattr(text_config, "alibi", False):
        raise ValueError(
            f"{type(model).__name__} uses ALiBi position biases, which it builds from a 2D attention mask: it "
            "cannot take the 4D tree-attention mask"
        )
    params = inspect.signature(model.forward).parameters
    missing = [f"`{name}`" for name in ("attention_mask", "position_ids") if name not in params]
    if cache_argument(model) is None:
        missing.append(" or ".join(f"`{name}`" for name in CACHE_NAMES))
    if missing:
        raise ValueError(
            f"{type(model).__name__}.forward has no {', '.join(missing)} argument: tree verification needs a model "
            "that accepts a 4D attention mask, position_ids and a KV cache"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation `{impl}` cannot take the custom 4D tree-attention mask; load the model "
            f"with attn_implementation in {SUPPORTED_ATTENTION}"
        )


def check_call_supported(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict
) -> int | None:
    """Refuse, naming the reason, inputs and options of this `generate` call that the loop would not
    honour. Returns the model's attention window (None: none), which caps every tree below it."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("hf_bpd.generate drafts from token ids: pass input_ids, not inputs_embeds")
    if input_ids.shape[1] == 0:
        raise ValueError("hf_bpd.generate needs a prompt of at least one token, got an empty input")
    config = generation_config
    if (config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states)) or any(
        model_kwargs.get(k) for k in ("output_attentions", "output_hidden_states")
    ):
        raise ValueError(
            "hf_bpd.generate does not return attentions or hidden states (a tree forward's are per drafted "
            "node, not per generated token): drop output_attentions / output_hidden_states"
        )
    quiet = ("output_attentions", "output_hidden_states")  # False: what every forward is asked anyway
    extra = sorted(
        k for k, v in model_kwargs.items() if k not in PREPARED_MODEL_KWARGS and v is not None and k not in quiet
    )
    if extra:
        raise ValueError(
            f"hf_bpd.generate does not pass {extra} on to the tree forward (per-token or multimodal inputs "
            "would have to be extended to every drafted node); use plain generate for such inputs"
        )
    implementation = generation_config.cache_implementation
    if implementation not in (None, "dynamic"):
        raise ValueError(
            f"hf_bpd.generate needs a DynamicCache (it drops rejected drafts from it), got cache_implementation="
            f"{implementation!r}"
        )
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is None:
            continue
        if not isinstance(cache, DynamicCache):
            raise ValueError(f"hf_bpd.generate needs a DynamicCache, got {type(cache).__name__}")
        if cache.get_seq_length() > 0:
            raise ValueError(
                "hf_bpd.generate starts from an empty cache: continuing from a filled one is not supported; "
                "pass the whole conversation as input_ids instead"
            )
    text_config = model.config.get_text_config(decoder=True)
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and input_ids.shape[1] >= context:
        raise ValueError(
            f"input of {input_ids.shape[1]} tokens does not fit the model's context of {context} positions"
        )
    window = attention_window(text_config)
    if window is not None and (generation_config.max_length or 0) > window:
        raise ValueError(
            f"prompt of {input_ids.shape[1]} tokens + up to {generation_config.max_length - input_ids.shape[1]} new "
            f"tokens can reach the model's attention window of {window} tokens, past which a tree forward would "
            f"drop or mask keys by index: hf_bpd.generate serves this model only while prompt + max_new_tokens <= "
            f"{window}"
        )
    return window
