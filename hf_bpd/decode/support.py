"""Which models, inputs and `generate` options the tree-attention loop serves, decided before any forward.

Tree verification runs every drafted node in ONE forward: siblings share a position, each node attends
to the cache and its own ancestors (a 4D mask), and rejected nodes are dropped from the KV cache
afterwards. That is exact for attention layers that honour the mask and keep per-token keys and values.
It is not for:

- recurrent, convolutional or linear-attention state (Qwen3-Next, LFM2, Falcon-H1, Mamba-2, ...): the
  forward would advance the state through siblings and rejected drafts as if they were one sequence. These
  models are decoded one chain per step instead (`recurrent.py`, which also names the families refused);
- position biases built from a 2D mask (ALiBi: Falcon-alibi, Bloom, MPT): the model cannot take ours;
- GPT-Neo's local layers past their window: the model masks keys by cache *index* inside its attention
  module (a buffer the 4D mask can only narrow), not by a node's depth, so a tree node at index i > its
  depth would lose keys it needs. Below the window they attend exactly like full attention, so a
  generation that stays below it is served (trees capped below it) and one that could reach it is
  refused up front (rather than halfway through). The same holds for a model mixing full and windowed
  layers whose forward takes one mask for all of them instead of a mask per layer type;
- sparse attention that picks its own keys (DeepSeek-V3.2, GLM-MoE-DSA, Mistral-Large-4, ...: an indexer
  scores the cached keys and each query attends to its top-k only; DeepSeek-V4: compressed keys): the
  model, not the mask, decides which keys a node sees, and its indexer keys are kept per cache entry
  beside the ones compaction drops, so a tree mask cannot be honoured exactly;
- attention that reads a query's position from its cache index (the cache's length plus its index in the
  forward) instead of `position_ids` (`INDEX_POSITION_BLOCKS`): a tree's node i sits at index past + i but at
  position past + depth(i). Llama-4's NoPE layers read it through their attention temperature, constant
  over blocks of floor_scale positions, so one row's trees are kept inside one block (`index_position_room`);
  Inkling's relative biases read it at every index, and its chains (`recurrent.py`) sit at their indices.
  Batches of such models are refused: their shared cache counts padding and holes;
- LongRoPE past its switch (`rope_switch_position`): each forward takes the short or the long rotary
  frequencies for all its positions by its largest one (and Phi-3's `generate` recomputes the cache once the
  text passes the switch), so trees are drafted below it and a generation that would pass it is refused;
- a model whose forward returns no KV cache (XLM): there is nothing to verify trees on;
- an LM head that reads a projection of the hidden state, of another width (RemBERT): the draft heads
  read the last hidden state and borrow the LM head;
- images in image-text models with multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, ...: 3D position
  ids offset by `rope_deltas` after the prefill): the tree forwards pass one text position per node;
- inputs other than token ids and their mask that the model reads on every step (`inputs_embeds`,
  GPT-2's `token_type_ids`, a filled cache): the loop would have to extend them to every tree node.
- a static cache (`cache_implementation="static"`) for a batch, a model with attention windows or a
  recurrent state: one row of a full-attention model is served on it (`static_cache.py`), the rest on
  the default DynamicCache.

Image-text models (Gemma 3, LLaVA, ...) are served with and without images: transformers' `generate`
encodes the images before it calls us (`mm_encoder_outputs`, empty for a text-only prompt), the prefill
gets every multimodal input exactly as plain `generate`'s first forward does (`is_first_iteration`), and
the tree forwards after it are text only, as plain `generate`'s decode steps are (it drops those inputs
after the prefill: `MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL`, and Gemma 3 its `token_type_ids`). The
heads read the language model's last hidden state and borrow its LM head (`get_output_embeddings()`).

Every refusal names its reason and is raised before the prefill, so it costs no forward.

Attention windows are served exactly at every length (`AttentionWindows`): sliding-window layers (Mistral,
Qwen2 with `use_sliding_window`, Gemma-2/3, Cohere-2, gpt-oss: a key at position k is seen from position
q when q - W < k <= q, transformers' `sliding_window_overlay`) and chunked layers (Llama-4: the same
chunk, k // C == q // C). The decode keeps every key of every layer (its cache has only full
`DynamicLayer`s: a sliding cache layer keeps the last W - 1 entries, so a tree's rejected entries would
evict keys a later step needs), and each tree forward gets, per layer type, the tree mask narrowed to that
type's window by *position* (`verify.tree_attention_mask`): a dict `{layer type: 4D mask}` for models
mixing types (their forward takes one), one 4D mask where every attention layer has the same window
(Mistral). Holes and left padding of batches do not count, since positions count real tokens only.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer

from ..compat import CACHE_NAMES, cache_argument, compiled_forward
from .static_cache import check_static_supported, is_static

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
# inputs `generate` hands over for the prefill of an image-text model, which its decode steps drop
try:
    from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL as PREFILL_ONLY_INPUTS
except ImportError:  # older transformers 5
    PREFILL_ONLY_INPUTS = ("pixel_values", "pixel_values_videos", "image_sizes", "pixel_attention_mask")
PREFILL_ONLY_INPUTS = {*PREFILL_ONLY_INPUTS, "mm_encoder_outputs"}
# per-token type ids: prefill-only where the model's own `prepare_inputs_for_generation` drops them after it
TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
# cache layer types of sparse attention that selects its own keys (module docstring)
SPARSE_LAYER_TYPES = {
    "indexed_attention": "a sparse-attention indexer: each query attends only to the top-k cached keys the "
    "indexer scores, chosen inside the model",
    "compressed_sparse_attention": "compressed sparse attention: keys are pooled into compressed blocks and "
    "selected inside the model",
    "heavily_compressed_attention": "compressed sparse attention: keys are pooled into compressed blocks and "
    "selected inside the model",
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


@dataclass(frozen=True)
class AttentionWindows:
    """How a model's attention layers window their keys, for the tree masks (module docstring).

    `layers`: each windowed layer type -> ("sliding", W) or ("chunked", C), the layers of every other type
    attending to all keys; `per_type`: the forward takes a dict {layer type: mask} (needed where windowed
    and full layers mix); `cap`: a window the tree masks cannot serve exactly past (GPT-Neo's local layers,
    or mixed layers without `per_type`), below which the decode keeps context plus tree, else None."""

    layers: dict[str, tuple[str, int]]
    per_type: bool
    cap: int | None

    def binding(self, longest: int) -> bool:
        """Whether any window can cut a key off when no position exceeds `longest` (else every layer
        attends like full attention and one plain tree mask serves them all)."""
        return any(longest >= size for _, size in self.layers.values())


def _takes_mask_per_layer_type(model) -> bool:
    """Whether the model's decoder forward takes `attention_mask` as a dict {layer type: mask}, as the
    transformers 5 decoders that mix layer types do (`isinstance(attention_mask, dict)` in its modeling
    file; read, never changed)."""
    try:
        source = inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return False
    return re.search(r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)", source) is not None


def attention_windows(model) -> AttentionWindows | None:
    """The model's attention windows (None: it has none)."""
    config = model.config.get_text_config(decoder=True)
    layers: dict[str, tuple[str, int]] = {}
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        typed = list(zip(*get_layer_types_and_kwargs(config)))
    except ImportError:  # older transformers 5: the model-wide settings
        typed = [
            (kind, {"sliding_window": getattr(config, "sliding_window", None) or config.attention_chunk_size})
            for kind in layer_types(config)
            if kind in WINDOWED_LAYER_TYPES
        ]
    for kind, kwargs in typed:
        if kind not in WINDOWED_LAYER_TYPES:
            continue
        window = ("sliding" if kind == "sliding_attention" else "chunked", int(kwargs["sliding_window"]))
        if layers.setdefault(kind, window) != window:  # one mask per layer type serves one window per type
            raise ValueError(
                f"{type(model).__name__} has {kind} layers with different windows ({layers[kind][1]} and "
                f"{window[1]}): hf_bpd.generate builds one mask per layer type"
            )
    attending = {kind for kind in layer_types(config) if kind != "dummy"}
    per_type = _takes_mask_per_layer_type(model)
    cap = None
    if layers and len(attending) > 1 and not per_type:
        cap = min(size for _, size in layers.values())
    # GPT-Neo builds its local window into the attention module, not into the cache's layer types
    if "local" in (getattr(config, "attention_layers", None) or []):
        cap = int(config.window_size) if cap is None else min(cap, int(config.window_size))
    if not layers and cap is None:
        return None
    return AttentionWindows(layers, per_type, cap)


def _llama4_temperature_block(config) -> int | None:
    """Llama-4's NoPE layers with attention temperature tuning scale each query by
    log1p(floor((index + 1) / floor_scale)) * attn_scale + 1, its index counted from the cache's length
    (`Llama4TextAttention`): the same scale across each block of floor_scale positions."""
    if not getattr(config, "attn_temperature_tuning", False):
        return None
    if all(getattr(config, "no_rope_layers", None) or [1]):  # 0 marks a layer without rotary embedding
        return None
    return int(config.floor_scale)


def _every_index(config) -> int:
    """Inkling's attention biases each query-key pair by their distance in cache indices (`get_mask_sizes`,
    `get_query_offset`), not in positions: read at every index, a block of one position."""
    return 1


# Models whose attention reads a query's position from its cache index (the cache's length plus its index in
# the forward), not from `position_ids`, through a quantity constant over aligned blocks of positions: model type
# of the text config -> the block's size for that config (None: this config does not do it)
INDEX_POSITION_BLOCKS = {
    "llama4_text": _llama4_temperature_block,
    "inkling_text": _every_index,
    "inkling2_text": _every_index,
    "inkling2_loop_text": _every_index,
}


def index_position_block(model) -> int | None:
    """The block of positions over which the model's attention reads a query's cache index as its position
    (`INDEX_POSITION_BLOCKS`), or None where it reads positions from `position_ids` only."""
    config = model.config.get_text_config(decoder=True)
    block = INDEX_POSITION_BLOCKS.get(getattr(config, "model_type", None))
    return None if block is None else block(config)


def index_position_room(block: int | None, past: int) -> int | None:
    """Most tree nodes a step may verify, `past` tokens cached, on a model reading positions by cache index
    over blocks of `block` (None: no bound). Node i sits at cache index past + i and at position
    past + depth(i) <= past + i: both fall in one block for every node when the indices past .. past + N - 1
    do (the model reads index + 1), i.e. N <= block - (past + 1) % block, at least the root alone."""
    return None if block is None else block - (past + 1) % block


def rope_switch_position(model) -> int | None:
    """LongRoPE's switch, `original_max_position_embeddings`: its rotary frequencies are chosen per forward,
    the short ones for every position of a forward whose largest position is below the switch, the long
    ones for all of them otherwise (transformers' `dynamic_rope_update`), and Phi-3's `generate` recomputes
    the whole cache with the long ones once the text passes it. None for other rotary embeddings."""
    config = model.config.get_text_config(decoder=True)
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return None
    per_type = all(isinstance(v, dict) for v in params.values())  # {layer type: parameters}
    longrope = [p for p in (params.values() if per_type else [params]) if p.get("rope_type") == "longrope"]
    if not longrope:
        return None
    # the frequencies switch at the parameters' position, Phi-3's `generate` recomputes at the config's
    found = [p.get("original_max_position_embeddings") for p in longrope]
    found.append(getattr(config, "original_max_position_embeddings", None))
    return min((int(n) for n in found if n), default=None)


def drafting_context(model, context: int | None, prompt_len: int) -> int | None:
    """The positions trees are drafted within: the model's `context`, lowered to its LongRoPE switch where
    the prompt is below it, so that every tree forward takes the short frequencies as plain decoding does
    (`check_call_supported` refuses a generation that would pass the switch)."""
    switch = rope_switch_position(model)
    if switch is None or prompt_len > switch:
        return context
    return switch if context is None else min(context, switch)


def recurrent_state_types(model) -> list[str]:
    """The model's cache layer types that keep per-sequence state instead of per-token keys and values
    (recurrent, convolutional or linear attention), sorted."""
    return sorted({t for t in layer_types(model.config.get_text_config(decoder=True)) if t not in KV_LAYER_TYPES})


def has_recurrent_state(model) -> bool:
    """Whether the model keeps recurrent, convolutional or linear-attention state (`recurrent.py` decodes it).
    Families known by name count too: transformers 5.25 dropped the `_is_stateful` flag that RWKV and xLSTM,
    whose configs list no layer types, were recognised by."""
    return bool(
        getattr(model, "_is_stateful", False)
        or recurrent_state_types(model)
        or model_type_names(model) & RECURRENT_REFUSED.keys()
    )


def model_type_names(model) -> set[str]:
    """The model's type and its text model's (they differ for a multimodal model): what refusals by name read."""
    return {model.config.model_type, model.config.get_text_config(decoder=True).model_type}


def check_model_supported(model) -> None:
    """Refuse, naming the reason, a model the tree-attention loop cannot decode exactly."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("hf_bpd.generate supports decoder-only causal LMs, not encoder-decoder models")
    text_config = config.get_text_config(decoder=True)
    for model_type in model_type_names(model):
        if model_type in REFUSED_MODEL_TYPES:
            raise ValueError(f"hf_bpd.generate does not support {model_type}: {REFUSED_MODEL_TYPES[model_type]}")
    types = layer_types(text_config)
    sparse = sorted({t for t in types if t in SPARSE_LAYER_TYPES})
    if sparse:
        raise ValueError(
            f"{type(model).__name__} has layers of type {sparse} ({SPARSE_LAYER_TYPES[sparse[0]]}): the model, not the "
            "attention mask, decides which keys a token sees, so a tree mask (each node sees the cache and its own "
            "ancestors) cannot be honoured exactly; use plain generate"
        )
    recurrent = has_recurrent_state(model)
    if recurrent:  # served one chain at a time, or refused by name (`recurrent.py`)
        check_recurrent_supported(model)
    if getattr(text_config, "alibi", False):
        raise ValueError(
            f"{type(model).__name__} uses ALiBi position biases, which it builds from a 2D attention mask: it "
            "cannot take the 4D tree-attention mask"
        )
    params = inspect.signature(model.forward).parameters
    # the chain forwards of recurrent models pass a mask and positions only where the model takes them, as
    # plain `generate` does; tree forwards need both
    needed = () if recurrent else ("attention_mask", "position_ids")
    missing = [f"`{name}`" for name in needed if name not in params]
    if cache_argument(model) is None:
        missing.append(" or ".join(f"`{name}`" for name in CACHE_NAMES))
    if missing:
        raise ValueError(
            f"{type(model).__name__}.forward has no {', '.join(missing)} argument: tree verification needs a model "
            "that accepts a 4D attention mask, position_ids and a KV cache"
        )
    if not _returns_cache(model):
        raise ValueError(
            f"{type(model).__name__} returns no KV cache (its forward's output, {_output_classes(model)}, has no cache "
            "field): tree verification decodes on a DynamicCache; use plain generate"
        )
    _check_lm_head_reads_hidden_state(model, text_config)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        why = {
            # transformers turns a 4D tensor into a score_mod reading the captured mask; tried on torch 2.13's
            # CPU, the compiled kernels crashed the process (heap corruption) on a tree forward
            "flex_attention": "flex_attention takes a BlockMask; a 4D float mask becomes a score_mod, which does "
            "not run reliably on tree forwards",
        }.get(impl, "it cannot take the custom 4D tree-attention mask")
        raise ValueError(
            f"attention implementation `{impl}` is not supported: {why}; load the model with attn_implementation "
            f"in {SUPPORTED_ATTENTION}"
        )


def _check_lm_head_reads_hidden_state(model, text_config) -> None:
    """The draft heads read the last hidden state and borrow the LM head: refuse a model whose output
    embedding takes vectors of another width, because its output head projects the hidden state first
    (RemBERT's `output_embedding_size`). OPT's last hidden state is already projected (`project_out`
    to `word_embed_proj_dim`), so that is its width."""
    lm_head = model.get_output_embeddings()
    weight = getattr(lm_head, "weight", None)
    width = getattr(text_config, "word_embed_proj_dim", None) or getattr(text_config, "hidden_size", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(width, int):
        return
    if weight.shape[1] != width:
        raise ValueError(
            f"{type(model).__name__}'s LM head reads vectors of width {weight.shape[1]} but its hidden states are "
            f"{width} wide (its output head projects the hidden state first): draft heads read the last hidden "
            "state and borrow the LM head, so hf_bpd.generate cannot draft for it; use plain generate"
        )


def _output_classes(model) -> str:
    hint = _return_hint(model)
    return " | ".join(getattr(c, "__name__", str(c)) for c in typing.get_args(hint) or (hint,))


def _return_hint(model):
    try:
        return typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: unknown
        return None


def _returns_cache(model) -> bool:
    """Whether the model's forward returns a KV cache, read from its annotated output class(es) (a
    `ModelOutput` dataclass with a `cache` / `past_key_values` field); True where it is not annotated."""
    hint = _return_hint(model)
    outputs = [c for c in (typing.get_args(hint) or (hint,)) if isinstance(c, type) and dataclasses.is_dataclass(c)]
    if not outputs:
        return True
    return any(f.name in CACHE_NAMES for c in outputs for f in dataclasses.fields(c))


def _present(value) -> bool:
    """Whether a model kwarg holds an input (an empty `mm_encoder_outputs` dict, None, ... do not)."""
    if value is None:
        return False
    if isinstance(value, (dict, list, tuple)):
        return any(_present(v) for v in value.values()) if isinstance(value, dict) else any(_present(v) for v in value)
    return True


def _drops_after_prefill(model, name: str, value, input_ids: torch.Tensor) -> bool:
    """Whether plain `generate`'s decode steps leave out the model kwarg `name` (as they do the multimodal
    inputs, and Gemma 3 its `token_type_ids`): then only the prefill reads it, and the prefill gets it."""
    if name in PREFILL_ONLY_INPUTS:
        return True
    if name not in TOKEN_TYPE_INPUTS or not isinstance(value, torch.Tensor):
        return False
    params = inspect.signature(model.prepare_inputs_for_generation).parameters
    if "is_first_iteration" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    try:  # what the model's own `prepare_inputs_for_generation` passes on a decode step (no forward)
        step = model.prepare_inputs_for_generation(
            input_ids[:, -1:], use_cache=True, is_first_iteration=False, **{name: value[..., -1:]}
        )
    except Exception:  # noqa: BLE001 - cannot tell: treat it as read on every step
        return False
    return step.get(name) is None


def _filled(cache) -> bool:
    """Whether the cache holds anything: keys and values, or conv / recurrent state (a cache of state layers
    alone has no sequence length to ask). A static layer is preallocated: its length says, not its size."""
    return any(
        any(getattr(layer, "has_previous_state", {}).values())
        or (bool(layer.get_seq_length() > 0) if isinstance(layer, StaticLayer) else _holds_keys(layer))
        for layer in cache.layers
    )


def _holds_keys(layer) -> bool:
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def check_call_supported(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict, tree_budget: int = 64
) -> AttentionWindows | None:
    """Refuse, naming the reason, inputs and options of this `generate` call that the loop would not
    honour. Returns the model's attention windows (None: none), which shape the tree masks (and, where
    `cap` is set, cap every tree below that window). `tree_budget`: the most nodes a step of the drafter
    verifies per row."""
    _check_inputs(model, input_ids, generation_config, model_kwargs)
    static = _check_cache(generation_config, model_kwargs)
    _check_positions(model, input_ids, generation_config, model_kwargs, tree_budget)
    return _check_windows(model, input_ids, generation_config, static)


def _check_inputs(model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """Inputs and outputs a tree forward cannot carry per drafted node."""
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
    positions = model_kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() > 2 and bool((positions != positions[:1]).any()):
        raise ValueError(
            f"{type(model).__name__} takes position ids of shape {tuple(positions.shape)} (multimodal rotary "
            "positions, M-RoPE, offset by the `rope_deltas` the prefill computes): hf_bpd.generate's tree forwards "
            "pass one text position per node, so it does not serve this model; use plain generate"
        )
    quiet = ("output_attentions", "output_hidden_states")  # False: what every forward is asked anyway
    extra = sorted(
        k
        for k, v in model_kwargs.items()
        if k not in PREPARED_MODEL_KWARGS
        and k not in quiet
        and _present(v)
        and not _drops_after_prefill(model, k, v, input_ids)
    )
    if extra:
        raise ValueError(
            f"hf_bpd.generate does not pass {extra} on to the tree forward (inputs the model reads on every step "
            "would have to be extended to every drafted node); use plain generate for such inputs"
        )


def _check_cache(generation_config: GenerationConfig, model_kwargs: dict) -> StaticCache | None:
    """An empty DynamicCache or StaticCache only; returns the static cache passed in, if any."""
    implementation = generation_config.cache_implementation
    if implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"hf_bpd.generate needs a DynamicCache or a static cache (it drops rejected drafts from them), got "
            f"cache_implementation={implementation!r}"
        )
    static = None  # a static cache (`static_cache.py`): checked once the model's windows are known
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is None:
            continue
        if isinstance(cache, StaticCache):
            static = cache
        elif not isinstance(cache, DynamicCache):
            raise ValueError(f"hf_bpd.generate needs a DynamicCache or a StaticCache, got {type(cache).__name__}")
        if _filled(cache):
            raise ValueError(
                "hf_bpd.generate starts from an empty cache: continuing from a filled one is not supported; "
                "pass the whole conversation as input_ids instead"
            )
    return static


def _check_positions(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict, tree_budget: int
) -> None:
    """The context length, and models that read positions from cache indices or switch rotary frequencies."""
    text_config = model.config.get_text_config(decoder=True)
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and input_ids.shape[1] >= context:
        raise ValueError(
            f"input of {input_ids.shape[1]} tokens does not fit the model's context of {context} positions"
        )
    block = index_position_block(model)
    # a batch's cache holds at most its padded prompt, then per step a tree slot per row: below the first
    # block boundary, every index and position read the same (the first) block, as in plain batched decoding
    new_tokens = max((generation_config.max_length or 0) - input_ids.shape[1], 0)
    longest_cache = input_ids.shape[1] + (new_tokens + 1) * max(tree_budget, 1)
    if block is not None and input_ids.shape[0] > 1 and longest_cache + 1 >= block:
        blocks = "" if block == 1 else f" (the block of {block} positions it falls in)"
        raise ValueError(
            f"{type(model).__name__}'s attention reads each query's position from its cache index{blocks}, the "
            "cache's length plus its index in the forward, not from position_ids: a batch's rows share one cache "
            "whose length counts their padding and holes, so their queries would not be read at the positions plain "
            f"decoding reads; hf_bpd.generate serves this model one row at a time (or batches whose prompt plus "
            f"max_new_tokens tree slots of {tree_budget} stay below {block} positions)"
        )
    switch = rope_switch_position(model)
    mask = model_kwargs.get("attention_mask")
    longest = input_ids.shape[1] if mask is None else int(mask.sum(-1).max())
    if switch is not None and longest <= switch and (generation_config.max_length or 0) > switch + 1:
        raise ValueError(
            f"prompt of {longest} tokens + up to {generation_config.max_length - input_ids.shape[1]} new tokens can "
            f"pass {type(model).__name__}'s LongRoPE switch at position {switch}: a forward reaching it takes the "
            "long rotary frequencies for all its positions (and Phi-3's generate recomputes the cache with them), so "
            "a tree forward would not rotate its nodes as plain decoding does; hf_bpd.generate serves this model "
            f"while prompt + max_new_tokens <= {switch + 1}, or for prompts longer than {switch} tokens"
        )


def _check_windows(
    model, input_ids: torch.Tensor, generation_config: GenerationConfig, static: StaticCache | None
) -> AttentionWindows | None:
    """A static cache's own refusals, and attention windows a long enough call would reach."""
    implementation = generation_config.cache_implementation
    text_config = model.config.get_text_config(decoder=True)
    windows = attention_windows(model)
    if static is not None:
        check_static_supported(
            model, input_ids, static, windows, has_recurrent_state(model), generation_config.max_length
        )
    elif implementation == "static":  # generate builds the static cache before this call: a model without one
        raise ValueError(f"cache_implementation='static' gave {type(model).__name__} no static cache to decode on")
    # recurrent models: their own masks window by cache index, which their chain loop keeps free of holes
    cap = None if windows is None or has_recurrent_state(model) else windows.cap
    if cap is not None and (generation_config.max_length or 0) > cap:
        why = (
            "its local layers mask keys by cache index inside the attention module"
            if "local" in (getattr(text_config, "attention_layers", None) or [])
            else "its forward takes one mask for its full and windowed layers alike"
        )
        raise ValueError(
            f"prompt of {input_ids.shape[1]} tokens + up to {generation_config.max_length - input_ids.shape[1]} new "
            f"tokens can reach the model's attention window of {cap} tokens, past which a tree forward would not "
            f"be exact ({why}): hf_bpd.generate serves this model only while prompt + max_new_tokens <= {cap}"
        )
    return windows


# model types checked to continue a cached state over a several-token forward exactly (tests/test_hybrid.py)
RECURRENT_SERVED = {
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "inkling_text",
    "inkling2_text",
    "inkling2_loop_text",
    "lara_mini",
    "lfm2",
    "lfm3",
    "mamba2",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "zaya",
}
_ZERO_STATE_SCAN = (
    "transformers' torch selective scan starts a forward of several tokens from a zero recurrent state (it reads "
    "the cached state only in one-token steps), so a chain of drafts cannot be verified in one forward exactly"
)
_OUTSIDE_CACHE = "outside the cache layers hf_bpd snapshots and restores, so a rejected draft's state cannot be undone"
RECURRENT_REFUSED = {
    "mamba": _ZERO_STATE_SCAN,
    "falcon_mamba": _ZERO_STATE_SCAN,
    "jamba": _ZERO_STATE_SCAN,
    "minimax": f"it keeps its lightning-attention state in its own MiniMaxCache.linear_cache, {_OUTSIDE_CACHE}",
    "rwkv": f"it keeps its recurrent state in the `state` tensors its forward returns, {_OUTSIDE_CACHE}",
    "xlstm": f"it keeps its recurrent state in its own xLSTMCache, {_OUTSIDE_CACHE}",
    "recurrent_gemma": f"it keeps its recurrent state inside its modules (no cache object), {_OUTSIDE_CACHE}",
}


def check_recurrent_supported(model) -> None:
    """Refuse, by name and reason, a model with recurrent state that the chain loop (`recurrent.py`) cannot
    decode exactly; return for a served family."""
    config = model.config
    names = model_type_names(model)
    what = f"{type(model).__name__} keeps recurrent, convolutional or linear-attention state"
    types = recurrent_state_types(model)
    if types:
        what += f" (layers of type {types})"
    refused = sorted(names & RECURRENT_REFUSED.keys())
    if refused:
        raise ValueError(f"{what}, and {RECURRENT_REFUSED[refused[0]]}; use plain generate")
    if not names & RECURRENT_SERVED:
        raise ValueError(
            f"{what}: hf_bpd.generate verifies such models one chain at a time, restoring the state a rejected "
            f"draft changed, and serves only the families checked to continue a cached state over a "
            f"several-token forward exactly ({', '.join(sorted(RECURRENT_SERVED))}); model type "
            f"{config.model_type!r} is not one of them; use plain generate"
        )


def serving_drafter(
    model, drafter, generation_config: GenerationConfig, model_kwargs: dict, batch_size: int, captured_step
):
    """The drafter that decodes this call: `drafter`, or for a call its EAGLE layer does not serve (what
    `check_features_supported` refuses, or the captured step asked for) its `fallback` heads where it has
    them, given the measurement settings of `drafter` (`profile`, `count_host_syncs`, `fused_sampling`).
    Refuses (ValueError) what neither serves."""
    if drafter.fallback is None:
        check_features_supported(model, drafter, generation_config, model_kwargs, batch_size)
        return drafter
    try:
        check_features_supported(model, drafter, generation_config, model_kwargs, batch_size)
        if captured_step in (None, False):
            return drafter
        reason = "the captured step drafts with heads"  # it grows heads' trees on the device
    except ValueError as refused:
        reason = str(refused)
    fallback = drafter.fallback
    try:
        check_features_supported(model, fallback, generation_config, model_kwargs, batch_size)
    except ValueError as refused:
        raise ValueError(f"{reason}; and its fallback: {refused}") from None
    fallback.profile, fallback.count_host_syncs = drafter.profile, drafter.count_host_syncs
    fallback.fused_sampling = drafter.fused_sampling
    return fallback


def check_features_supported(
    model, drafter, generation_config: GenerationConfig, model_kwargs: dict, batch_size: int = 1
) -> None:
    """The features the drafter reads. An EAGLE draft layer reads every accepted position's, which the
    one-row loop (`row.py`) hands over: refuse a batch and a model with recurrent state (their loops do
    not). Heads reading several layers (`feature_layers`) capture them with hooks around the model's eager
    forward: refuse a compiled forward (its graph would not run the hooks as the tree forward needs them)
    and a static cache (decoded through a compiled call)."""
    if drafter.reads_context and (batch_size > 1 or has_recurrent_state(model)):
        what = f"a batch of {batch_size}" if batch_size > 1 else f"{type(model).__name__}, which keeps recurrent state"
        raise ValueError(
            f"a drafter with an EAGLE draft layer decodes one row of a model without recurrent state, got {what}: "
            "decode rows one at a time, or use draft heads"
        )
    layers = getattr(getattr(drafter.heads, "config", None), "feature_layers", None)
    if not layers:
        return
    static = generation_config.cache_implementation == "static" or any(
        is_static(model_kwargs.get(name)) for name in CACHE_NAMES if model_kwargs.get(name) is not None
    )
    if compiled_forward(model) or static:
        raise ValueError(
            f"a drafter reading feature layers {layers} captures them with hooks on the eager forward: "
            "not yet served with a compiled forward or a static cache; use a dynamic cache and an eager forward"
        )
