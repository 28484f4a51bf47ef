"""Local lattice rescoring with a small causal LM that shares the base model's tokenizer (paper Alg. 2).

Left to right over the lattice positions j = 1..h, greedily:

    z_j[S_j] += alpha * r_j[S_j]        r_j = the small LM's log-probabilities after
    w_j = argmax over S_j                     (accepted text, w_1 .. w_{j-1})

S_j is head j's top-k. Only the scores of S_j are ever compared, and a full-vocabulary log-softmax
differs from a softmax over S_j by a constant per position, so r_j is computed for the k tokens of S_j
alone (k rows of the output embedding, not the whole vocabulary): the small LM's cost is its layers.

The small LM keeps its own KV cache of the accepted text across decoding steps: each step feeds only
the tokens accepted since the last one, drafts h - 1 tokens on top, then crops back, so a step costs
h short forwards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...compat import cache_argument
from ..lattice import Lattice, ScoredPath
from ..vocab import check_same_tokenizer, model_vocab_size


class NeuralRescorer:
    """Greedy local rescoring of each lattice position with a small causal LM (`lm`).

    alpha:     weight of the small LM's log-probabilities.
    tokenizer: the small LM's tokenizer; with `base_tokenizer`, both are compared now, else the
               vocabulary sizes and special token ids are compared when the drafter binds the base model.
    """

    one_row_only = True  # its LM keeps one KV cache: batched calls are refused before the prefill

    def __init__(self, lm=None, alpha: float = 0.5, tokenizer=None, base_tokenizer=None, layers=None) -> None:
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if (lm is None) == (layers is None):
            raise ValueError("NeuralRescorer needs either an LM or a truncated-LM layers folder (`layers=`)")
        if tokenizer is not None and base_tokenizer is not None:
            check_same_tokenizer(tokenizer, base_tokenizer)
        self.lm = lm.eval() if lm is not None else None
        self.layers = Path(layers) if layers is not None else None
        self.alpha = alpha
        self.tokenizer = tokenizer
        self.reset()

    @classmethod
    def from_pretrained(cls, path: str | Path, base_tokenizer=None, **kwargs) -> NeuralRescorer:
        """A folder from `hf-bpd train-rescorer` (fine-tuned first layers of the base model, built on the
        base model when the drafter binds it) or any saved causal LM folder (its tokenizer beside it, if
        saved, is checked against `base_tokenizer`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if (Path(path) / TRUNCATED_LM_CONFIG).is_file():
            return cls(layers=path, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = None
        if (Path(path) / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(lm, tokenizer=tokenizer, base_tokenizer=base_tokenizer, **kwargs)

    def bind(self, model) -> None:
        """The rescorer LM must score the base model's token ids: same vocabulary and special tokens."""
        if self.layers is not None:
            self.lm = load_truncated_lm(model, self.layers)
        vocab, lm_vocab = model_vocab_size(model), model_vocab_size(self.lm)
        if lm_vocab != vocab:
            raise ValueError(
                f"the rescorer LM has a vocabulary of {lm_vocab} tokens, the base model {vocab}: "
                "it must share the base model's tokenizer"
            )
        for name in ("bos_token_id", "eos_token_id"):
            a, b = getattr(self.lm.config, name, None), getattr(model.config, name, None)
            if a is not None and b is not None and a != b:
                raise ValueError(
                    f"the rescorer LM's {name} is {a}, the base model's {b}: it must share the base model's tokenizer"
                )
        param = next(model.parameters())
        self.lm.to(param.device)
        self.reset()

    def reset(self) -> None:
        self._cache = None
        self._cached: list[int] = []

    def _forward(self, ids: list[int], device) -> torch.Tensor:
        """Feed ids after the cache; return the last position's hidden state."""
        from transformers import DynamicCache

        if self._cache is None:
            self._cache = DynamicCache(config=self.lm.config)
        start = len(self._cached)
        decoder = self.lm.get_decoder()
        out = decoder(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(start, start + len(ids), device=device)[None],
            **{cache_argument(decoder): self._cache},
            use_cache=True,
        )
        self._cached.extend(ids)
        return out.last_hidden_state[0, -1]

    def _crop(self, length: int) -> None:
        if self._cache is not None and len(self._cached) > length:
            self._cache.crop(length - len(self._cached))  # transformers 5: a negative count removes tokens
            del self._cached[length:]

    def __call__(self, lattice: Lattice, context: torch.Tensor) -> list[list[ScoredPath]]:
        if lattice.batch_size != 1:
            raise ValueError("NeuralRescorer keeps one KV cache: batch size 1 only")
        accepted = context[0].tolist()
        device = self.lm.get_output_embeddings().weight.device
        with torch.no_grad():
            # Reuse the cache for the common prefix; keep at least the last token to feed.
            common = 0
            limit = min(len(self._cached), len(accepted) - 1)
            while common < limit and self._cached[common] == accepted[common]:
                common += 1
            self._crop(common)
            hidden = self._forward(accepted[common:], device)
            out_emb = self.lm.get_output_embeddings().weight
            tokens, logprobs = lattice.tokens[0].to(device), lattice.logprobs[0].to(device)
            path, accept = [], []
            score = 0.0
            for j in range(lattice.num_positions):
                if j:
                    hidden = self._forward([path[-1]], device)
                r = torch.log_softmax(out_emb[tokens[j]].float() @ hidden.float(), dim=-1)
                z = logprobs[j] + self.alpha * r
                best = int(z.argmax())
                path.append(int(tokens[j, best]))
                score += float(z[best])
                # acceptance estimate: the heads' top-k mass, shared out by the rescored scores
                accept.append(float(torch.logsumexp(logprobs[j], 0) + torch.log_softmax(z, 0)[best]))
            self._crop(len(accepted))
        return [[ScoredPath(tuple(path), score, tuple(accept))]]


def truncated_lm(model, num_layers: int):
    """A small LM from the base model's first `num_layers` layers (embeddings, final norm and head kept):
    the starting point `training/train_rescorer.py` fine-tunes. Shares the tokenizer by construction."""
    import copy

    config = copy.deepcopy(model.config)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    small = type(model)(config)
    state = {k: v for k, v in model.state_dict().items() if (_layer_index(k) or 0) < num_layers}
    missing, unexpected = small.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ValueError(f"could not copy the base model's layers: missing {missing}, unexpected {unexpected}")
    small.tie_weights()
    return small.to(next(model.parameters()).dtype).eval()


TRUNCATED_LM_CONFIG = "truncated_lm.json"
TRUNCATED_LM_WEIGHTS = "layers.safetensors"


def _own_weights(lm) -> dict[str, torch.Tensor]:
    """What a truncated LM adds to the base model: everything but the (shared) embeddings and head."""
    skip = {id(lm.get_input_embeddings().weight), id(lm.get_output_embeddings().weight)}
    return {
        k: v for k, v in lm.state_dict().items() if id(v) not in skip and "embed_tokens" not in k and "lm_head" not in k
    }


def save_truncated_lm(lm, folder: str | Path, base_model) -> None:
    """Save only the layers and final norm (fp16), plus what they must be rebuilt on."""
    import json

    from safetensors.torch import save_file

    from ..heads import lm_head_identity

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to(torch.float16).contiguous() for k, v in _own_weights(lm).items()},
        str(folder / TRUNCATED_LM_WEIGHTS),
    )
    meta = {
        "format": "hf_bpd-truncated-lm-v1",
        "num_layers": lm.config.num_hidden_layers,
        "hidden_size": lm.config.hidden_size,
        "vocab_size": model_vocab_size(lm),
        **lm_head_identity(base_model.get_output_embeddings().weight),
    }
    (folder / TRUNCATED_LM_CONFIG).write_text(json.dumps(meta, indent=2))


def load_truncated_lm(model, folder: str | Path):
    """Rebuild a `save_truncated_lm` folder on `model` (its base); raises if it was made for another."""
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..heads import lm_head_mismatch

    folder = Path(folder)
    try:
        meta = json.loads((folder / TRUNCATED_LM_CONFIG).read_text())
        weights = load_file(str(folder / TRUNCATED_LM_WEIGHTS))
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise ValueError(f"{folder} is not a readable truncated-LM rescorer folder: {e}") from e
    weight = model.get_output_embeddings().weight
    # a folder that records neither form of the base model's identity names none: checked as one that differs
    why = lm_head_mismatch(weight, meta.get("base_lm_head_sketch"), meta.get("base_lm_head_fingerprint") or [0.0])
    if why:
        raise ValueError(
            f"the rescorer in {folder} was trained on another base model (output head fingerprint differs: {why})"
        )
    lm = truncated_lm(model, meta["num_layers"])
    own = _own_weights(lm)
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise ValueError(f"the rescorer weights in {folder} do not fit a {meta['num_layers']}-layer cut of this model")
    lm.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)
    return lm.eval()


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None
