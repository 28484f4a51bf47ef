"""Tree assembly: the free functions `BlockDrafter.tree` builds each step's draft trees with.

A row's tree starts at its root; a rescorer's drafts join it first (`add_rescored`), the heads' best
lattice prefixes fill what budget is left (`fill_from_lattice`; "previous" heads grow theirs instead,
`expansion.py`), and with a forward-cost curve the trees are cut to the prefix with the most expected
accepted tokens per second (`size_trees`, by `best_tree_size` or, for a batch verified at one width,
`best_batch_width`). Models verified one chain at a time take one path of each tree (`best_path`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from .calibration import HEADS, AcceptanceCalibration, Arc
from .lattice import Lattice, ScoredPath
from .tree import DraftTree


class CostCurve(Protocol):
    """Seconds of one base-model forward of n tokens (`cost.ForwardCost`), measured up to `max_size`."""

    @property
    def max_size(self) -> int: ...

    def __call__(self, n: int) -> float: ...


class BatchCost(Protocol):
    """Seconds of one batch verification forward of n = rows x width tokens (`cost.BatchForwardCost`)."""

    rows: int
    margin: float

    def __call__(self, n: int) -> float: ...

    def max_width(self) -> int: ...


def best_tree_size(node_probs: list[float], cost: Callable[[int], float]) -> int:
    """node_probs[i]: probability that tree node i (insertion order, root first, root = 1) is accepted.
    Returns the N maximising (sum of the first N probabilities) / cost(N)."""
    best_n, best_rate, expected = 1, 0.0, 0.0
    for n, p in enumerate(node_probs, start=1):
        expected += p
        rate = expected / cost(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def best_batch_width(
    node_probs: list[list[float]], rows_in_forward: int, cost, max_width: int | None = None, margin: float = 0.0
) -> int:
    """One verification forward for a batch: every row's tree is padded to the widest, so the forward holds
    `rows_in_forward` x w tokens (finished rows included) whatever each row drafted. node_probs[b]: row b's
    node acceptance probabilities (as in `best_tree_size`). Returns the width w <= `max_width` maximising
    the batch's expected accepted tokens, sum over rows of their first min(w, n_b) probabilities, per
    cost(rows x w); a width above 1 only where its rate beats the roots' alone (w = 1) by `margin`, a share:
    a wider step also pays for what the forward's cost leaves out (the accepted slots' compaction, the
    holes rows' different acceptances leave), and its expectation rests on calibrated estimates."""
    widest = max((len(p) for p in node_probs), default=1)
    widest = widest if max_width is None else min(widest, max_width)
    best_w, best_rate = 1, 0.0
    expected = [0.0] * len(node_probs)
    for w in range(1, widest + 1):
        for b, probs in enumerate(node_probs):
            if w <= len(probs):
                expected[b] += probs[w - 1]
        rate = sum(expected) / cost(rows_in_forward * w)
        if w == 1:  # the roots alone: what a wider width must beat by the margin
            best_rate = (1 + margin) * rate
        elif rate > best_rate:
            best_w, best_rate = w, rate
    return best_w


def add_rescored(
    tree: DraftTree, paths: Sequence[ScoredPath], budget: int, max_depth: int | None
) -> dict[tuple[int, ...], float]:
    """A rescorer's drafts for one row: those without per-token acceptance estimates go into `tree` first,
    as given; returns the estimates of the others, per draft prefix (the higher of two estimates of one
    prefix), with which they compete with the heads' prefixes on estimated probability."""
    estimates: dict[tuple[int, ...], float] = {}
    for path in paths:
        toks = tuple(path.tokens[:max_depth])
        if path.token_logprobs is None:
            tree.add_path(toks, budget)
            continue
        for d, lp in enumerate(path.token_logprobs[: len(toks)]):
            estimates[toks[: d + 1]] = max(lp, estimates.get(toks[: d + 1], -math.inf))
    return estimates


def fill_from_lattice(
    tree: DraftTree,
    lattice: Lattice,
    b: int,
    budget: int,
    max_depth: int | None,
    estimates: dict[tuple[int, ...], float],
    calibration: AcceptanceCalibration | None,
    sized: bool,
    lookup: bool,
) -> list[Arc] | None:
    """Fill `tree` up to `budget` with row `b`'s best lattice prefixes (ordered against the rescorer's
    `estimates` when there are any). Returns each node's arc where something reads them (tree sizing:
    `sized`, `calibration`, or the context-lookup chain: `lookup`, which competes with the heads' nodes on
    them), else None."""
    tables = None
    if estimates or sized or lookup:
        tokens, logprobs = lattice.row(b)
        tables = [dict(zip(t, lp)) for t, lp in zip(tokens, logprobs)]
    if len(tree) < budget:
        drafts = [p.tokens for p in lattice.best_prefixes(b, budget - 1, max_depth)]
        if estimates:
            drafts = by_estimated_probability(tree.tokens[0], drafts, estimates, tables, calibration)
        for draft in drafts:
            tree.add_path(draft, budget)
            if len(tree) >= budget:
                break
    # each node's arc, once: it sizes the tree and, kept, lets `observe` score the verification
    needed = tables is not None and (sized or calibration is not None or lookup)
    return tree.node_arcs(tables, estimates, calibration) if needed else None


def size_trees(
    trees: list[DraftTree],
    node_arcs: list,
    calibration: AcceptanceCalibration | None,
    cost: Callable[[int], float],
    batch_cost: BatchCost | None = None,
) -> tuple[list[DraftTree], list[int]]:
    """Cut each tree to the prefix with the best expected tokens per second of the verification forward:
    per tree by `cost` for one row, or one common width for a batch forward (`batch_cost`). Returns the
    trees and, for those that had drafts, the nodes of the heads' growth they kept (`grown_nodes`: what
    `growth_budget` bounds the next growth by)."""
    probs = [
        [math.exp(lp) for lp in tree.path_logprobs(arcs, calibration)] if len(tree) > 1 else [1.0]
        for tree, arcs in zip(trees, node_arcs)
    ]
    if batch_cost is None:
        sizes = [best_tree_size(p, cost) for p in probs]
    else:
        width = best_batch_width(probs, batch_cost.rows, batch_cost, batch_cost.max_width(), batch_cost.margin)
        sizes = [min(width, len(tree)) for tree in trees]
    trees = [tree.truncated(n) if n < len(tree) else tree for tree, n in zip(trees, sizes)]
    return trees, [grown_nodes(tree, arcs) for tree, arcs, p in zip(trees, node_arcs, probs) if len(p) > 1]


def grown_nodes(tree: DraftTree, arcs: Sequence[Arc]) -> int:
    """The nodes of a sized `tree` that the heads' growth supplied, the root included: those whose best
    estimate is the heads' (`arcs`, one per node of the tree before it was cut). A looked-up chain's nodes
    are not grown, so they must not raise the next growth: a long chain that fills a tree would otherwise
    have the heads grow half as many nodes again for the next steps, at a head call per round, only for
    the chain's nodes to outrank them."""
    return 1 + sum(arc.source == HEADS for arc in arcs[1 : len(tree)])


def growth_budget(budget: int, recent_grown: Sequence[int], sized: bool, floor: int = 8) -> int:
    """Nodes to grow for a tree that the forward-cost curve will cut (`sized`): each expansion round costs
    head calls, so grow at most 1.5 times the most grown nodes a tree of the last steps kept (`recent_grown`,
    from `grown_nodes`; at least `floor`; all of `budget` without a curve or before any step).
    Self-correcting: a tree cut at that bound raises it. Batches pass a floor of 2: every row pays its own
    head calls, and a compute-bound batch forward often affords single tokens only, so growing 8 nodes per
    row would be wasted."""
    if not sized or not recent_grown:
        return budget
    return min(budget, max(floor, (3 * max(recent_grown) + 1) // 2))


def best_path(tree: DraftTree, logprobs: list[float] | None) -> list[int]:
    """Node indices from the root to the leaf whose path has the most expected accepted tokens (the sum of
    exp(path log-probability) over its nodes), or, without `logprobs`, following each node's first child."""
    if logprobs is None:
        path = [0]
        while (
            child := next((i for i in range(path[-1] + 1, len(tree)) if tree.parents[i] == path[-1]), None)
        ) is not None:
            path.append(child)
        return path
    gain = [0.0] * len(tree)
    for i in range(1, len(tree)):
        gain[i] = gain[tree.parents[i]] + math.exp(logprobs[i])
    return tree.path_to(max(range(len(tree)), key=lambda i: (gain[i], -i)))


def by_estimated_probability(
    root: int,
    drafts: list[tuple[int, ...]],
    estimates: dict[tuple[int, ...], float],
    tables: list[dict[int, float]],
    calibration: AcceptanceCalibration | None = None,
) -> list[tuple[int, ...]]:
    """Every candidate draft (the heads' prefixes and each prefix of the rescored drafts), most probable
    first. A child is never more probable than its parent (depth breaks ties), so each draft's prefixes
    come before it."""
    candidates = DraftTree.root_only(root)
    for draft in [*drafts, *estimates]:
        candidates.add_path(draft, len(drafts) + len(estimates) + 1)
    logprobs = candidates.node_logprobs(tables, estimates, calibration)
    paths = candidates.node_paths()
    order = sorted(range(1, len(candidates)), key=lambda i: (-logprobs[i], candidates.depths[i]))
    return [paths[i] for i in order]
