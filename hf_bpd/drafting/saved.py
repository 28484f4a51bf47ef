"""What the drafting modules (draft heads, an EAGLE draft layer) share: loading a saved one, its config checked
first so that a folder of something else is refused by name before any weight is read, and setting a new one's
draft vocabulary."""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors import SafetensorError
from transformers import PretrainedConfig


class DraftingModuleConfig(PretrainedConfig):
    """The fields every drafting module's config records of its base model: which model it was trained on
    (name and type), its widths, the draft vocabulary's size (0: the full vocabulary), and what recognises
    its LM head in any precision (`heads.lm_head_identity`): row sums, which every version writes and older
    readers check alone, and a sample of its weights (`lm_head_sketch`; configs written before it have none
    and are checked by the row sums)."""

    def __init__(
        self,
        base_model_name: str = "",
        base_model_type: str = "",
        hidden_size: int = 0,
        vocab_size: int = 0,
        draft_vocab_size: int = 0,
        base_lm_head_fingerprint: list[float] | None = None,
        base_lm_head_sketch: dict | None = None,
        **kwargs,
    ) -> None:
        self.base_model_name = base_model_name
        self.base_model_type = base_model_type
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.base_lm_head_fingerprint = base_lm_head_fingerprint
        self.base_lm_head_sketch = base_lm_head_sketch
        super().__init__(**kwargs)


def saved_config(config_class, path, kind: str, **kwargs):
    """The `config_class` config saved in `path`, without the weights; ValueError naming the folder where it holds
    no readable config.json or another kind of module (`kind`: what the errors call this one)."""
    try:
        config_dict, _ = config_class.get_config_dict(path, **kwargs)
    except OSError as err:
        raise ValueError(f"{path} holds no readable {kind} config.json: {err}") from err
    if config_dict.get("model_type") != config_class.model_type:
        raise ValueError(
            f"{path} is not a {kind} checkpoint (model_type {config_dict.get('model_type')!r}, expected "
            f"{config_class.model_type!r})"
        )
    return config_class.from_dict(config_dict)


def load_saved(from_pretrained: Callable, config_class, path, kind: str, *args, **kwargs):
    """`from_pretrained(path, ...)` (a module class's `PreTrainedModel.from_pretrained`) after `saved_config`'s
    check; a corrupt or incomplete file raises ValueError naming the folder. Its draft vocabulary is the identity
    where none was saved (transformers leaves that buffer uninitialised)."""
    saved_config(config_class, path, kind, **kwargs)
    try:
        # the weights are loaded, not drawn: module initialisation must not move a user's seeded stream
        with torch.random.fork_rng(devices=[]):
            module = from_pretrained(path, *args, **kwargs)
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:
        raise ValueError(
            f"could not load the {kind} checkpoint in {path} (corrupt or incomplete file?): {err}"
        ) from err
    if not module.config.draft_vocab_size:
        module.draft_vocab = torch.arange(module.config.vocab_size, device=module.draft_vocab.device)
    return module


def set_draft_vocab(module, draft_vocab, vocab_size: int) -> None:
    """Copy `draft_vocab` (token ids) into a new module's `draft_vocab` buffer; ValueError unless the ids are
    distinct and inside the vocabulary of `vocab_size` tokens."""
    ids = torch.as_tensor(draft_vocab, dtype=torch.long)
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError("draft_vocab must hold distinct token ids inside the vocabulary")
    module.draft_vocab.copy_(ids)
