"""The top-k "sausage" lattice of the draft heads and the searches over it.

Head i (i = 1..h) proposes a distribution over the token at position t+1+i. Keeping the top-k tokens of
each head gives a lattice with h positions and k arcs per position: k**h possible drafts. The heads
predict independently, so a path's score is the sum of its arcs' log-probabilities.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


def host_lists(ids: torch.Tensor, values: torch.Tensor) -> tuple[list, list]:
    """`(ids.tolist(), values.tolist())` in ONE device-to-host copy (each `.tolist()` of a device tensor
    makes the host wait): both go over as one float64 tensor, which holds token ids exactly (< 2**53) and
    float32 values unchanged."""
    both = torch.stack([ids.to(torch.float64), values.to(torch.float64)]).tolist()
    return _as_ints(both[0]), both[1]


def _as_ints(nested):
    return [_as_ints(x) for x in nested] if isinstance(nested, list) else int(nested)


@dataclass(frozen=True)
class ScoredPath:
    """One draft through the lattice (the tokens after the root) and its score (higher is better).

    token_logprobs: optional per-token log-probability that the token is accepted, from a rescorer whose
    drafting distribution differs from the heads' (e.g. tokens proposed by a context model); the drafter
    sizes trees with it where it exceeds the heads' own estimate."""

    tokens: tuple[int, ...]
    score: float
    token_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Lattice:
    """Top-k tokens of each head, sorted by descending log-probability.

    tokens:   LongTensor  [batch, num_positions, top_k]
    logprobs: FloatTensor [batch, num_positions, top_k] (float32, log-softmax over the full vocabulary)
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.shape != self.logprobs.shape or self.tokens.dim() != 3:
            raise ValueError(
                f"Lattice needs tokens and logprobs of the same shape [batch, positions, k]; got "
                f"{tuple(self.tokens.shape)} and {tuple(self.logprobs.shape)}"
            )

    @classmethod
    def from_logits(cls, head_logits: torch.Tensor, top_k: int, token_ids: torch.Tensor | None = None) -> Lattice:
        """Build the lattice from head logits `[batch, num_heads, S]`. `token_ids` [S] maps logit index to
        token id when the heads use a draft vocabulary (default: index = token id)."""
        if not 1 <= top_k <= head_logits.shape[-1]:
            raise ValueError(f"top_k must be in [1, draft vocabulary size {head_logits.shape[-1]}], got {top_k}")
        logprobs = torch.log_softmax(head_logits.float(), dim=-1)
        values, indices = logprobs.topk(top_k, dim=-1)
        if token_ids is not None:
            indices = token_ids.to(indices.device)[indices]
        return cls(tokens=indices, logprobs=values)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_positions(self) -> int:
        return self.tokens.shape[1]

    @property
    def top_k(self) -> int:
        return self.tokens.shape[2]

    def row(self, b: int) -> tuple[list[list[int]], list[list[float]]]:
        """Python lists of one batch row (the searches below are sequential and tiny: lists beat tensors).
        Every row is read in one device-to-host copy, the first time any row is asked for."""
        rows = self.__dict__.get("_host_rows")
        if rows is None:
            rows = list(zip(*host_lists(self.tokens, self.logprobs)))
            object.__setattr__(self, "_host_rows", rows)  # a cache of the (frozen) tensors' values
        return rows[b]

    def best_prefixes(self, b: int, num_nodes: int, max_depth: int | None = None) -> list[ScoredPath]:
        """The `num_nodes` most probable prefixes (paths from the root of any length 1..h) of row `b`.

        Every prefix of a returned path is returned before it, so the result is a tree: the best tree of
        that many nodes when the head probabilities are calibrated (expected accepted length is the sum of
        the node probabilities). Lazy best-first search: popping a node pushes only its best child and
        its next sibling, so the cost is O(num_nodes log num_nodes), independent of k.
        """
        tokens, logprobs = self.row(b)
        depth_limit = self.num_positions if max_depth is None else min(max_depth, self.num_positions)
        if num_nodes <= 0 or depth_limit <= 0:
            return []
        # heap entries: (-score, parent_score, ranks): ranks[i] is the rank chosen at position i.
        heap: list[tuple[float, float, tuple[int, ...]]] = [(-logprobs[0][0], 0.0, (0,))]
        out: list[ScoredPath] = []
        k = self.top_k
        while heap and len(out) < num_nodes:
            neg, parent_score, ranks = heapq.heappop(heap)
            depth = len(ranks)
            out.append(ScoredPath(tuple(tokens[i][r] for i, r in enumerate(ranks)), -neg))
            if depth < depth_limit:  # best child
                heapq.heappush(heap, (neg - logprobs[depth][0], -neg, ranks + (0,)))
            if ranks[-1] + 1 < k:  # next sibling
                sib = ranks[-1] + 1
                heapq.heappush(heap, (-(parent_score + logprobs[depth - 1][sib]), parent_score, ranks[:-1] + (sib,)))
        return out

    def best_paths(self, b: int, num_paths: int) -> list[ScoredPath]:
        """The `num_paths` best full-length paths of row `b` (k-best over independent positions).

        Successors of a rank vector raise one coordinate at or after the last raised one, so every
        vector is generated exactly once.
        """
        tokens, logprobs = self.row(b)
        h, k = self.num_positions, self.top_k
        start = tuple([0] * h)
        heap = [(-sum(lp[0] for lp in logprobs), start, 0)]
        out: list[ScoredPath] = []
        while heap and len(out) < num_paths:
            neg, ranks, first = heapq.heappop(heap)
            out.append(ScoredPath(tuple(tokens[i][r] for i, r in enumerate(ranks)), -neg))
            for i in range(first, h):
                if ranks[i] + 1 < k:
                    nxt = ranks[:i] + (ranks[i] + 1,) + ranks[i + 1 :]
                    delta = logprobs[i][ranks[i] + 1] - logprobs[i][ranks[i]]
                    heapq.heappush(heap, (neg - delta, nxt, i))
        return out

    def oracle_length(self, continuation: torch.Tensor) -> torch.Tensor:
        """The paper's oracle: per row, the longest prefix of the true `continuation` `[batch, n]` that the
        lattice contains (position i's true token among its top-k). Returns LongTensor `[batch]`."""
        n = min(continuation.shape[1], self.num_positions)
        hit = (self.tokens[:, :n, :] == continuation[:, :n, None].to(self.tokens.device)).any(-1)
        return hit.long().cumprod(dim=1).sum(dim=1)
