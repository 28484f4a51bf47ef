"""The accept walks of a verified tree, on the host: what one verification step of a row accepted
(`AcceptResult`), the token `generate` picks from processed scores (`choose_tokens`), `generate`'s usual
stopping criteria decided on the host (`HostStop`), the walk along the base model's own choices
(`accept_tree`, exact for greedy and sampling; `accept_greedy` in one copy), and Medusa's lossy typical
acceptance (`typical_child`). Every decode loop walks with them (`call.DecodeCall.walk`); the device walks
are `row.accept_greedy_and_grow` and `sampled_walk.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..drafting.tree import DraftTree


@dataclass
class AcceptResult:
    """One row's outcome of a verification step."""

    nodes: list[int]  # tree nodes whose KV entries are kept (root first)
    tokens: list[int]  # new tokens appended to the sequence (len(nodes) of them unless stopped early)
    scores: list[torch.Tensor]  # processed scores of each new token, [vocab]
    logits: list[torch.Tensor]  # raw logits of each new token, [vocab]
    finished: bool


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)`, the greedy token of each row, through `max(dim=-1)`: the same indices (the
    first maximum, a NaN where there is one), and torch's CPU `max` reduces over a large vocabulary in
    vectorised chunks where its `argmax` does not."""
    return scores.max(dim=-1).indices


def choose_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Processed scores `[B, V]` -> the token `generate` picks for each row `[B]`: the argmax, or one draw
    from their softmax made exactly as `generate`'s sampling loop makes it (so a seed gives the same draws)."""
    if not do_sample:
        return greedy_tokens(scores)
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


TYPICAL_ACCEPTANCE = (0.09, 0.3)  # Medusa's (epsilon, delta)


def typical_acceptance(setting) -> tuple[float, float] | None:
    """`lossy_typical_acceptance` of a `generate` call -> (epsilon, delta), or None when off."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return TYPICAL_ACCEPTANCE
    try:
        epsilon, delta = (float(v) for v in setting)
    except (TypeError, ValueError):
        raise ValueError(f"lossy_typical_acceptance takes True or (epsilon, delta), got {setting!r}") from None
    if not (0 < epsilon <= 1 and delta > 0):
        raise ValueError(f"lossy_typical_acceptance needs 0 < epsilon <= 1 and delta > 0, got {setting!r}")
    return epsilon, delta


def typical_child(tree: DraftTree, node: int, scores: torch.Tensor, epsilon: float, delta: float) -> int | None:
    """Medusa's typical acceptance at `node` (lossy): the drafted child whose token's processed probability
    exceeds min(epsilon, delta * exp(-entropy)), the most probable one if several do, else None."""
    children = [i for i in range(node + 1, len(tree)) if tree.parents[i] == node]
    if not children:
        return None
    logp = torch.log_softmax(scores.float(), dim=-1)
    probs = logp.exp()
    entropy = float(-(probs * logp).nan_to_num().sum())  # tokens masked to -inf contribute 0, not NaN
    threshold = min(epsilon, delta * float(torch.exp(torch.tensor(-entropy))))
    p = probs[[tree.tokens[i] for i in children]].tolist()
    best = max(range(len(children)), key=p.__getitem__)
    return children[best] if p[best] > threshold else None


def accept_greedy(
    tree: DraftTree, logits: torch.Tensor, length: int, stop: HostStop, choices: list[int] | None = None
) -> AcceptResult:
    """`accept_tree` for greedy decoding without logits processors and with `HostStop` criteria: the base
    model's token at every node in one argmax (one device-to-host copy for the whole step), then the same
    walk on the host. `length`: the sequence's length, root included. `choices`: that argmax, where the
    caller already read it (`accept_greedy_and_grow`)."""
    if choices is None:
        choices = greedy_tokens(logits).tolist()
    nodes, tokens = [], []
    node = 0
    while True:
        nodes.append(node)
        tokens.append(choices[node])
        length += 1
        if stop(length, choices[node]):
            finished = True
            break
        child = tree.child(node, choices[node])
        if child is None:
            finished = False
            break
        node = child
    raw = [logits[i].float() for i in nodes]  # views: no copy to the host (scores = raw logits: no processors)
    return AcceptResult(nodes, tokens, raw, raw, finished)


def accept_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    sequence: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    do_sample: bool = False,
    typical: tuple[float, float] | None = None,
    stop: HostStop | None = None,
) -> AcceptResult:
    """Follow the base model's own choices through the tree for one row: its greedy token at each node,
    or with `do_sample` one draw from its processed distribution there (module docstring: exact).

    logits [N, V] are the raw logits of every node; `sequence` [1, L] ends with the root. At each visited
    node the processors see exactly the sequence plain `generate` would have had, so the chosen token is
    the one `generate` would choose (or has the law of its draw). A matching child is followed; otherwise
    the chosen token is the bonus token and the step ends. Stopping criteria are checked after every token,
    so eos or max_new_tokens inside an accepted draft stop right there. `typical` (sampling only, lossy):
    accept children by Medusa's typical acceptance instead (`typical_child`; module docstring). `stop`:
    the criteria's host form where they have one (`HostStop.of`): greedy steps without processors then
    take `accept_greedy`, same tokens with one synchronisation, and every other walk checks it on the host
    (one synchronisation per reached node: its token; `sampled_walk.py` makes a sampled step's draws on the
    device with one).
    """
    if stop is not None and not do_sample and typical is None and len(logits_processor) == 0:
        return accept_greedy(tree, logits, sequence.shape[1], stop)
    nodes, tokens, scores, raw = [], [], [], []
    node = 0
    while True:
        nodes.append(node)
        node_logits = logits[node : node + 1].float()
        node_scores = logits_processor(sequence, node_logits)
        accepted = None if typical is None else typical_child(tree, node, node_scores[0], *typical)
        token = int(choose_tokens(node_scores, do_sample)) if accepted is None else tree.tokens[accepted]
        sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
        tokens.append(token)
        scores.append(node_scores[0])
        raw.append(node_logits[0])
        stopped = (
            stop(sequence.shape[1], token) if stop is not None else bool(stopping_criteria(sequence, node_scores).any())
        )
        if stopped:
            return AcceptResult(nodes, tokens, scores, raw, finished=True)
        child = tree.child(node, token)
        if child is None:
            return AcceptResult(nodes, tokens, scores, raw, finished=False)
        node = child
