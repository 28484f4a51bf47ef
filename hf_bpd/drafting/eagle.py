"""An EAGLE draft layer (Li et al., 2024): one decoder layer that drafts autoregressively on the base model's
features, the drafter kind issue #59 measured drafting furthest ahead on SmolLM2 (RESULTS.md, "Better
drafts").

Row t of the layer reads fc([norm(embedding of token t+1), norm(feature t)]), where feature t is the base
model's final hidden state at position t (what its LM head reads), attends causally over the rows before it,
and predicts feature t+1; the base model's LM-head rows of a draft vocabulary turn a predicted feature into
the next token's logits. The rows of the accepted context are exact (the base model computed their
features); a draft of depth j > 1 reads the feature its parent predicted, never the base model's:

    context rows 0 .. p      (feature t, token t+1) in the layer's own KV cache (`EagleContext`), one per
                             accepted position; row p reads the last accepted feature and the root
    depth-1 children         top-k of row p's prediction
    a node at depth d        (its parent's predicted feature, its token) at position p + d, attending to the
                             context rows and its ancestors' rows: its prediction gives its children

`grow_tree` grows a step's `DraftTree` best-first on path probability from those predictions, in rounds (one
layer call per round), as `expansion.expand_tree` grows "previous" heads' trees. The layer's block is a
decoder layer built from the base model's dimensions and initialised from its last layer (`for_base_model`):
a Llama-style block with the base layer's own extra norms where it has them (Gemma's per-head query and key
norms and the norms of the attention's and the MLP's outputs); its rotary embedding is the default one with
the base model's theta.

With `feature_layers` (EAGLE-3's fusion, e.g. `[2, 15, -1]`), feature t of a context row is a learned fusion
of those layers' hidden states at t (`heads.FeatureFusion`, the heads' own, starting as the identity on the
final state), captured by hooks during the forwards decoding runs anyway (`layer_features.py`); a draft's
rows still read their parents' predictions, and every prediction still targets the final hidden state.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from ..cpu.packed_linear import packed_or_plain_linear
from .calibration import HEADS, AcceptanceCalibration, Arc
from .context_vocab import ContextVocab, VocabExtension, extended_top_k
from .expansion import round_size
from .heads import (
    FeatureFusion,
    RMSNorm,
    _output_embeddings,
    check_feature_layers,
    identity_on_final_state,
    lm_head_identity,
    lm_head_mismatch,
    normalise_feature_layers,
)
from .lattice import host_lists
from .saved import DraftingModuleConfig, load_saved, saved_config, set_draft_vocab
from .tree import DraftTree


class EagleDraftLayerConfig(DraftingModuleConfig):
    model_type = "bpd_eagle_draft_layer"

    def __init__(
        self,
        num_attention_heads: int = 0,
        num_key_value_heads: int = 0,
        head_dim: int = 0,
        intermediate_size: int = 0,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        max_depth: int = 5,
        feature_layers: list[int] | None = None,
        qk_norm: bool = False,
        sandwich_norms: bool = False,
        attention_scale: float = 0.0,
        **kwargs,
    ) -> None:
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.max_depth = max_depth  # the deepest draft a tree holds
        self.feature_layers = check_feature_layers(feature_layers)  # None: the final hidden state alone
        # the base layer's own norms, kept where it has them (`base_layer_norms`); a layer saved before them
        # loads as the Llama-style block it was trained as
        self.qk_norm = qk_norm  # per-head RMS norms of queries and keys, before the rotation
        self.sandwich_norms = sandwich_norms  # norms of the attention's and the MLP's outputs (Gemma's)
        self.attention_scale = attention_scale  # 0: 1 / sqrt(head_dim)
        super().__init__(**kwargs)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`gate_up`: gate_proj's and up_proj's weights (and biases) stacked (`EagleDraftLayer.fused_weights`),
        run as one linear when drafting."""
        if gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = packed_or_plain_linear(x, *gate_up).chunk(2, -1)
        return self.down_proj(self.act(gate) * up)


def stacked(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (and biases, where they have them) stacked along the output: one linear giving
    their outputs side by side."""
    weight = torch.cat([layer.weight.detach() for layer in linears])
    biases = [layer.bias for layer in linears]
    return weight, None if biases[0] is None else torch.cat([b.detach() for b in biases])


def rotary_frequencies(config: EagleDraftLayerConfig) -> torch.Tensor:
    """The default rotary embedding's inverse frequencies `[head_dim / 2]`, float32."""
    return 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def norm_scale(norm: nn.Module | None) -> torch.Tensor | None:
    """The per-channel scale an RMS norm multiplies by (Gemma's norms store it as weight - 1), or None."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return weight.detach() + 1 if "Gemma" in type(norm).__name__ else weight.detach()


def base_layer_norms(last: nn.Module, head_dim: int) -> dict[str, nn.Module | None]:
    """The norms of the base model's last decoder layer that a draft layer's block keeps, by the draft layer's
    names: "input_norm" (before attention), "post_norm" (before the MLP: Gemma's pre_feedforward_layernorm,
    a Llama's post_attention_layernorm), and where the layer has them the per-head query and key norms ("q_norm",
    "k_norm") and the norms of the attention's and the MLP's outputs ("attention_out_norm", "mlp_out_norm")."""
    attention = getattr(last, "self_attn", None)
    pre_mlp = getattr(last, "pre_feedforward_layernorm", None)
    post_mlp = getattr(last, "post_feedforward_layernorm", None)
    sandwich = pre_mlp is not None and post_mlp is not None
    norms = {
        "input_norm": getattr(last, "input_layernorm", None),
        "post_norm": pre_mlp if sandwich else getattr(last, "post_attention_layernorm", None),
    }
    if sandwich:
        norms["attention_out_norm"] = getattr(last, "post_attention_layernorm", None)
        norms["mlp_out_norm"] = post_mlp
    q_scale, k_scale = (norm_scale(getattr(attention, n, None)) for n in ("q_norm", "k_norm"))
    if q_scale is not None and k_scale is not None and q_scale.shape == k_scale.shape == (head_dim,):
        norms["q_norm"], norms["k_norm"] = attention.q_norm, attention.k_norm  # per head (OLMo-2's span all heads)
    return norms


def base_layer_parts(model) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The base model's last decoder layer's attention and MLP, which a new draft layer starts as, and the layer
    itself; ValueError where the model has no Llama-style layer (q/k/v/o projections and a gated MLP)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    last = layers[-1] if layers is not None and len(layers) else None
    attention, mlp = getattr(last, "self_attn", None), getattr(last, "mlp", None)
    names = [(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    if last is None or any(not isinstance(getattr(m, n, None), nn.Linear) for m, n in names):
        raise ValueError(
            f"an EAGLE draft layer starts from the base model's last decoder layer, which must be Llama-style "
            f"(self_attn.q/k/v/o_proj, mlp.gate/up/down_proj linears); {type(model).__name__} has none"
        )
    return attention, mlp, last


class EagleDraftLayer(PreTrainedModel):
    """The draft layer (module docstring). `bind(base_model)` before use: it borrows the base model's token
    embedding and LM-head rows."""

    config_class = EagleDraftLayerConfig
    base_model_prefix = "bpd_eagle_draft_layer"
    main_input_name = "features"
    _no_split_modules: list[str] = []

    def __init__(self, config: EagleDraftLayerConfig) -> None:
        super().__init__(config)
        c = config
        if min(c.hidden_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) <= 0:
            raise ValueError("EagleDraftLayerConfig needs positive sizes (use EagleDraftLayer.for_base_model)")
        if c.num_attention_heads % c.num_key_value_heads or c.head_dim % 2:
            raise ValueError("attention heads must be a multiple of key-value heads, and head_dim even")
        if not 0 <= c.draft_vocab_size <= c.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, vocab_size], got {c.draft_vocab_size}")
        if c.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {c.max_depth}")
        hidden, eps = c.hidden_size, c.rms_norm_eps
        layers = c.feature_layers
        self.fusion = FeatureFusion(hidden, len(layers)) if layers else None
        # both inputs normalised: the final state's scale is not that of the residual stream the layer adds to
        self.token_norm, self.feature_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.input_norm = RMSNorm(hidden, eps)
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=c.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=c.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=c.attention_bias)
        self.post_norm = RMSNorm(hidden, eps)  # before the MLP
        self.mlp = GatedMLP(hidden, c.intermediate_size, c.hidden_act, c.mlp_bias)
        self.q_norm = RMSNorm(c.head_dim, eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, eps) if c.qk_norm else None
        self.attention_out_norm = RMSNorm(hidden, eps) if c.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(hidden, eps) if c.sandwich_norms else None
        self.out_norm = RMSNorm(hidden, eps)
        size = c.draft_vocab_size or c.vocab_size
        self.register_buffer("draft_vocab", torch.arange(size), persistent=c.draft_vocab_size > 0)
        self.register_buffer("inv_freq", rotary_frequencies(c), persistent=False)
        self.__dict__["_tied_weight"] = None  # LM-head rows borrowed at `bind` (named as the heads'), not saved
        self.__dict__["_lm_head"] = None  # the whole LM head, borrowed at `bind`: `context_vocab.py`
        self.__dict__["_embedding"] = None
        self.__dict__["_fused"] = None  # (weights' identities and versions, `fused_weights`)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # every weight is set by `for_base_model` or loaded

    @classmethod
    def for_base_model(
        cls,
        model,
        draft_vocab: torch.Tensor | None = None,
        max_depth: int = 5,
        start_as_identity: bool = True,
        feature_layers: list[int] | None = None,
        base_norms: bool = True,
    ) -> EagleDraftLayer:
        """An untrained draft layer for `model`, bound to it: its block a copy of the base model's last
        decoder layer (`base_layer_parts` refuses models without a Llama-style one), its norms the base
        layer's (`base_layer_norms`: Gemma's query, key and output norms included). `draft_vocab`: the token
        ids it may draft (default: all). `start_as_identity`: fc passes the feature through and the attention
        and MLP outputs start at zero, so the first prediction is the feature itself (what made training start
        well on SmolLM2). `feature_layers` (e.g. `[2, 15, -1]`,
        resolved against `model` by `normalise_feature_layers`): the context rows read a fusion of those
        hidden states, which starts as the identity on the final one. `base_norms=False`: a Llama-style block
        without the base layer's query, key and output norms, what layers saved before them were (for
        `train-eagle --init` to continue one)."""
        attention, mlp, last = base_layer_parts(model)
        if feature_layers is not None:
            from .layer_features import decoder_layers

            feature_layers = normalise_feature_layers(feature_layers, len(decoder_layers(model)))
        cfg = model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        lm_head = _output_embeddings(model)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        rope = getattr(text, "rope_parameters", None) or {}
        if "full_attention" in rope:  # per-layer-type parameters (Gemma-3): the global layers'
            rope = rope["full_attention"]
        theta = rope.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0
        kept = base_layer_norms(last, head_dim)
        if not base_norms:
            kept = {name: kept[name] for name in ("input_norm", "post_norm")}
        config = EagleDraftLayerConfig(
            base_model_name=getattr(cfg, "_name_or_path", "") or "",
            base_model_type=getattr(cfg, "model_type", "") or "",
            hidden_size=lm_head.weight.shape[1],
            vocab_size=lm_head.weight.shape[0],
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=mlp.gate_proj.out_features,
            hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu",
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            attention_bias=attention.q_proj.bias is not None,
            mlp_bias=mlp.gate_proj.bias is not None,
            draft_vocab_size=0 if draft_vocab is None else int(draft_vocab.numel()),
            max_depth=max_depth,
            feature_layers=feature_layers,
            qk_norm="q_norm" in kept,
            sandwich_norms="mlp_out_norm" in kept,
            attention_scale=float(getattr(attention, "scaling", None) or head_dim**-0.5),
            **lm_head_identity(lm_head.weight),
        )
        with torch.random.fork_rng(devices=[]):  # fc's default initialisation must not move a user's stream
            layer = cls(config)
        if draft_vocab is not None:
            set_draft_vocab(layer, draft_vocab, config.vocab_size)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer, name).load_state_dict(getattr(attention, name).state_dict())
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).load_state_dict(getattr(mlp, name).state_dict())
            # the block's norms start as the base layer's, the output norm as its final norm
            norms = [(getattr(layer, name), theirs) for name, theirs in kept.items()]
            for mine, theirs in norms + [(layer.out_norm, getattr(model.model, "norm", None))]:
                scale = norm_scale(theirs)
                if scale is not None and scale.shape == mine.weight.shape:
                    mine.weight.copy_(scale)
            if layer.fusion is not None:
                identity_on_final_state(layer.fusion.linear)
            if start_as_identity:
                hidden = config.hidden_size
                layer.fc.weight.zero_()
                layer.fc.weight[:, hidden:].copy_(torch.eye(hidden))
                layer.fc.bias.zero_()
                # the attention's and the MLP's contributions start at zero: where a norm follows them, its scale
                # (a normed zero is no smooth start: the norm undoes any small step away from it)
                if config.sandwich_norms:
                    layer.attention_out_norm.weight.zero_()
                    layer.mlp_out_norm.weight.zero_()
                else:
                    layer.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
        layer = layer.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        return layer.bind(model)

    @staticmethod
    def saved_config(path, **kwargs) -> EagleDraftLayerConfig:
        """The config saved in `path`; ValueError naming the folder where it is not an EAGLE draft layer's."""
        return saved_config(EagleDraftLayerConfig, path, "draft-layer", **kwargs)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs) -> EagleDraftLayer:
        """Load a saved draft layer; a folder that is not one, or a corrupt file, raises ValueError."""
        layer = load_saved(super().from_pretrained, EagleDraftLayerConfig, path, "draft-layer", *args, **kwargs)
        # not saved, and loading leaves it uninitialised: recomputed in float32
        layer.inv_freq = rotary_frequencies(layer.config).to(layer.draft_vocab.device)
        return layer

    def check_compatible(self, model) -> None:
        """ValueError where this layer was made for another base model."""
        lm_head = _output_embeddings(model)
        vocab, hidden = lm_head.weight.shape
        cfg = self.config
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        where = f"the EAGLE draft layer for `{cfg.base_model_name or 'unknown'}`"
        if (vocab, hidden) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"{where} expects vocabulary x hidden {cfg.vocab_size} x {cfg.hidden_size}, but base model "
                f"`{name}` has {vocab} x {hidden}"
            )
        why = lm_head_mismatch(lm_head.weight, cfg.base_lm_head_sketch, cfg.base_lm_head_fingerprint)
        if why:
            raise ValueError(f"{where} was trained on another base model than `{name}` ({why}): train one for it")

    def bind(self, model) -> EagleDraftLayer:
        """Check that the layer fits `model` and borrow its token embedding and LM-head rows. Returns self."""
        self.check_compatible(model)
        weight = _output_embeddings(model).weight.detach()
        rows = weight[self.draft_vocab.to(weight.device)] if self.config.draft_vocab_size else weight
        self.__dict__["_tied_weight"] = rows
        self.__dict__["_lm_head"] = weight  # every row: a context's tokens outside the draft vocabulary
        embedding = model.get_input_embeddings()
        if embedding is None or embedding.weight.shape[1] != self.config.hidden_size:
            raise ValueError("an EAGLE draft layer reads the base model's token embeddings: it has none of its width")
        self.__dict__["_embedding"] = embedding.weight.detach().to(weight.device)
        return self

    def _bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, embedding = self.__dict__["_tied_weight"], self.__dict__["_embedding"]
        if rows is None:
            raise RuntimeError("bind the EAGLE draft layer to its base model first: layer.bind(model)")
        return rows, embedding

    # the drafter's view of its drafting module (what `BlockDrafter` reads of heads)
    @property
    def num_heads(self) -> int:
        return self.config.max_depth

    conditions_on_draft = False
    chained = False
    context_copy = None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The feature a context row reads: `features [..., k * hidden]` (the `feature_layers`' hidden states,
        concatenated in that order, as `layer_features.LayerFeatures` gives them) through the fusion ->
        `[..., hidden]`; a layer without feature layers reads the final hidden state itself (returned as is).
        A draft's own rows read their parents' predictions instead, never a fusion."""
        if self.fusion is None:
            return features
        return self.fusion.checked(features, self.config.feature_layers, "this EAGLE draft layer's rows")

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Predicted features `[..., H]` -> logits over the draft vocabulary."""
        rows, _ = self._bound()
        if rows.dtype != feature.dtype:
            rows = rows.to(feature.dtype)
        return packed_or_plain_linear(feature, rows)  # the drafter's packed kernels (`binding.heads_kernels`)

    def fused_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The weights drafting runs stacked, made once and again after a weight changes: q, k and v
        projections as one linear ("qkv") and the MLP's gate and up projections as one ("gate_up"). Each is
        one weight read and one kernel call in place of three and two, at every step of every draft. Training
        runs the separate linears (their gradients are theirs)."""
        parts = {"qkv": [self.q_proj, self.k_proj, self.v_proj], "gate_up": [self.mlp.gate_proj, self.mlp.up_proj]}
        tensors = [t for group in parts.values() for m in group for t in (m.weight, m.bias) if t is not None]
        key = tuple((id(t), t._version) for t in tensors)
        cached = self.__dict__.get("_fused")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, {name: stacked(group) for name, group in parts.items()})
            self.__dict__["_fused"] = cached
        return cached[1]

    def packed_extra_weights(self) -> tuple[torch.Tensor, ...]:
        """As `BlockDraftHeads.packed_extra_weights`: the stacked weights and the borrowed LM-head rows."""
        rows = self.__dict__["_tied_weight"]
        return tuple(w for w, _ in self.fused_weights().values()) + (() if rows is None else (rows,))

    def top_tokens(
        self, feature: torch.Tensor, top_k: int, extension: VocabExtension | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted features `[n, H]` -> top-k token ids and log-probabilities `[n, k]`, over the draft
        vocabulary and an `extension`'s context tokens (`context_vocab.py`), in one softmax."""
        return extended_top_k(self.logits(feature), feature, self.draft_vocab, extension, top_k)

    def step(
        self,
        feature: torch.Tensor,
        token: torch.Tensor,
        position: torch.Tensor,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        mask: torch.Tensor,
        write_at: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `[B, R]`: features `[B, R, H]` and tokens `[B, R]` at `position [R]`, attending over `keys` and
        `values` (`[B, kv, C, d]`, or None) and the rows' own new keys, as `mask [R, C + R]` (True: attend)
        allows. Returns (predicted features `[B, R, H]`, keys and values with the rows' appended). With
        `write_at` = C, `keys` and `values` are buffers of room for C + R or more, their first C filled: the
        rows' keys are written into them in place and the same buffers returned (no copy of the context)."""
        _, embedding = self._bound()
        c = self.config
        b, r, _ = feature.shape
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        fused = None if torch.is_grad_enabled() else self.fused_weights()
        x = self.fc(torch.cat([self.token_norm(embedding[token]), self.feature_norm(feature)], -1))
        h = self.input_norm(x)
        if fused is None:
            qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], -1)
        else:
            qkv = packed_or_plain_linear(h, *fused["qkv"])
        qkv = qkv.view(b, r, heads + 2 * kv_heads, c.head_dim).transpose(1, 2)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None:
            q, k = qk.split([heads, kv_heads], 1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], 1)
        angles = position.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().to(qk.dtype), angles.sin().to(qk.dtype)
        q, k = (qk * cos + rotate_half(qk) * sin).split([heads, kv_heads], 1)  # the same rotation for both
        if write_at is not None:
            keys[:, :, write_at : write_at + r] = k
            values[:, :, write_at : write_at + r] = v
            seen_keys, seen_values = keys[:, :, : write_at + r], values[:, :, : write_at + r]
        else:
            keys = seen_keys = k if keys is None else torch.cat([keys, k], 2)
            values = seen_values = v if values is None else torch.cat([values, v], 2)
        scale = c.attention_scale or None
        attended = F.scaled_dot_product_attention(
            q, seen_keys, seen_values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        attention_out = self.o_proj(attended.transpose(1, 2).reshape(b, r, -1))
        x = x + (attention_out if self.attention_out_norm is None else self.attention_out_norm(attention_out))
        mlp_out = self.mlp(self.post_norm(x), None if fused is None else fused["gate_up"])
        x = x + (mlp_out if self.mlp_out_norm is None else self.mlp_out_norm(mlp_out))
        return self.out_norm(x), keys, values

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time drafting (teacher-forced tokens, own features) over right-padded sequences: for rows
        t = 0 .. L-2 of `features [B, L, H]` (or `[B, L, k * H]`: the feature layers' states, fused here) and
        `tokens [B, L]`, depth 1 reads (feature t, token t+1) with causal attention over depth 1's rows <= t;
        depth j reads (its own depth j-1 prediction, token t+j) and attends to depth 1's rows <= t and row t
        of depths 2..j. Returns each depth's predictions `[B, L-1, H]` (depth j's row t predicts the final
        hidden state at t+j)."""
        r = features.shape[1] - 1
        rows = torch.arange(r, device=features.device)
        causal = rows[None, :] <= rows[:, None]
        own = torch.eye(r, dtype=torch.bool, device=features.device)
        padded_tokens = F.pad(tokens, (0, depth))  # token t+j past the end: padding (its rows have no target)
        predicted, keys, values = [], None, None
        feature = self.fuse(features[:, :-1])
        for j in range(1, depth + 1):
            mask = torch.cat([causal] + [own] * (j - 1), 1)
            feature, keys, values = self.step(feature, padded_tokens[:, j : j + r], rows + j - 1, keys, values, mask)
            predicted.append(feature)
        return predicted


@dataclass
class EagleContext:
    """The draft layer's KV cache over one sequence's context rows (row t: feature t, token t+1), and the
    prediction of its last row (the root's children's feature). `rows` is the number of rows cached: the
    context's length minus one. `keys` and `values` `[1, kv, room, d]` are buffers written in place: the
    context's rows first, then a step's tree nodes as scratch, which the next `extend` overwrites.

    With `context_vocab`, the layer may also draft every token of the context its draft vocabulary lacks
    (`vocab`, `context_vocab.py`): their rows are the base model's LM head's, which the layer's predicted
    features were trained to match."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    rows: int = 0
    prediction: torch.Tensor | None = None  # [1, H]
    context_vocab: bool = False
    vocab: ContextVocab = field(default_factory=ContextVocab)

    def reserve(self, layer: EagleDraftLayer, room: int) -> None:
        """Buffers of room for at least `room` rows, the cached ones kept (grown by doubling)."""
        if self.keys is not None and self.keys.shape[2] >= room:
            return
        c = layer.config
        shape = (1, c.num_key_value_heads, max(room, 2 * self.rows, 64), c.head_dim)
        keys = torch.empty(shape, device=layer.draft_vocab.device, dtype=layer.dtype)
        values = torch.empty_like(keys)
        if self.keys is not None:
            keys[:, :, : self.rows] = self.keys[:, :, : self.rows]
            values[:, :, : self.rows] = self.values[:, :, : self.rows]
        self.keys, self.values = keys, values

    def extend(self, layer: EagleDraftLayer, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append the rows of newly accepted positions: their base-model features `[n, H]` (a layer with
        feature layers: their fusion, as decoding's hooks give it) and the token after each `[n]` (the last
        one: the step's root)."""
        n = features.shape[0]
        if n < 1 or next_tokens.shape != (n,):
            raise ValueError(f"extend needs n >= 1 features and n next tokens, got {n} and {tuple(next_tokens.shape)}")
        device = layer.draft_vocab.device
        position = torch.arange(self.rows, self.rows + n, device=device)
        mask = torch.ones(n, self.rows + n, dtype=torch.bool, device=device)
        mask[:, self.rows :] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        self.reserve(layer, self.rows + n)
        with torch.no_grad():
            features, next_tokens = features[None].to(device, layer.dtype), next_tokens[None].to(device)
            out, _, _ = layer.step(features, next_tokens, position, self.keys, self.values, mask, self.rows)
        self.rows += n
        self.prediction = out[0, -1:]
        if self.context_vocab:
            self.vocab.add(layer, next_tokens[0].tolist())

    @property
    def vocab_extension(self) -> VocabExtension | None:
        return self.vocab.extension


def grow_tree(
    layer: EagleDraftLayer,
    context: EagleContext,
    root: int,
    top_k: int,
    budget: int,
    max_depth: int | None = None,
    calibration: AcceptanceCalibration | None = None,
) -> tuple[DraftTree, list[Arc]]:
    """A step's tree of at most `budget` nodes, grown best-first on (calibrated) path probability from the
    layer's predictions: the root's children from the context's last prediction, then rounds of the best
    candidates (`expansion.round_size`, the heads' rounds: each reads the layer's weights and the LM-head rows
    once, so small trees take few; EAGLE-2's one depth a round drafts barely better at 8-16 nodes for twice the
    rounds), each round's nodes run through the layer together (each attending
    to the context and its own ancestors) to give their children. Returns the tree and every node's arc."""
    tree, arcs = DraftTree.root_only(root), [Arc(0.0, HEADS)]
    depth_limit = min(layer.config.max_depth, max_depth if max_depth is not None else layer.config.max_depth)
    if budget < 2 or depth_limit < 1 or context.prediction is None:
        return tree, arcs
    device = layer.draft_vocab.device
    p = context.rows - 1  # the last context row's position: a node at depth d sits at p + d
    path_logprob = {0: 0.0}
    features = {0: context.prediction}  # node -> the feature it predicts for its children [1, H]
    expanded_index: dict[int, int] = {}  # tree node -> its row among the expanded ones, after the context's
    context.reserve(layer, context.rows + budget)
    heap: list[tuple[float, int, int, int, float]] = []
    counter = 0

    def log_scale(depth: int) -> float:
        return 0.0 if calibration is None else math.log(calibration.scale(HEADS, depth))

    def push_children(nodes: list[int], ids: list[list[int]], lps: list[list[float]]) -> None:
        nonlocal counter
        room = budget - len(tree)
        for node, node_ids, node_lps in zip(nodes, ids, lps):
            if tree.depths[node] >= depth_limit:
                continue
            scale = log_scale(tree.depths[node] + 1)
            for token, lp in zip(node_ids[:room], node_lps[:room]):
                key = path_logprob[node] + min(0.0, lp + scale)
                heapq.heappush(heap, (-key, counter, node, token, lp))
                counter += 1

    with torch.no_grad():
        ids, lps = host_lists(*layer.top_tokens(context.prediction, top_k, context.vocab_extension))
    push_children([0], ids, lps)
    per_round = round_size(budget)
    while heap and len(tree) < budget:
        added = []
        while heap and len(added) < per_round and len(tree) < budget:
            neg, _, parent, token, lp = heapq.heappop(heap)
            node = tree.add_child(parent, token)
            path_logprob[node] = -neg
            arcs.append(Arc(lp, HEADS))
            added.append(node)
        expand = [n for n in added if tree.depths[n] < depth_limit]
        if not expand or len(tree) >= budget:
            break
        # each node reads its parent's predicted feature and its own token at position p + depth, and
        # attends to the context and the rows of its expanded ancestors (and itself)
        parent_features = torch.cat([features[tree.parents[n]] for n in expand])[None]
        tokens = torch.tensor([[tree.tokens[n] for n in expand]], device=device)
        position = torch.tensor([p + tree.depths[n] for n in expand], device=device)
        expanded = len(expanded_index)
        ancestors = [[False] * expanded for _ in expand]  # built on the host, copied once
        for row, n in zip(ancestors, expand):
            a = tree.parents[n]
            while a > 0:
                row[expanded_index[a]] = True
                a = tree.parents[a]
        mask = torch.cat(
            [
                torch.ones(len(expand), context.rows, dtype=torch.bool, device=device),
                torch.tensor(ancestors, dtype=torch.bool, device=device).view(len(expand), expanded),
                torch.eye(len(expand), dtype=torch.bool, device=device),
            ],
            1,
        )
        with torch.no_grad():  # the nodes' keys go after the context's and the expanded nodes' in the buffers
            write_at = context.rows + expanded
            out, _, _ = layer.step(parent_features, tokens, position, context.keys, context.values, mask, write_at)
            ids, lps = host_lists(*layer.top_tokens(out[0], top_k, context.vocab_extension))
        for i, n in enumerate(expand):
            expanded_index[n] = expanded + i
            features[n] = out[0, i : i + 1]
        push_children(expand, ids, lps)
    return tree, arcs
