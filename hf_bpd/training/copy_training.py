"""Training and validating the heads' context-copy pointer (`hf_bpd/drafting/context_copy.py`) in frozen mode.

Each training position t of a distilled sample drafts from the hidden state at t with the root x[t+1]
known; head i reads x[t+1+i] (teacher forcing), the token before it is x[t+i], and its target is
x[t+2+i]. The pointer's memory is what decoding would have at that step: the accepted tokens x[0..t+1]
(prompt, answer so far, root), never the drafted ones. The loss is the mixture's negative log-likelihood
of the target, weighted per head like the heads' own loss; a target that neither the head's draft
vocabulary nor the context holds is skipped, as the heads' loss skips tokens outside their vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_bpd.drafting.context_copy import CopyTargets
from hf_bpd.drafting.heads import BlockDraftHeads


@dataclass
class SampleTokens:
    """Every distilled sample's prompt + response ids, right-padded: `tokens [samples, L]`, and the first
    trained position of each sample `start [samples]` (its features' first row, `response_positions`)."""

    tokens: torch.Tensor
    start: torch.Tensor

    @staticmethod
    def build(data, first_position) -> SampleTokens:
        """From distilled rows (`prompt_ids`, `response_ids`); `first_position(prompt_len)` is the first
        position that has features."""
        seqs = [r["prompt_ids"] + r["response_ids"] for r in data]
        tokens = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)] = torch.tensor(s)
        start = torch.tensor([first_position(len(r["prompt_ids"])) for r in data])
        return SampleTokens(tokens, start)


def feature_positions(sample: torch.Tensor, tokens: SampleTokens) -> torch.Tensor:
    """Absolute position t of every features row, given its sample index `sample [n]`: the rows of one
    sample are its consecutive positions from `tokens.start` (`compute_features`)."""
    n = sample.shape[0]
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = sample[1:] != sample[:-1]
    first_row = torch.cummax(torch.where(new, torch.arange(n), 0), dim=0).values
    return tokens.start[sample] + torch.arange(n) - first_row


def copy_targets(
    tokens: SampleTokens,
    sample: torch.Tensor,
    position: torch.Tensor,
    targets: torch.Tensor,
    vocab_index: torch.Tensor | None,
) -> tuple[torch.Tensor, CopyTargets]:
    """For positions `position [n]` of samples `sample [n]` with head targets `targets [n, h]`: the tokens
    the heads read `[n, h]` (x[t+1+i]) and the pointer's `CopyTargets`."""
    num_heads = targets.shape[1]
    lengths = position + 2
    rows = tokens.tokens[sample]
    width = int(lengths.max())
    context = rows[:, :width].clone()
    context[torch.arange(width)[None] >= lengths[:, None]] = 0
    offsets = position[:, None] + torch.arange(num_heads)[None]
    last = rows.shape[1] - 1
    read = rows.gather(1, (offsets + 1).clamp(max=last))
    before = rows.gather(1, offsets.clamp(max=last))
    head_targets = targets.clamp(min=0) if vocab_index is None else vocab_index.cpu()[targets.clamp(min=0)]
    head_targets = torch.where(targets < 0, -1, head_targets)
    return read, CopyTargets(context, lengths, before, targets, head_targets)


def copy_loss(heads, hidden: torch.Tensor, read: torch.Tensor, targets: CopyTargets, weights: list[float]):
    """Weighted NLL of each head's target under its pointer-generator mixture, and the per-head losses.
    `heads` may be wrapped for data parallelism: the forward goes through it (`BlockDraftHeads.forward`)."""
    logp = heads(hidden, read, copy_targets=targets)  # [n, h]
    total, per_head = hidden.new_zeros(()).float(), []
    for i, w in enumerate(weights):
        use = (targets.targets[:, i] >= 0) & torch.isfinite(logp[:, i])
        loss = -logp[use, i].mean() if bool(use.any()) else logp.new_zeros(())
        per_head.append(loss.detach())
        total = total + w * loss
    return total, per_head


@torch.no_grad()
def copy_hits(
    heads: BlockDraftHeads, hidden: torch.Tensor, read: torch.Tensor, targets: CopyTargets, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head hits `[n, h]` of the mixture's top-1 and top-k (whole vocabulary), given the true tokens
    before each target; rows without a target never hit. `hidden`: the heads' input as cached (feature
    layers' states are fused here)."""
    hidden = heads.fuse(hidden)
    memory = heads.copy_memory(targets.context, targets.lengths)
    top1, topk = [], []
    for i in range(heads.num_heads):
        state = heads.step(i, hidden, read[:, i])
        index = torch.full_like(read[:, i], i)
        best, _ = heads.top_tokens(state, top_k, index, targets.before[:, i], memory)
        want = targets.targets[:, i]
        top1.append((best[:, 0] == want) & (want >= 0))
        topk.append((best == want[:, None]).any(-1) & (want >= 0))
    return torch.stack(top1, 1), torch.stack(topk, 1)
