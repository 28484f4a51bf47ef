"""Block draft heads: h small residual heads on the base model's last hidden state.

The base model predicts token t+1 from the hidden state at t; head i (i = 1..h) predicts token t+1+i from
the same hidden state. Each head is `num_layers` residual blocks `x + SiLU(W x + b)` followed by a
softmax layer. By default the softmax layer IS the base model's LM head (tied, not copied), so a
checkpoint holds only the residual blocks: ~1.3 MB per head for a 576-wide model.

Optional draft vocabulary (`draft_vocab`): the heads' softmax may cover only the S most frequent tokens of
the distilled data instead of the whole vocabulary (frequency-ranked drafting). A rare token can then not
be drafted, which only costs speed, never correctness (verification uses the base model's full
vocabulary), while the heads' softmax layer becomes V/S times cheaper in training and at every step.

Optional token input (`token_input`): the first residual block of each head also reads the base model's
input embedding of one token (`x + SiLU(W [x; e(token)] + b)`). Like the LM head, the embedding is
borrowed from the base model at `bind`.
  "next"      every head reads token t+1: the base model's own choice, already known when drafting (the
              draft tree's root), so it is still one head call per step. A plain Medusa head must guess
              token t+1 again before it can predict t+2; on SmolLM2-135M this input raises head-1 top-1
              accuracy from 0.33 to 0.43 on the same data (docs/history.md).
  "previous"  head i reads token t+i, the token right before its own target (head 1: token t+1, as
              above; head i > 1: the token the draft puts at depth i-1). The heads then draft like a small
              autoregressive model: each tree node's children come from the next head applied to the
              node's own token (`step`), so a branch continues what it actually drafted instead of what
              the best draft did (Hydra-style sequentially dependent heads, with one token of context).
              Same-data ablation on SmolLM2-135M: head-2/3 top-1 0.33/0.31 against 0.24/0.16 for "next"
              (docs/history.md). Drafting costs up to 4 rounds of batched head calls per step instead of
              one call.
  ""          plain Medusa heads (the hidden state only).

Optional chaining (`chain`, "previous" heads only): head i > 1 also reads head i-1's state at the node's
parent (that head's residual-block output), so a node has read every token of its branch, not only the one
before its target. Drafting keeps each expanded node's state for its children (`step`'s `parent_states`).
  "state"   head i > 1 reads that state in place of the base hidden state: a recurrent drafter, as Apple's
            ReDrafter (same weights' shapes and cost per node).
  "beside"  head i > 1's first block reads it beside the base hidden state and the token
            (`x + SiLU(W [x; e(token); parent state] + b)`); its new weights start at zero, so unchained
            heads given a chain (`with_chain`) draft exactly as before until trained.

Optional context copy (`copy_dim` > 0, "previous" heads only): each head also points into the context
(prompt and answer so far) and mixes the token that followed the matching bigram there into its own
distribution (`context_copy.py`): what lets the heads copy names, numbers and phrases from a long prompt.

Optional features from several layers (`feature_layers`, EAGLE-3 style): the heads read a fusion of the
base model's hidden states at a few layers instead of the last one alone, e.g. `[2, 15, -1]`. Indices are
those of `output_hidden_states=True`'s tuple: 0 the embeddings (the first layer's input), i > 0 the output
of decoder layer i (raw, before any final norm), -1 the final hidden state (after the final norm, what the
heads read otherwise); -1 must be among them. The fusion (`FeatureFusion`) RMS-normalises each raw layer's
state, concatenates them with the final one and projects back to the hidden size; it starts as the
identity on the final state, so new fusion heads, or old heads given a fusion (`with_feature_layers`), start
exactly where last-layer heads are. Decoding and training capture those layers with forward hooks
(`layer_features.py`), not by keeping every layer's output.

Deeper copies (`with_num_layers`) append blocks that start at zero (the identity), so trained heads can grow
without drafting differently until the new blocks are trained.

The residual weights start at zero, so an untrained head is the base LM head applied to the base hidden
state: it repeats the base model's own next-token guess (the paper's and Medusa's initialisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..card import save_hub_folder
from ..cpu.packed_linear import packed_or_plain_linear
from .context_copy import (
    INITIAL_SINK,
    ContextCopy,
    CopyMemory,
    CopyTargets,
    mixed_logprobs,
    mixture_top_k,
    target_logprob,
)
from .context_vocab import VocabExtension, extended_top_k
from .saved import DraftingModuleConfig, load_saved, saved_config, set_draft_vocab

MAX_HEADS = 32
TOKEN_INPUTS = ("", "next", "previous")
CHAINS = ("", "state", "beside")


class BlockDraftHeadsConfig(DraftingModuleConfig):
    model_type = "block_draft_heads"

    def __init__(
        self,
        num_heads: int = 4,
        num_layers: int = 1,
        tie_lm_head: bool = True,
        use_next_token: bool = False,
        token_input: str | None = None,
        copy_dim: int = 0,
        feature_layers: list[int] | None = None,
        chain: str = "",
        **kwargs,
    ) -> None:
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.tie_lm_head = tie_lm_head
        # token_input supersedes use_next_token (older checkpoints only have the latter)
        if token_input is None:
            token_input = "next" if use_next_token else ""
        if token_input not in TOKEN_INPUTS:
            raise ValueError(f"token_input must be one of {TOKEN_INPUTS}, got {token_input!r}")
        self.token_input = token_input
        self.use_next_token = token_input == "next"
        self.copy_dim = copy_dim  # 0: no context copy
        # None: the final hidden state alone (configs written before the option have none)
        self.feature_layers = check_feature_layers(feature_layers)
        # how head i > 1 reads head i-1's state ("": it does not; module docstring)
        if chain not in CHAINS:
            raise ValueError(f"chain must be one of {CHAINS}, got {chain!r}")
        if chain and token_input != "previous":
            raise ValueError(
                f"chained heads read the drafted token before their target: token_input must be "
                f"'previous', got {token_input!r}"
            )
        if chain and copy_dim:
            raise ValueError("chained heads have no context-copy pointer (copy_dim must be 0)")
        self.chain = chain
        super().__init__(**kwargs)


FINAL_HIDDEN_STATE = -1  # in `feature_layers`: the model's final hidden state (after its final norm)


def check_feature_layers(layers) -> list[int] | None:
    """`feature_layers` in their canonical form: distinct indices of `output_hidden_states`' tuple, ascending,
    the final hidden state (-1) last; None stays None (the final hidden state alone). Raises ValueError on
    anything else (other negative indices are resolved against the base model by `normalise_feature_layers`)."""
    if layers is None:
        return None
    layers = [int(i) for i in layers]
    if FINAL_HIDDEN_STATE not in layers or len(set(layers)) < 2 or len(set(layers)) != len(layers):
        raise ValueError(
            f"feature_layers must be distinct hidden-state indices, at least two, the final one (-1) among them; "
            f"got {layers}"
        )
    if any(i < 0 and i != FINAL_HIDDEN_STATE for i in layers):
        raise ValueError(
            f"feature_layers {layers}: negative indices other than -1 depend on the base model's depth: resolve "
            "them with normalise_feature_layers (BlockDraftHeads.for_base_model does)"
        )
    return sorted(i for i in layers if i >= 0) + [FINAL_HIDDEN_STATE]


def normalise_feature_layers(layers, num_layers: int) -> list[int] | None:
    """`layers` as indices of a model with `num_layers` decoder layers (`num_layers + 1` hidden states), in
    the config's canonical form (`check_feature_layers`): -1 and `num_layers` are the final hidden state,
    other negative indices count from it as Python's do."""
    if layers is None:
        return None
    out = []
    for i in (int(i) for i in layers):
        j = i + num_layers + 1 if i < 0 else i
        if not 0 <= j <= num_layers:
            raise ValueError(f"feature layer {i} is outside the base model's hidden states 0..{num_layers} (or -1)")
        out.append(FINAL_HIDDEN_STATE if j == num_layers else j)
    return check_feature_layers(list(dict.fromkeys(out)))


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused op: one call where the written-out formula took seven, the same values in float32
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class FeatureFusion(nn.Module):
    """The layers' hidden states `[..., k * hidden]` (`feature_layers` order, the final state last) ->
    `[..., hidden]`: each raw layer's state RMS-normalised (their scale grows through the residual stream;
    the final state is normalised already), then one Linear over their concatenation, initialised to the
    identity on the final state's slice (`BlockDraftHeads._init_weights`)."""

    def __init__(self, hidden_size: int, num_features: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.norms = nn.ModuleList(RMSNorm(hidden_size) for _ in range(num_features - 1))
        self.linear = nn.Linear(num_features * hidden_size, hidden_size)
        self.linear._bpd_fusion_init = True

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        parts = features.split(self.hidden_size, dim=-1)
        raw = [norm(part) for norm, part in zip(self.norms, parts[:-1])]
        return self.linear(torch.cat([*raw, parts[-1]], dim=-1))

    def checked(self, features: torch.Tensor, feature_layers: list[int], reader: str) -> torch.Tensor:
        """`forward`, after checking that `features` are as wide as `feature_layers`' states concatenated
        (ValueError naming `reader`, the drafting module, otherwise)."""
        if features.shape[-1] != self.in_features:
            raise ValueError(
                f"{reader} read {len(feature_layers)} hidden states of {self.hidden_size} (feature_layers "
                f"{feature_layers}), concatenated: expected features of width {self.in_features}, got "
                f"{features.shape[-1]}"
            )
        return self(features)


def identity_on_final_state(linear: nn.Linear) -> None:
    """A fusion's Linear as the identity on the final state's slice (its last `out_features` inputs): a
    drafter given a new fusion drafts as it did until trained."""
    hidden = linear.out_features
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[:, -hidden:].copy_(torch.eye(hidden, dtype=linear.weight.dtype))
        linear.bias.zero_()


class ResidualBlock(nn.Module):
    """`x + SiLU(W [x; extra] + b)`; `extra_size` > 0 adds an input beside the residual stream."""

    def __init__(self, hidden_size: int, extra_size: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size + extra_size, hidden_size)
        # transformers initialises leaf modules (it never calls _init_weights on this container for
        # custom code), so the tag lets `_init_weights` find the residual Linear.
        self.linear._bpd_zero_init = True
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        inp = x if extra is None else torch.cat([x, extra], dim=-1)
        return x + self.act(self.linear(inp))


def lm_head_fingerprint(lm_head_weight: torch.Tensor, rows: int = 16) -> list[float]:
    """A few numbers that identify an LM head: the sums of `rows` evenly spaced rows. The first form of a
    base model's identity (configs hold it as `base_lm_head_fingerprint`); `lm_head_sketch` replaces it as
    the check, since a sum over a whole row moves with the rounding of every weight in it."""
    idx = torch.linspace(0, lm_head_weight.shape[0] - 1, rows).long()
    return [float(v) for v in lm_head_weight.detach()[idx].float().sum(dim=1).cpu()]


# How far legacy row sums may move and still name the same LM head, in units of sqrt(hidden) x the row's
# standard deviation (rounding each of `hidden` weights by a fraction of the row's scale moves their sum by
# about sqrt(hidden) x that fraction). Set between the largest move of a 4-bit re-quantised copy and the
# smallest of another head of the same shape (measured: see RESULTS.md claim lm_head_sketch_precision).
# Row sums cannot tell a head with permuted columns apart: heads saved since the sketch are checked by it.
ROW_SUM_TOLERANCE = 0.6


def matches_lm_head(lm_head_weight: torch.Tensor, fingerprint: list[float]) -> bool:
    """Whether `lm_head_weight` has this `lm_head_fingerprint` (legacy row sums), in any precision: every
    row sum equal up to dtype rounding (the rule before quantised copies were admitted), or within
    `ROW_SUM_TOLERANCE` of the spread a re-quantisation of the row gives."""
    rows = len(fingerprint)
    idx = torch.linspace(0, lm_head_weight.shape[0] - 1, rows).long()
    sampled = lm_head_weight.detach()[idx].double().cpu()
    got, want = sampled.sum(dim=1), torch.tensor(fingerprint, dtype=torch.float64)
    if torch.allclose(got, want, rtol=1e-2, atol=1e-2 * (1 + want.abs().mean().item())):
        return True
    spread = sampled.shape[1] ** 0.5 * sampled.std(dim=1)
    return bool(((got - want).abs() <= ROW_SUM_TOLERANCE * spread).all())


SKETCH_ROWS = 32
SKETCH_COLUMNS = 32
SKETCH_DIGITS = 4  # significant digits stored: far below any dtype's rounding that matters to the correlation
# Lowest correlation of a sketch with a model's weights that names the same LM head. Every lower precision
# and re-quantisation measured keeps it far above, every other head of the same shape far below (measured:
# see RESULTS.md claim lm_head_sketch_precision).
SKETCH_MIN_CORRELATION = 0.8


def _evenly_spaced(size: int, count: int) -> list[int]:
    return sorted({int(i) for i in torch.linspace(0, size - 1, min(count, size)).round()})


def lm_head_sketch(lm_head_weight: torch.Tensor, rows: int = SKETCH_ROWS, columns: int = SKETCH_COLUMNS) -> dict:
    """A fixed sample of an LM head's weights that recognises it in any precision or quantisation:
    `rows` evenly spaced rows x `columns` evenly spaced columns, with their indices, rounded to
    `SKETCH_DIGITS` significant digits. Compared by `sketch_correlation`."""
    vocab, hidden = lm_head_weight.shape
    row_ids, column_ids = _evenly_spaced(vocab, rows), _evenly_spaced(hidden, columns)
    sample = _sketched_weights(lm_head_weight, row_ids, column_ids)
    weights = [[float(f"{v:.{SKETCH_DIGITS}g}") for v in row] for row in sample.tolist()]
    return {"rows": row_ids, "columns": column_ids, "weights": weights}


def _sketched_weights(lm_head_weight: torch.Tensor, rows: list[int], columns: list[int]) -> torch.Tensor:
    weight = lm_head_weight.detach()
    rows_t = torch.tensor(rows, device=weight.device)
    columns_t = torch.tensor(columns, device=weight.device)
    return weight[rows_t][:, columns_t].double().cpu()


def sketch_correlation(lm_head_weight: torch.Tensor, sketch: dict) -> float:
    """Pearson correlation of `lm_head_weight` at the sketch's indices with the sketch's weights, each
    column centred first: near 1 for the same head in any precision, scale or quantisation, near 0 for
    another. Centring the columns leaves out what all rows of a head share (per-dimension offsets, large in
    trained embeddings), which would make the rows of two different heads correlate. -1 when the indices do
    not fit the weight."""
    rows, columns = sketch["rows"], sketch["columns"]
    vocab, hidden = lm_head_weight.shape
    if not rows or not columns or max(rows) >= vocab or max(columns) >= hidden:
        return -1.0
    got = _sketched_weights(lm_head_weight, rows, columns)
    want = torch.tensor(sketch["weights"], dtype=torch.float64)
    if got.shape != want.shape:
        return -1.0
    got, want = got - got.mean(dim=0), want - want.mean(dim=0)
    norms = got.norm() * want.norm()
    if norms == 0:  # constant columns: nothing to correlate, only equality names the head
        return 1.0 if torch.equal(got, want) else 0.0
    return float((got * want).sum() / norms)


def lm_head_identity(lm_head_weight: torch.Tensor) -> dict:
    """What heads and rescorers record of their base model's LM head: the sketch they are checked by and
    the row sums older hf_bpd versions check, as `base_lm_head_sketch` and `base_lm_head_fingerprint`."""
    return {
        "base_lm_head_fingerprint": lm_head_fingerprint(lm_head_weight),
        "base_lm_head_sketch": lm_head_sketch(lm_head_weight),
    }


def lm_head_mismatch(lm_head_weight: torch.Tensor, sketch: dict | None, fingerprint: list[float] | None) -> str | None:
    """Why `lm_head_weight` is not the recorded base LM head, or None when it is (in any precision): checked
    by the sketch where one is recorded, else by the legacy row sums; nothing recorded names no head."""
    if sketch:
        r = sketch_correlation(lm_head_weight, sketch)
        if r < SKETCH_MIN_CORRELATION:
            return (
                f"its LM-head weights correlate {r:.2f} with theirs; the same model in any precision correlates "
                f"{SKETCH_MIN_CORRELATION} or more"
            )
        return None
    if fingerprint and not matches_lm_head(lm_head_weight, fingerprint):
        return "its LM-head row sums differ from theirs by more than a re-quantisation moves them"
    return None


def _output_embeddings(model: PreTrainedModel) -> nn.Module:
    lm_head = model.get_output_embeddings()
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head) for draft heads to tie to")
    return lm_head


class BlockDraftHeads(PreTrainedModel):
    """h draft heads. `forward(hidden_states [..., hidden]) -> logits [..., h, vocab]`.

    With `tie_lm_head=True` the heads need the base model's LM head: call `bind(base_model)` (which also
    checks that the heads were made for this base model) before `forward`.
    """

    config_class = BlockDraftHeadsConfig
    base_model_prefix = "block_draft_heads"
    main_input_name = "hidden_states"
    _no_split_modules: list[str] = []

    def __init__(self, config: BlockDraftHeadsConfig) -> None:
        super().__init__(config)
        if not 1 <= config.num_heads <= MAX_HEADS:
            raise ValueError(f"num_heads must be in [1, {MAX_HEADS}], got {config.num_heads}")
        if config.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {config.num_layers}")
        if config.hidden_size <= 0 or config.vocab_size <= 0:
            raise ValueError("BlockDraftHeadsConfig needs positive hidden_size and vocab_size")
        if config.token_input and config.num_layers < 1:
            raise ValueError(
                f"token_input {config.token_input!r} needs num_layers >= 1 (the first block reads the token embedding)"
            )
        token = config.hidden_size if config.token_input else 0
        # heads[i][j]: block j of head i (state-dict keys as with nn.Sequential: heads.i.j.linear.*); block 0
        # also reads the token and, for "beside" chains and i > 0, head i-1's state
        extra = [token + (config.hidden_size if config.chain == "beside" and i else 0) for i in range(config.num_heads)]
        self.heads = nn.ModuleList(
            nn.ModuleList(
                ResidualBlock(config.hidden_size, extra[i] if j == 0 else 0) for j in range(config.num_layers)
            )
            for i in range(config.num_heads)
        )
        if not 0 <= config.draft_vocab_size <= config.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, vocab_size], got {config.draft_vocab_size}")
        out_size = config.draft_vocab_size or config.vocab_size
        # Token ids of the draft vocabulary (identity when it is the full vocabulary).
        self.register_buffer("draft_vocab", torch.arange(out_size), persistent=config.draft_vocab_size > 0)
        # Own softmax layer only when not tied; a tied head borrows the base model's rows at `bind` time and
        # keeps them out of the state dict (they are not parameters).
        self.lm_head = None if config.tie_lm_head else nn.Linear(config.hidden_size, out_size, bias=False)
        if config.copy_dim and config.token_input != "previous":
            raise ValueError(
                f"context copy (copy_dim={config.copy_dim}) needs heads that read the token before their target "
                f"(token_input='previous'), got token_input={config.token_input!r}"
            )
        self.context_copy = (
            ContextCopy(config.hidden_size, config.num_heads, config.copy_dim) if config.copy_dim else None
        )
        layers = config.feature_layers
        self.fusion = FeatureFusion(config.hidden_size, len(layers)) if layers else None
        self.__dict__["_tied_weight"] = None
        self.__dict__["_lm_head"] = None
        self.__dict__["_token_embedding"] = None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "_bpd_zero_init", False):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)
        if getattr(module, "_bpd_sink_init", False):  # context copy: the head's own distribution first
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, INITIAL_SINK)
        if getattr(module, "_bpd_fusion_init", False):
            identity_on_final_state(module)

    @staticmethod
    def saved_config(path, **kwargs) -> BlockDraftHeadsConfig:
        """The config of the heads saved in `path`, without their weights; a folder that is not draft heads
        raises ValueError naming the folder."""
        return saved_config(BlockDraftHeadsConfig, path, "draft-heads", **kwargs)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs) -> BlockDraftHeads:
        """Load saved heads; a folder that is not draft heads, or a corrupt file, raises ValueError
        naming the folder."""
        return load_saved(super().from_pretrained, BlockDraftHeadsConfig, path, "draft-heads", *args, **kwargs)

    @classmethod
    def for_base_model(
        cls,
        model: PreTrainedModel,
        num_heads: int = 4,
        num_layers: int = 1,
        tie_lm_head: bool = True,
        draft_vocab: torch.Tensor | None = None,
        use_next_token: bool = False,
        token_input: str | None = None,
        copy_dim: int = 0,
        feature_layers: list[int] | None = None,
        chain: str = "",
    ) -> BlockDraftHeads:
        """Untrained heads that fit `model` (hidden size, vocabulary, LM head fingerprint), bound to it.
        `draft_vocab`: token ids the heads may draft (default: all); `token_input`: which token embedding
        the heads also read, "next", "previous" or "" (module docstring; `use_next_token=True` is
        `token_input="next"`); `copy_dim`: width of the context-copy pointer (0: none); `feature_layers`:
        the hidden states the heads read a fusion of (module docstring; None: the final one alone); `chain`:
        how head i > 1 reads head i-1's state, "state" or "beside" ("": it does not; module docstring)."""
        lm_head = _output_embeddings(model)
        if feature_layers is not None:
            from .layer_features import decoder_layers

            feature_layers = normalise_feature_layers(feature_layers, len(decoder_layers(model)))
        config = BlockDraftHeadsConfig(
            base_model_name=getattr(model.config, "_name_or_path", "") or "",
            base_model_type=getattr(model.config, "model_type", "") or "",
            hidden_size=lm_head.weight.shape[1],
            vocab_size=lm_head.weight.shape[0],
            num_heads=num_heads,
            num_layers=num_layers,
            tie_lm_head=tie_lm_head,
            **lm_head_identity(lm_head.weight),
            draft_vocab_size=0 if draft_vocab is None else int(draft_vocab.numel()),
            use_next_token=use_next_token,
            token_input=token_input,
            copy_dim=copy_dim,
            feature_layers=feature_layers,
            chain=chain,
        )
        heads = cls(config)
        if draft_vocab is not None:
            set_draft_vocab(heads, draft_vocab, config.vocab_size)
        heads = heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        if not tie_lm_head:
            heads.lm_head.weight.data.copy_(lm_head.weight.data[heads.draft_vocab])
        return heads.bind(model)

    def check_compatible(self, model: PreTrainedModel) -> None:
        """Raise ValueError when these heads were made for another base model."""
        lm_head = _output_embeddings(model)
        vocab, hidden = lm_head.weight.shape
        cfg = self.config
        where = f"draft heads for `{cfg.base_model_name or 'unknown'}`"
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if hidden != cfg.hidden_size:
            raise ValueError(f"{where} expect hidden size {cfg.hidden_size}, but base model `{name}` has {hidden}")
        if vocab != cfg.vocab_size:
            raise ValueError(f"{where} expect vocabulary size {cfg.vocab_size}, but base model `{name}` has {vocab}")
        why = lm_head_mismatch(lm_head.weight, cfg.base_lm_head_sketch, cfg.base_lm_head_fingerprint)
        if why:
            raise ValueError(
                f"{where} were trained on a base model with other LM-head weights than `{name}` "
                f"(fingerprint mismatch: {why}): they would draft garbage. Train heads for this model."
            )

    def bind(self, model: PreTrainedModel) -> BlockDraftHeads:
        """Check compatibility with `model` and borrow its LM head (when tied). Returns self."""
        self.check_compatible(model)
        if self.config.feature_layers:  # every layer read must exist
            from .layer_features import decoder_layers

            deepest, depth = max(self.config.feature_layers), len(decoder_layers(model))
            if deepest >= depth:
                raise ValueError(
                    f"these draft heads read hidden state {deepest} (feature_layers {self.config.feature_layers}), "
                    f"but the base model has {depth} decoder layers (hidden states 0..{depth}, the last one -1)"
                )
        weight = _output_embeddings(model).weight
        self.__dict__["_lm_head"] = weight.detach()  # every row: `context_vocab.py`
        if self.config.draft_vocab_size:  # a copy of the draft rows: S x hidden, not the full V x hidden
            weight = weight.detach()[self.draft_vocab.to(weight.device)]
        self.__dict__["_tied_weight"] = weight
        if self.config.token_input:
            embedding = model.get_input_embeddings()
            shape = None if embedding is None else tuple(embedding.weight.shape)
            if shape is None or shape[0] < self.config.vocab_size or shape[1] != self.config.hidden_size:
                raise ValueError(
                    "draft heads that read a token need base input embeddings of at least "
                    f"{self.config.vocab_size} x {self.config.hidden_size}, got {shape}"
                )
            # beside the LM head, where the heads run (a model split over devices may keep them apart)
            self.__dict__["_token_embedding"] = embedding.weight.detach().to(weight.device)
        return self

    def first_heads(self, n: int) -> BlockDraftHeads:
        """A copy with only heads 1..n (the later heads are the least accurate; measuring τ with fewer
        heads is how the shipped h is chosen). Bound to the same base model."""
        if not 1 <= n <= self.num_heads:
            raise ValueError(f"n must be in [1, {self.num_heads}], got {n}")
        state = {}
        for key, value in self.state_dict().items():
            parts = key.split(".")  # heads.<i>.* and context_copy.{query,sink}.<i>.* belong to head i
            per_head = parts[0] == "heads" or parts[:2] in (["context_copy", "query"], ["context_copy", "sink"])
            if per_head and int(parts[1 if parts[0] == "heads" else 2]) >= n:
                continue
            state[key] = value[:n] if key == "context_copy.distance_bias" else value
        return self._variant(state, num_heads=n)[0]

    def _variant(
        self, state: dict[str, torch.Tensor], strict: bool = True, **config_changes
    ) -> tuple[BlockDraftHeads, object]:
        """Heads of this config with `config_changes`, holding `state`, bound to the same base model (the
        borrowed LM-head rows and embeddings are shared), and what `load_state_dict` reported."""
        config = BlockDraftHeadsConfig.from_dict({**self.config.to_dict(), **config_changes})
        with torch.random.fork_rng(devices=[]):  # overwritten by `state`: leave the global stream alone
            heads = type(self)(config).to(device=self.device, dtype=self.dtype)
        result = heads.load_state_dict(state, strict=strict)
        heads.__dict__["_tied_weight"] = self.__dict__["_tied_weight"]
        heads.__dict__["_lm_head"] = self.__dict__["_lm_head"]
        heads.__dict__["_token_embedding"] = self.__dict__["_token_embedding"]
        return heads, result

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def conditions_on_draft(self) -> bool:
        """Whether head i > 1 reads the drafted token before its target (`token_input="previous"`): drafting
        then expands the tree depth by depth with `step` instead of one lattice call."""
        return self.config.token_input == "previous"

    def teacher_forced_tokens(self, continuation: torch.Tensor) -> torch.Tensor | None:
        """The tokens these heads read at positions whose true continuation is known (training, analysis):
        `continuation [n, m]` holds tokens t+1, t+2, ... (negative past the end). "next" heads: `[n]`
        token t+1; "previous" heads: `[n, h]` tokens t+1..t+h, so each head reads the true token before
        its target (in decoding it reads the drafted one, which matters only where the draft so far is
        right); plain heads: None. Past the end any token will do: the head reading it has no target."""
        kind = self.config.token_input
        if not kind:
            return None
        if kind == "next":
            return continuation[:, 0]
        tokens = continuation[:, : self.num_heads].clamp(min=0)
        if tokens.shape[1] < self.num_heads:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], self.num_heads - tokens.shape[1])], dim=1)
        return tokens

    def head_states(self, hidden_states: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Residual-block outputs `[..., h, hidden]`, before the softmax layer (training computes the
        vocabulary projection head by head to bound memory). `tokens`: for "next" heads `[...]`, token t+1
        at each position (the base model's own choice); for "previous" heads `[..., h]`, tokens t+1..t+h
        (head i reads `tokens[..., i-1]`; in training the true continuation, i.e. teacher forcing);
        ignored by plain heads."""
        kind = self.config.token_input
        if kind == "previous":
            want = (*hidden_states.shape[:-1], self.num_heads)
            if tokens is None or tuple(tokens.shape) != want:
                got = None if tokens is None else tuple(tokens.shape)
                raise ValueError(
                    f"these draft heads read the token before each head's target (token_input='previous'): pass "
                    f"tokens of shape {want} (tokens t+1..t+h), got {got}"
                )
            states, state = [], None
            for i in range(self.num_heads):
                state = self.step(i, hidden_states, tokens[..., i], state)
                states.append(state)
            return torch.stack(states, dim=-2)
        extra = self._embed(hidden_states, tokens) if kind else None
        return torch.stack([self._head(i, hidden_states, extra) for i in range(self.num_heads)], dim=-2)

    def step(
        self,
        i: int,
        hidden_states: torch.Tensor,
        tokens: torch.Tensor | None = None,
        parent_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The state `[..., hidden]` of head `i` (0-based) alone, reading `tokens [...]` (for "previous"
        heads the token before its target; for "next" heads token t+1; ignored by plain heads). Drafting
        with "previous" heads calls it once per tree depth on all the nodes it expands. `parent_states
        [..., hidden]`: chained heads with i > 0 read head i-1's state at each node's parent (what this
        method returned for it); ignored otherwise."""
        chain = self.config.chain if i else ""
        if chain and (parent_states is None or parent_states.shape != hidden_states.shape):
            got = None if parent_states is None else tuple(parent_states.shape)
            raise ValueError(
                f"chained draft heads ({chain!r}): head {i + 1} reads head {i}'s state at each node's parent, of "
                f"shape {tuple(hidden_states.shape)}; got {got}"
            )
        x = parent_states if chain == "state" else hidden_states
        extra = self._embed(hidden_states, tokens) if self.config.token_input else None
        if chain == "beside":
            extra = torch.cat([extra, parent_states.to(extra.dtype)], dim=-1)
        return self._head(i, x, extra)

    @property
    def chained(self) -> bool:
        """Whether head i > 1 reads head i-1's state (`chain`): drafting then keeps each node's state."""
        return bool(self.config.chain)

    def with_chain(self, chain: str) -> BlockDraftHeads:
        """A chained copy of these unchained "previous" heads (same weights, draft vocabulary and binding).
        "state": head i > 1 reads head i-1's state in place of the hidden state (head 1 drafts as before, the
        later heads need training for their new input); "beside": head i > 1 reads it beside the hidden state
        through new weights that start at zero, so the copy drafts exactly as these heads until trained."""
        if self.chained:
            raise ValueError(f"these heads are chained already ({self.config.chain!r})")
        state = self.state_dict()
        if chain == "beside":  # zero columns for the parent's state in block 0 of heads 2..h
            for i in range(1, self.num_heads):
                key = f"heads.{i}.0.linear.weight"
                state[key] = torch.cat(
                    [state[key], state[key].new_zeros(state[key].shape[0], self.config.hidden_size)], 1
                )
        return self._variant(state, chain=chain)[0]

    def with_num_layers(self, num_layers: int) -> BlockDraftHeads:
        """A deeper copy of these heads (same weights, draft vocabulary and binding): each head gains residual
        blocks up to `num_layers`, after its own, whose weights start at zero. A zero block is the identity
        (`x + SiLU(0)`), so the copy drafts exactly as these heads until trained."""
        have = self.config.num_layers
        if num_layers < have:
            raise ValueError(f"these heads have {have} residual blocks each: they can grow, not shrink to {num_layers}")
        if not have:
            raise ValueError("heads without residual blocks have no first block to keep: train new ones instead")
        state = self.state_dict()
        hidden = self.config.hidden_size
        like = state["heads.0.0.linear.bias"]
        for i in range(self.num_heads):
            for j in range(have, num_layers):
                state[f"heads.{i}.{j}.linear.weight"] = like.new_zeros(hidden, hidden)
                state[f"heads.{i}.{j}.linear.bias"] = like.new_zeros(hidden)
        return self._variant(state, num_layers=num_layers)[0]

    def _head(self, i: int, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        for j, block in enumerate(self.heads[i]):
            x = block(x, extra if j == 0 else None)
        return x

    def _embed(self, hidden_states: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        if tokens is None or tuple(tokens.shape) != tuple(hidden_states.shape[:-1]):
            got = None if tokens is None else tuple(tokens.shape)
            what = "token t+1 (next_tokens)" if self.config.token_input == "next" else "a token"
            raise ValueError(
                f"these draft heads read {what} at each position: expected tokens of shape "
                f"{tuple(hidden_states.shape[:-1])}, got {got}"
            )
        weight = self.__dict__["_token_embedding"]
        if weight is None:
            raise RuntimeError("draft heads that read a token need the base model's embeddings: call bind(model)")
        embedded = torch.nn.functional.embedding(tokens.to(weight.device), weight)
        return embedded.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def with_feature_layers(self, feature_layers: list[int], model: PreTrainedModel | None = None) -> BlockDraftHeads:
        """A copy of these last-layer heads (same weights, draft vocabulary and binding) reading a fusion of
        `feature_layers` through a new fusion that starts as the identity on the final hidden state: they
        draft exactly as these heads until trained. `model`: the base model, to resolve negative indices
        other than -1 (`normalise_feature_layers`)."""
        if self.fusion is not None:
            raise ValueError(f"these heads already read feature layers {self.config.feature_layers}")
        if model is not None:
            from .layer_features import decoder_layers

            feature_layers = normalise_feature_layers(feature_layers, len(decoder_layers(model)))
        heads, (missing, unexpected) = self._variant(
            self.state_dict(), strict=False, feature_layers=check_feature_layers(feature_layers)
        )
        if unexpected or any(not k.startswith("fusion.") for k in missing):
            raise RuntimeError(f"unexpected weights moving heads to feature layers: {unexpected or missing}")
        return heads

    @property
    def feature_layers(self) -> list[int] | None:
        """The hidden states these heads read a fusion of (`output_hidden_states` indices, -1 the final
        one), or None: the final hidden state alone."""
        return self.config.feature_layers

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The state the heads read: `features [..., k * hidden]` (the `feature_layers`' hidden states,
        concatenated in that order) through the fusion -> `[..., hidden]`; heads without feature layers
        read the final hidden state itself (returned as is)."""
        if self.fusion is None:
            return features
        return self.fusion.checked(features, self.config.feature_layers, "these draft heads")

    def with_context_copy(self, copy_dim: int) -> BlockDraftHeads:
        """A copy of these heads (same weights and draft vocabulary, bound to the same base model) with a
        new, untrained context-copy pointer of width `copy_dim` (`context_copy.py`)."""
        if self.context_copy is not None:
            raise ValueError(f"these heads already have a context-copy pointer (copy_dim {self.config.copy_dim})")
        heads, (missing, unexpected) = self._variant(self.state_dict(), strict=False, copy_dim=copy_dim)
        if unexpected or any(not k.startswith("context_copy.") for k in missing):
            raise RuntimeError(f"unexpected weights moving heads to context copy: {unexpected or missing}")
        return heads

    def without_context_copy(self) -> BlockDraftHeads:
        """These heads without their context-copy pointer (their own distribution alone; an ablation),
        bound to the same base model."""
        own = {k: v for k, v in self.state_dict().items() if not k.startswith("context_copy.")}
        return self._variant(own, copy_dim=0)[0]

    def copy_memory(self, context: torch.Tensor, lengths: torch.Tensor | None = None) -> CopyMemory | None:
        """The context-copy memory of `context [B, L]` token ids (each row ending with the tree's root;
        `lengths [B]` for right-padded rows), or None for heads without context copy."""
        if self.context_copy is None:
            return None
        weight = self.__dict__["_token_embedding"]
        if weight is None:
            raise RuntimeError("context-copy heads need the base model's embeddings: call bind(model)")
        return self.context_copy.memory(context, weight, lengths)

    def copy_weights(
        self, i: torch.Tensor, states: torch.Tensor, before: torch.Tensor, memory: CopyMemory
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log weight of the head's own distribution `[n]`, log weight of each memory key `[n, L]`) for rows
        drafted by head `i [n]` (0-based) from head states `[n, H]`; `before [n]`: the token before the one
        each head read (`context_copy.py`)."""
        weight = self.__dict__["_token_embedding"]
        if weight is None:
            raise RuntimeError("context-copy heads need the base model's embeddings: call bind(model)")
        before_embedding = torch.nn.functional.embedding(before.to(weight.device), weight).to(states)
        return self.context_copy.attention(i.to(states.device), states, before_embedding, memory)

    def top_tokens(
        self,
        states: torch.Tensor,
        top_k: int,
        i: torch.Tensor | None = None,
        before: torch.Tensor | None = None,
        memory: CopyMemory | None = None,
        extension: VocabExtension | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head states `[n, hidden]` -> their top-k token ids and log-probabilities, `[n, k]` each. With
        context copy (`memory` given): the mixture of each head's own distribution and its pointer into the
        context, over the whole vocabulary; `i [n]` is each row's head (0-based) and `before [n]` the token
        before the one it read. With an `extension` (heads tied to the base model's LM head, no context
        copy): over the draft vocabulary and the extension's context tokens, in one softmax
        (`context_vocab.py`)."""
        logits = self.project(states)
        ids = self.draft_vocab if self.config.draft_vocab_size else None
        if memory is None or self.context_copy is None:
            return extended_top_k(logits, states, ids, extension, top_k)
        logits = logits.float()
        sink, keys = self.copy_weights(i, states, before, memory)
        if memory.values.shape[0] == 1:  # one memory for every row (drafting): no [n, V] tensor
            ids = None if ids is None else ids.to(logits.device)
            return mixture_top_k(logits.log_softmax(-1), ids, self.draft_index(), sink, keys, memory.values, top_k)
        mixed = mixed_logprobs(logits.log_softmax(-1), ids, self.config.vocab_size, sink, keys, memory.values)
        values, index = mixed.topk(top_k, dim=-1)
        return index, values

    def draft_index(self) -> torch.Tensor | None:
        """Token id -> index in the draft vocabulary (-1 outside it: no head can draft it), made once; None
        for heads that draft the whole vocabulary."""
        if not self.config.draft_vocab_size:
            return None
        index = self.__dict__.get("_draft_index_cache")
        if index is None or index.device != self.draft_vocab.device:
            index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.draft_vocab.device)
            index[self.draft_vocab] = torch.arange(self.draft_vocab.numel(), device=index.device)
            self.__dict__["_draft_index_cache"] = index
        return index

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """The softmax layer: `[..., hidden] -> [..., S]` logits over the draft vocabulary (`draft_vocab`
        maps index -> token id; S = vocab size unless a draft vocabulary is set)."""
        if self.lm_head is not None:
            return self.lm_head(states)
        return self.base_logits(states)

    def base_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The base model's own logits over the draft vocabulary, `[..., hidden] -> [..., S]`: its LM head
        (the rows `bind` borrowed) on its last hidden state. The soft target of teacher distillation."""
        weight = self.__dict__["_tied_weight"]
        if weight is None:
            raise RuntimeError("draft heads need the base model's LM head: call `heads.bind(model)` first")
        if weight.device != hidden_states.device or weight.dtype != hidden_states.dtype:
            weight = weight.to(device=hidden_states.device, dtype=hidden_states.dtype)
            self.__dict__["_tied_weight"] = weight  # converted once, not at every drafting step
        return packed_or_plain_linear(hidden_states, weight)  # the drafter's packed kernels on a CPU

    def packed_extra_weights(self) -> tuple[torch.Tensor, ...]:
        """Weights the heads run that are no `nn.Linear` of theirs, for the kernel plan to measure and pack
        (`binding.heads_kernels`): the LM-head rows `bind` borrowed, once bound."""
        rows = self.__dict__["_tied_weight"]
        return () if rows is None else (rows,)

    def push_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload block draft heads",
        **card_kwargs,
    ) -> str:
        """Upload weights, config and a model card rendered with real numbers (`card_kwargs`:
        training_log, bench, manifest, top_k, max_tree_tokens; see `hf_bpd.card.render_card`)."""
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            save_hub_folder(self, folder, repo_id, **card_kwargs)
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
        return str(info)

    def copy_target_logprobs(
        self, hidden_states: torch.Tensor, tokens: torch.Tensor, targets: CopyTargets
    ) -> torch.Tensor:
        """log p(target) `[n, h]` of each head's pointer-generator mixture at teacher-forced positions:
        `hidden_states [n, hidden]`, `tokens [n, h]` the token each head reads; -inf where neither the head
        nor the context holds the target (training skips those)."""
        memory = self.copy_memory(targets.context, targets.lengths)
        out = []
        for i in range(self.num_heads):
            state = self.step(i, hidden_states, tokens[:, i])
            head_logprobs = self.project(state).float().log_softmax(-1)
            index = torch.full_like(tokens[:, i], i)
            sink, keys = self.copy_weights(index, state, targets.before[:, i], memory)
            out.append(
                target_logprob(
                    head_logprobs, targets.head_targets[:, i], sink, keys, memory.values, targets.targets[:, i]
                )
            )
        return torch.stack(out, dim=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_tokens: torch.Tensor | None = None,
        return_states: bool = False,
        copy_targets: CopyTargets | None = None,
    ) -> torch.Tensor:
        """`[..., hidden]` base hidden states (and the tokens the heads read, see `head_states`) ->
        `[..., h, S]` draft logits; with `return_states`, the `head_states` before the softmax layer (the
        training loss projects head by head, but must call the module itself so that a data-parallel
        wrapper synchronises gradients); with `copy_targets`, `copy_target_logprobs` (training the
        context-copy pointer, through the module for the same reason). Heads with `feature_layers` take
        either the layers' features `[..., k * hidden]`, fused here (training: the fusion learns through the
        module), or the already fused state `[..., hidden]` (decoding fuses once per verified node:
        `layer_features.py`)."""
        if self.fusion is not None and hidden_states.shape[-1] == self.fusion.in_features:
            hidden_states = self.fusion(hidden_states)
        if copy_targets is not None:
            return self.copy_target_logprobs(hidden_states, next_tokens, copy_targets)
        states = self.head_states(hidden_states, next_tokens)
        return states if return_states else self.project(states)
