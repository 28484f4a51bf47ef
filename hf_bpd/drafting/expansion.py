"""Drafting with heads that read the drafted token before their target (`token_input="previous"`).

Such heads draft like a small autoregressive model: the children of a tree node at depth d are head d+1's
top-k tokens given the base hidden state and the node's own token. There is no single lattice any more:
each node has its own distribution. The tree is grown best-first on path probability:

    candidates = top-k children of the root (head 1 reading the root token)
    repeat: add the most probable candidates to the tree (a batch: `round_size`); expand
            the new nodes (each depth's residual block on its nodes, then one shared softmax call) and add
            their top-k children to the candidates

so every branch continues what it actually drafted. Parents are always added before their children, so
any prefix of the insertion order is a tree (the drafter cuts trees to a size that pays off).

Rescorers still see a `Lattice`: `chain_lattice` is the top-k of each depth along the heads' own greedy
draft (head i reading the top-1 token of depth i-1). A rescorer's drafts that carry per-token acceptance
estimates join the candidates with those estimates, so they compete with the heads' children on
(calibrated) path probability, as they do for lattice heads.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from .calibration import HEADS, RESCORER, AcceptanceCalibration, Arc, SamplingWarp, calibrated_logprob
from .context_copy import CopyMemory
from .context_vocab import VocabExtension
from .heads import BlockDraftHeads
from .lattice import Lattice, host_lists
from .tree import DraftTree

MAX_ROUNDS = 4  # head-call rounds per tree at most: each round adds a batch of the best candidates


def round_size(budget: int) -> int:
    """Candidates added per round for a tree of `budget` nodes. Each round costs a read of the heads'
    weights, so small trees take fewer rounds: 8 nodes 2, 16 nodes 3, 32 or more 4. A round adds its
    candidates in order but before their own children are known, so best-first is slightly loosened."""
    rounds = min(MAX_ROUNDS, max(1, budget.bit_length() - 2))
    return max(1, math.ceil((budget - 1) / rounds))


def _top_children(
    heads: BlockDraftHeads,
    hidden: torch.Tensor,
    groups: dict[int, tuple[list[int], list[int]]],
    top_k: int,
    memory: CopyMemory | None = None,
    warp: SamplingWarp | None = None,
    parent_states: dict[int, torch.Tensor] | None = None,
    extension: VocabExtension | None = None,
) -> tuple[dict[int, tuple[list[list[int]], list[list[float]]]], list[torch.Tensor]]:
    """For nodes grouped by depth ({depth: (their tokens, their parents' tokens)}), head depth+1's top-k
    (token ids, log-probs; warped when sampling), and each group's head states (what chained heads' children
    read); parents' tokens feed the context-copy pointer (`memory`, None without one); `extension`: context
    tokens outside the draft vocabulary the heads may draft (`context_vocab.py`). `parent_states`:
    chained heads' parents' states per group `[len(group), H]` (None for unchained heads).
    On a CPU the cost is reading weights, not arithmetic: every depth's residual block runs once on its
    group, and the shared softmax layer (the largest weight by far) once on all of them."""
    with torch.no_grad():
        states = [
            heads.step(
                depth,
                hidden.expand(len(tokens), -1),
                torch.tensor(tokens, device=hidden.device),
                None if parent_states is None else parent_states.get(depth),
            )
            for depth, (tokens, _) in groups.items()
        ]
        head_index = torch.tensor([d for d, (tokens, _) in groups.items() for _ in tokens])
        before = torch.tensor([b for _, (_, parents) in groups.items() for b in parents])
        ids, values = heads.top_tokens(torch.cat(states), top_k, head_index, before, memory, extension)
        if warp is not None:
            values = warp(values)
    ids_list, values_list = host_lists(ids, values)  # one copy per expansion round
    out, start = {}, 0
    for depth, (tokens, _) in groups.items():
        out[depth] = (ids_list[start : start + len(tokens)], values_list[start : start + len(tokens)])
        start += len(tokens)
    return out, states


def chain_lattice(
    heads: BlockDraftHeads, hidden: torch.Tensor, root: torch.Tensor, top_k: int, context: torch.Tensor | None = None
) -> Lattice:
    """`[batch, hidden]` last accepted hidden states, `[batch]` roots -> the lattice of the heads' greedy
    chain: position i holds head i's top-k given the top-1 token of position i-1 (position 1: the root).
    One head call per position, on all batch rows. `context [batch, L]` (ending with the roots) feeds
    context-copy heads; other heads ignore it."""
    tokens, logprobs = [], []
    previous = root.to(hidden.device)
    memory = heads.copy_memory(context) if context is not None else None
    before = context[:, -2] if memory is not None and context.shape[1] > 1 else previous
    state = None  # chained heads: the previous head's state along the chain
    with torch.no_grad():
        for i in range(heads.num_heads):
            head = torch.full_like(previous, i)
            state = heads.step(i, hidden, previous, state)
            ids, values = heads.top_tokens(state, top_k, head, before, memory)
            tokens.append(ids)
            logprobs.append(values)
            before, previous = previous, ids[:, 0]
    return Lattice(tokens=torch.stack(tokens, dim=1), logprobs=torch.stack(logprobs, dim=1))


def expand_tree(
    tree: DraftTree,
    heads: BlockDraftHeads,
    hidden: torch.Tensor,
    top_k: int,
    budget: int,
    max_depth: int | None = None,
    estimates: dict[tuple[int, ...], float] | None = None,
    calibration: AcceptanceCalibration | None = None,
    context: torch.Tensor | None = None,
    warp: SamplingWarp | None = None,
    before_root: int | None = None,
    extension: VocabExtension | None = None,
) -> list[Arc]:
    """Grow `tree` (a root, maybe with drafts already merged) in place up to `budget` nodes, best-first on
    calibrated path probability, from "previous" heads on `hidden [1, hidden]` and the rescorer's
    `estimates` ({draft prefix: log-probability of its last token}). `context [L]`: the accepted tokens,
    ending with the root, for context-copy heads (others ignore it). `warp`: a sampled call's, applied to
    the heads' children (`calibration.SamplingWarp`); `before_root`: `context[-2]` where the caller holds it on
    the host; `extension`: context tokens outside the draft vocabulary the heads may draft
    (`context_vocab.py`). Returns every node's arc (the estimate that ordered it; -inf for a node merged
    before that the search never reached)."""
    memory = heads.copy_memory(context[None]) if context is not None else None
    if before_root is None:  # the token before the root, read from the device unless the caller has it
        before_root = int(context[-2]) if context is not None and context.numel() > 1 else tree.tokens[0]
    depth_limit = heads.num_heads if max_depth is None else min(max_depth, heads.num_heads)
    estimates = estimates or {}
    proposals: dict[tuple[int, ...], list[tuple[int, float]]] = {}  # draft prefix -> rescorer's next tokens
    for path, logprob in estimates.items():
        if len(path) <= depth_limit:
            proposals.setdefault(path[:-1], []).append((path[-1], logprob))
    arcs = [Arc(0.0, HEADS)] + [Arc(-math.inf, HEADS)] * (len(tree) - 1)
    path_logprob = {0: 0.0}
    paths: dict[int, tuple[int, ...]] = {0: ()}
    heap: list[tuple[float, int, int, int, Arc]] = []  # (-path logprob, tie-break, parent, token, arc)
    counter = 0
    node_states: dict[int, torch.Tensor] = {}  # chained heads: each expanded node's state [1, H]

    def push(parent: int, token: int, arc: Arc, logprob: float) -> None:
        nonlocal counter
        if logprob > -math.inf:
            heapq.heappush(heap, (-(path_logprob[parent] + logprob), counter, parent, token, arc))
            counter += 1

    def expand(nodes: list[int]) -> None:
        by_depth: dict[int, list[int]] = {}
        for node in nodes:
            if tree.depths[node] < depth_limit:
                by_depth.setdefault(tree.depths[node], []).append(node)
        groups = {
            d: ([tree.tokens[n] for n in g], [tree.tokens[tree.parents[n]] if n else before_root for n in g])
            for d, g in by_depth.items()
        }
        parent_states = None
        if heads.chained:  # each node below the root reads its parent's state
            parent_states = {d: torch.cat([node_states[tree.parents[n]] for n in g]) for d, g in by_depth.items() if d}
        children, states = (
            _top_children(heads, hidden, groups, top_k, memory, warp, parent_states, extension) if groups else ({}, [])
        )
        if heads.chained:
            for group, group_states in zip(by_depth.values(), states):
                node_states.update({n: group_states[j : j + 1] for j, n in enumerate(group)})
        # a node's children come best first, and each one added takes a free slot (merged nodes reached
        # later take none): children past the free slots can never join the tree
        room = budget - len(tree) + (len(tree) - len(path_logprob))
        for depth, group in by_depth.items():
            ids, lps = children[depth]
            log_scale = 0.0 if calibration is None else math.log(calibration.scale(HEADS, depth + 1))
            for node, node_ids, node_lps in zip(group, ids, lps):
                for token, logprob in zip(node_ids[:room], node_lps[:room]):
                    push(node, token, Arc(logprob, HEADS), min(0.0, logprob + log_scale))
        for node in nodes:
            for token, logprob in proposals.get(paths[node], []):
                arc = Arc(logprob, RESCORER)
                push(node, token, arc, calibrated_logprob(arc, tree.depths[node] + 1, calibration))

    batch = round_size(budget)
    expand([0])
    while heap:
        added = []
        while heap and len(added) < batch:
            neg, _, parent, token, arc = heapq.heappop(heap)
            node = tree.child(parent, token)
            if node is not None and node in path_logprob:  # already reached by a more probable candidate
                continue
            if node is None:
                if len(tree) >= budget:
                    continue
                tree.add_path((*paths[parent], token), budget)
                node = len(tree) - 1
                arcs.append(arc)
            else:  # merged before (a rescorer's draft without estimates): now reached
                arcs[node] = arc
            path_logprob[node] = -neg
            paths[node] = (*paths[parent], token)
            added.append(node)
        if not added or (len(tree) >= budget and len(path_logprob) == len(tree)):
            break  # full, and no merged node left for the search to reach
        expand(added)
    return arcs


@dataclass
class GrownTree:
    """Trees grown on the device (`grow_on_device`), one per batch row, not yet read by the host: each row's
    nodes after its root in insertion order, `[B, n]` each: token ids, parent indices (0 = the root) and
    their arcs' raw log-probabilities (-inf marks a node the search would not have reached: the host drops
    it). Every row grows the same number of nodes (the same rounds), so the rows stack."""

    tokens: torch.Tensor
    parents: torch.Tensor
    logprobs: torch.Tensor

    def flat(self) -> torch.Tensor:
        """Everything as one float64 vector, row after row: the host reads it in the same copy as other
        values."""
        return torch.cat([self.tokens.double(), self.parents.double(), self.logprobs.double()], dim=-1).flatten()

    @staticmethod
    def on_host(root: int, values: list[float]) -> tuple[DraftTree, list[Arc]]:
        """One row's tree and its arcs from its share of `flat()`'s values (as `expand_tree` returns them)."""
        n = len(values) // 3
        tree, arcs = DraftTree.root_only(root), [Arc(0.0, HEADS)]
        index = [0]  # grown index -> tree index (dropped nodes: -1)
        for token, parent, logprob in zip(values[:n], values[n : 2 * n], values[2 * n :]):
            parent = index[int(parent)]
            if logprob == -math.inf or parent < 0:
                index.append(-1)
                continue
            index.append(tree.add_child(parent, int(token)))
            arcs.append(Arc(logprob, HEADS))
        return tree, arcs

    @staticmethod
    def rows_on_host(roots: list[int], values: list[float]) -> list[tuple[DraftTree, list[Arc]]]:
        """Every row's tree and arcs from all of `flat()`'s values (`roots`: each row's root token)."""
        n = len(values) // max(len(roots), 1)
        return [GrownTree.on_host(root, values[b * n : (b + 1) * n]) for b, root in enumerate(roots)]


def grow_on_device(
    heads: BlockDraftHeads,
    hidden: torch.Tensor,
    root: torch.Tensor,
    top_k: int,
    budget: int,
    log_scales: list[float] | torch.Tensor,
    warp: SamplingWarp | None = None,
    depth_limit: int | None = None,
    extension: VocabExtension | None = None,
) -> GrownTree:
    """`expand_tree` on root-only trees without a rescorer's estimates or a context-copy pointer, with
    every decision on the device: the same best-first rounds (`round_size`), the same order, but no
    value read by the host until the caller copies the result (`GrownTree.flat`), so a decoding step can
    read it in one copy with its accepted tokens. `hidden [B, H]`, `root [B]` (device tensors): one tree
    per row, all grown together, so a batch reads each head's weights and the softmax layer once per round
    rather than once per row; `log_scales[d]`: the calibration's log multiplier of heads' arcs at depth d
    (index 0 unused), for d up to the heads' number; `depth_limit`: the deepest node (default and at most:
    the heads' number); `extension`: context tokens outside the draft vocabulary every row may draft
    (`context_vocab.py`).

    Each round adds each row's `round_size` best candidates by calibrated path log-probability (`topk`),
    then expands them: the nodes of round r sit at depths 1..r, so heads 1..r run on all of them and each
    node keeps its own depth's state. Every row has as many candidates as any other (each expanded node
    adds top_k), so the rows stay one rectangular tensor."""
    device, rows = hidden.device, hidden.shape[0]
    depth_limit = heads.num_heads if depth_limit is None else min(depth_limit, heads.num_heads)
    if depth_limit < 1 or budget < 2:
        empty = torch.zeros(rows, 0, device=device)
        return GrownTree(empty.long(), empty.long(), empty)
    per_round = round_size(budget)
    # a tensor as it is: the captured step passes a device buffer (a host list would be a graph constant)
    scales = log_scales if isinstance(log_scales, torch.Tensor) else torch.tensor(log_scales, device=device)
    chained = heads.chained
    with torch.no_grad():
        root_state = heads.step(0, hidden, root)
        node_states = [root_state[:, None]]  # chained heads: each expanded node's state, tree order [B, n, H]
        ids, values = heads.top_tokens(root_state, top_k, extension=extension)  # [B, k]
        if warp is not None:
            values = warp(values)
        cand_tokens, cand_logprobs = ids, values
        cand_parents = torch.zeros(rows, top_k, dtype=torch.long, device=device)
        cand_depths = torch.ones(rows, top_k, dtype=torch.long, device=device)
        cand_keys = (values + scales[1]).clamp_max(0.0)
        taken = torch.zeros(rows, top_k, dtype=torch.bool, device=device)
        out_tokens, out_parents, out_logprobs, size, rounds = [], [], [], 1, 0
        while size < budget:
            take = min(per_round, budget - size, cand_keys.shape[1] - (size - 1))  # untaken candidates
            if take <= 0:
                break
            keys, pick = cand_keys.masked_fill(taken, -math.inf).topk(take, dim=-1)  # [B, take]
            taken.scatter_(1, pick, True)
            tokens, parents, depths = (
                cand_tokens.gather(1, pick),
                cand_parents.gather(1, pick),
                cand_depths.gather(1, pick),
            )
            logprobs = cand_logprobs.gather(1, pick).masked_fill(keys == -math.inf, -math.inf)
            out_tokens.append(tokens)
            out_parents.append(parents)
            out_logprobs.append(logprobs)
            size += take
            rounds += 1
            deepest = min(rounds, depth_limit - 1)  # this round's nodes are at depths 1..rounds
            if size >= budget or deepest < 1:
                continue
            # expand this round's nodes (all rows' at once): head d (0-based) reads a node at depth d (and,
            # chained, the node's parent's state)
            node_hidden = hidden.repeat_interleave(take, dim=0)  # [B * take, H], row-major like tokens
            parent_states = None
            if chained:
                known = torch.cat(node_states, dim=1)  # [B, nodes so far, H]
                parent_states = known.gather(1, parents[..., None].expand(-1, -1, known.shape[-1])).flatten(0, 1)
            flat_tokens, flat_depths = tokens.flatten(), depths.flatten()
            states = torch.stack(
                [heads.step(d, node_hidden, flat_tokens, parent_states) for d in range(1, deepest + 1)]
            )
            which = (flat_depths - 1).clamp_max(deepest - 1)
            states = states[which, torch.arange(rows * take, device=device)]
            if chained:
                node_states.append(states.view(rows, take, -1))
            ids, values = heads.top_tokens(states, top_k, extension=extension)  # [B * take, k]
            if warp is not None:
                values = warp(values)
            ids, values = ids.view(rows, take, top_k), values.view(rows, take, top_k)
            child_keys = keys[..., None] + (
                values + scales[(depths + 1).clamp_max(len(log_scales) - 1)][..., None]
            ).clamp_max(0.0)
            child_keys = child_keys.masked_fill((depths >= depth_limit)[..., None], -math.inf)
            index = torch.arange(size - take, size, device=device)  # tree indices of this round's nodes
            cand_tokens = torch.cat([cand_tokens, ids.flatten(1)], dim=1)
            cand_logprobs = torch.cat([cand_logprobs, values.flatten(1)], dim=1)
            cand_parents = torch.cat([cand_parents, index.repeat_interleave(top_k).expand(rows, -1)], dim=1)
            cand_depths = torch.cat([cand_depths, (depths + 1).repeat_interleave(top_k, dim=1)], dim=1)
            cand_keys = torch.cat([cand_keys, child_keys.flatten(1)], dim=1)
            taken = torch.cat([taken, torch.zeros(rows, take * top_k, dtype=torch.bool, device=device)], dim=1)
    if not out_tokens:
        empty = torch.zeros(rows, 0, device=device)
        return GrownTree(empty.long(), empty.long(), empty)
    return GrownTree(torch.cat(out_tokens, dim=1), torch.cat(out_parents, dim=1), torch.cat(out_logprobs, dim=1))
