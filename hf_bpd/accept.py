"""What one verification step of a row accepted (`AcceptResult`), the token `generate` picks from processed
scores (`choose_tokens`), and `generate`'s usual stopping criteria decided on the host (`HostStop`): shared
by the accept walks of `decoding.py` and `sampled_walk.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


@dataclass
class AcceptResult:
    """One row's outcome of a verification step."""

    nodes: list[int]  # tree nodes whose KV entries are kept (root first)
    tokens: list[int]  # new tokens appended to the sequence (len(nodes) of them unless stopped early)
    scores: list[torch.Tensor]  # processed scores of each new token, [vocab]
    logits: list[torch.Tensor]  # raw logits of each new token, [vocab]
    finished: bool


def choose_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Processed scores `[B, V]` -> the token `generate` picks for each row `[B]`: the argmax, or one draw
    from their softmax made exactly as `generate`'s sampling loop makes it (so a seed gives the same draws)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


@dataclass(frozen=True)
class HostStop:
    """`generate`'s usual stopping criteria (max length, eos tokens) evaluated on the host from a sequence
    length and a token: exactly what `MaxLengthCriteria` and `EosTokenCriteria` decide, without a tensor
    per token (each would be a device-to-host synchronisation)."""

    max_length: int | None
    eos: frozenset[int]

    @classmethod
    def of(cls, stopping_criteria: StoppingCriteriaList) -> HostStop | None:
        """The host form of `stopping_criteria`, or None when it holds any other criterion (stop strings,
        time limits, a user's own): those run as `generate` runs them."""
        max_length, eos = None, set()
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                eos.update(criterion.eos_token_id.view(-1).tolist())
            else:
                return None
        return cls(max_length, frozenset(eos))

    def __call__(self, length: int, token: int) -> bool:
        return token in self.eos or (self.max_length is not None and length >= self.max_length)
