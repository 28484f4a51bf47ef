"""A draft vocabulary extended by the context's own tokens (`BlockDrafter(context_vocab=True)`).

Heads and EAGLE layers draft over a draft vocabulary (8,192 tokens, say, of the base model's 49k or 262k): a
token outside it can never be proposed. Most of the tokens greedy decoding emits outside it are names,
numbers and words the prompt or the answer so far already holds (`research.draft_vocab_coverage`). A drafting
module whose softmax is the base model's LM head over the draft vocabulary can score those tokens too, with
their LM-head rows, in the same softmax: this module gathers the context's tokens outside the draft
vocabulary as the context grows (`ContextVocab`) and takes the top-k over the extended vocabulary
(`extended_top_k`). A drafting module provides `draft_vocab`, `config.draft_vocab_size` and the base model's
LM head, borrowed at `bind` (`__dict__["_lm_head"]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


@dataclass
class VocabExtension:
    """The tokens a module may draft: `ids [S + E]`, its draft vocabulary followed by E context tokens outside
    it, and those E tokens' LM-head rows `[E, H]`."""

    ids: torch.Tensor
    rows: torch.Tensor


@dataclass
class ContextVocab:
    """The context's tokens outside a module's draft vocabulary, gathered as the context grows: `extension`
    (None until one is found), and `tokens`, the same on the host."""

    tokens: set[int] = field(default_factory=set)
    extension: VocabExtension | None = None

    def add(self, module, tokens: list[int]) -> None:
        """Extend by the tokens of `tokens` outside `module`'s draft vocabulary and not added before (none for
        a module drafting the whole vocabulary)."""
        if not module.config.draft_vocab_size:
            return
        inside = module.__dict__.get("_draft_vocab_set")
        if inside is None:
            inside = module.__dict__["_draft_vocab_set"] = frozenset(module.draft_vocab.tolist())
        new = [t for t in dict.fromkeys(tokens) if t not in inside and t not in self.tokens]
        if not new:
            return
        weight = module.__dict__.get("_lm_head")
        if weight is None:
            raise RuntimeError("a context vocabulary borrows the base model's LM head: bind the module first")
        self.tokens.update(new)
        device = module.draft_vocab.device
        ids = torch.tensor(new, dtype=torch.long, device=device)
        rows = weight[ids.to(weight.device)].to(device, module.dtype)
        if self.extension is None:
            self.extension = VocabExtension(torch.cat([module.draft_vocab, ids]), rows)
        else:
            old = self.extension
            self.extension = VocabExtension(torch.cat([old.ids, ids]), torch.cat([old.rows, rows]))


def context_vocab_refusal(config: dict) -> str | None:
    """Why a drafting module of `config` (its saved config, as a dict) cannot draft a context vocabulary, or
    None: an EAGLE layer can;
    heads only where they read the drafted token, score with the base model's LM head and have no context
    copy (theirs already reaches the context's tokens)."""
    if config.get("model_type") != "block_draft_heads":
        return None
    if config.get("copy_dim"):
        return "these heads reach the context's tokens through their context copy"
    if not config.get("tie_lm_head", True):
        return (
            "it scores the context's tokens with the base model's LM-head rows: these heads have a softmax of "
            "their own (tie_lm_head=False)"
        )
    if config.get("token_input") != "previous":
        return (
            "it serves EAGLE layers and heads that read the drafted token (token_input='previous'), not "
            f"token_input={config.get('token_input')!r}"
        )
    return None


def extended_top_k(
    logits: torch.Tensor,
    states: torch.Tensor,
    draft_ids: torch.Tensor | None,
    extension: VocabExtension | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and log-probabilities `[n, k]` of `logits [n, S]` over the draft vocabulary
    (`draft_ids`, None: index = token id) and, with an `extension`, of its tokens' logits from `states [n, H]`,
    all in one softmax."""
    logits = logits.float()
    if extension is not None:
        extra = F.linear(states, extension.rows.to(states.dtype)).float()
        logits, draft_ids = torch.cat([logits, extra], -1), extension.ids
    values, index = logits.topk(top_k, dim=-1)
    values = values - logits.logsumexp(dim=-1, keepdim=True)
    return (index if draft_ids is None else draft_ids.to(index.device)[index]), values
