"""Draft trees: many drafts merged into one prefix tree, verified by ONE forward of the base model.

Node 0 is the root: the token the base model already chose (the last accepted token), not yet in the
KV cache. Each other node is a drafted token whose parent precedes it (parents[i] < i).

Tree attention: the tree's N nodes are appended after the P cached positions. Node i may attend to
every cached position and to its ancestors (itself included) and nothing else, so its hidden state is
exactly what a sequential decode of the path root -> i would compute. Its position id is the next
position + depth(i): siblings share a position, as they are alternatives for the same slot.

      cached 0..P-1        tree nodes 0..N-1
    [ 1 1 1 ... 1 ] [ ancestor-or-self(i, j) ]   <- row of node i in the [N, P+N] mask
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .calibration import HEADS, RESCORER, AcceptanceCalibration, Arc, calibrated_logprob


@dataclass
class DraftTree:
    """A prefix tree of drafts. tokens/parents/depths are Python lists (the tree is small and built token
    by token); `to_tensors` makes the model inputs."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls(tokens=[int(root_token)])

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        """Index of the child of `node` carrying `token`, or None."""
        return self._children.get((node, token))

    def add_path(self, path: Sequence[int], max_nodes: int) -> None:
        """Merge a draft (tokens after the root) into the tree, sharing existing prefixes. Stops when the
        tree holds `max_nodes` nodes: a truncated draft is still a valid (shorter) draft."""
        node = 0
        for token in path:
            token = int(token)
            nxt = self._children.get((node, token))
            if nxt is None:
                if len(self.tokens) >= max_nodes:
                    return
                nxt = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self._children[(node, token)] = nxt
            node = nxt

    def add_child(self, parent: int, token: int) -> int:
        """The child of `parent` carrying `token`, added if new; its index."""
        child = self._children.get((parent, token))
        if child is None:
            child = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self._children[(parent, token)] = child
        return child

    @classmethod
    def from_paths(cls, root_token: int, paths: Iterable[Sequence[int]], max_nodes: int) -> DraftTree:
        """Merge drafts in order of preference until `max_nodes` nodes (root included)."""
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        tree = cls.root_only(root_token)
        for path in paths:
            if len(tree) >= max_nodes:
                break
            tree.add_path(path, max_nodes)
        return tree

    def truncated(self, n: int) -> DraftTree:
        """The first n nodes (insertion order keeps parents before children, so it is still a tree)."""
        tree = DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n])
        tree._children = {key: child for key, child in self._children.items() if child < n}
        return tree

    def reordered(self, order: Sequence[int]) -> DraftTree:
        """The nodes `order` (root first, each parent before its children) as a new tree in that order."""
        new = {old: i for i, old in enumerate(order)}
        misplaced = (self.parents[old] not in new or new[self.parents[old]] >= new[old] for old in order[1:])
        if order[0] != 0 or any(misplaced):
            raise ValueError("a reordered tree needs the root first and every parent before its children")
        tree = DraftTree.root_only(self.tokens[0])
        for old in order[1:]:
            parent = new[self.parents[old]]
            tree.tokens.append(self.tokens[old])
            tree.parents.append(parent)
            tree.depths.append(self.depths[old])
            tree._children[(parent, self.tokens[old])] = len(tree.tokens) - 1
        return tree

    def node_paths(self) -> list[tuple[int, ...]]:
        """Each node's draft: the tokens from the root's child down to it (the root's is empty)."""
        out: list[tuple[int, ...]] = [()]
        for i in range(1, len(self.tokens)):
            out.append(out[self.parents[i]] + (self.tokens[i],))
        return out

    def node_arcs(
        self,
        position_logprob: list[dict[int, float]],
        path_estimates: dict[tuple[int, ...], float] | None = None,
        calibration: AcceptanceCalibration | None = None,
    ) -> list[Arc]:
        """Each node's own arc (the root's: log-probability 0): the heads' log-probability of its token at
        its depth, from per-position {token: logprob} tables (absent: -inf), or the rescorer's estimate
        for its path (`path_estimates`, keyed by `node_paths`), whichever is higher once calibrated."""
        paths = self.node_paths() if path_estimates else None
        arcs = [Arc(0.0, HEADS)]
        for i in range(1, len(self.tokens)):
            depth = self.depths[i]
            table = position_logprob[depth - 1] if depth - 1 < len(position_logprob) else {}
            arc = Arc(table.get(self.tokens[i], float("-inf")), HEADS)
            if paths is not None and paths[i] in path_estimates:
                estimate = Arc(path_estimates[paths[i]], RESCORER)
                if calibration is None:
                    better = estimate.logprob > arc.logprob
                else:
                    better = calibration.calibrated(estimate, depth) > calibration.calibrated(arc, depth)
                arc = estimate if better else arc
            arcs.append(arc)
        return arcs

    def node_logprobs(
        self,
        position_logprob: list[dict[int, float]],
        path_estimates: dict[tuple[int, ...], float] | None = None,
        calibration: AcceptanceCalibration | None = None,
    ) -> list[float]:
        """Summed (calibrated, when given) log-probability of each node's path; see `node_arcs`."""
        return self.path_logprobs(self.node_arcs(position_logprob, path_estimates, calibration), calibration)

    def path_logprobs(self, arcs: list[Arc], calibration: AcceptanceCalibration | None = None) -> list[float]:
        """Each node's path log-probability from its nodes' `arcs` (those of `node_arcs`)."""
        out = [0.0]
        for i in range(1, len(self.tokens)):
            out.append(out[self.parents[i]] + calibrated_logprob(arcs[i], self.depths[i], calibration))
        return out

    def by_path_probability(
        self, arcs: list[Arc], calibration: AcceptanceCalibration | None = None, max_nodes: int | None = None
    ) -> tuple[DraftTree, list[Arc]]:
        """This tree and its `arcs` re-ordered by (calibrated) path probability, root first, cut to
        `max_nodes`: then every prefix is the most probable subtree of its size, which sizing a tree by its
        prefixes (`assembly.size_trees`) and cutting it (`BlockDrafter.cut`) assume. Growth adds nodes in
        rounds, a round's candidates before their children are known, so a grown tree's order is not that:
        a round of a large tree can take a root's weak alternatives ahead of a strong child of its first.
        A child's path is never more probable than its parent's and ties go to the shallower node, so
        parents stay before their children."""
        logprobs = self.path_logprobs(arcs, calibration)
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-logprobs[i], self.depths[i], i))
        if max_nodes is not None:
            order = order[: max_nodes - 1]
        if order == list(range(1, len(self.tokens))):
            return self, list(arcs)
        return self.reordered([0, *order]), [arcs[0], *(arcs[i] for i in order)]

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N, N]: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


@dataclass(frozen=True)
class TreeBatch:
    """Model inputs for verifying one tree per batch row, padded to the largest tree.

    input_ids [B, N], depths [B, N], tree_mask bool [B, N, N]; a padding node attends only to itself and
    nobody attends to it, so it cannot change a real node's result.
    """

    input_ids: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor
    sizes: list[int]

    def row(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row `b`'s own nodes, without the padding: (input_ids [n], depths [n], tree_mask [n, n]). What is
        combined with a tree's own tensors (its parents) must be cut to them: a compiled forward's trees
        are padded to a fixed size (`static_cache.graph_tree_size`)."""
        n = self.sizes[b]
        return self.input_ids[b, :n], self.depths[b, :n], self.tree_mask[b, :n, :n]


def batch_trees(
    trees: Sequence[DraftTree], pad_token_id: int, device: torch.device, pad_to: int | None = None
) -> TreeBatch:
    """The trees as one batch of model inputs, padded to the largest tree, or to `pad_to` nodes where that
    is larger (a compiled forward's fixed size: `static_cache.graph_tree_size`)."""
    n = max(max(len(t) for t in trees), pad_to or 0)
    ids = torch.full((len(trees), n), pad_token_id, dtype=torch.long)
    depths = torch.zeros((len(trees), n), dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, tree in enumerate(trees):
        m = len(tree)
        ids[b, :m] = torch.tensor(tree.tokens)
        depths[b, :m] = torch.tensor(tree.depths)
        mask[b, :m, :m] = tree.ancestor_mask()
    return TreeBatch(ids.to(device), depths.to(device), mask.to(device), [len(t) for t in trees])


def root_batch(roots: Sequence[int], device: torch.device) -> TreeBatch:
    """A plain step's model inputs: each row's root alone (`batch_trees` of root-only trees, built as three
    tensors without a tree object per row)."""
    ids = torch.tensor(list(roots), dtype=torch.long, device=device)[:, None]
    ones = torch.ones((ids.shape[0], 1, 1), dtype=torch.bool, device=device)
    return TreeBatch(ids, torch.zeros_like(ids), ones, [1] * ids.shape[0])
