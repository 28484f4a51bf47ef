"""The captured decode step (issue #58, points 2-4): one greedy decoding step as ONE function over device
tensors, with fixed shapes per tree size ("bucket"), so that `torch.compile(fullgraph=True)` makes one
graph of it per bucket and a GPU replays it as one CUDA graph:

    model.generate(**inputs, custom_generate=hf_bpd.generate, assistant=drafter, cache_implementation="static",
                   captured_step=True)    # None (default, auto): the static path until a GPU check
                                          # turns auto on for CUDA (`AUTO_DEVICES`)

The step, in order, all on the device (`captured_step`):
  tree      "previous" heads GROW it (`grown_tree`): the best-first search the eager path runs
            (`expansion.grow_on_device`), N nodes, from the last step's root and hidden state, with the
            calibration's weights computed from its sums on the device; depths and the ancestor mask follow from the
            parents by `max_depth` gathers. Other heads fill a FIXED topology (`Topology`, `fixed_tree`: each
            node a (parent, rank) pair, its token rank r of its depth's head applied to the root for
            "next" heads, to nothing for plain Medusa heads, to the parent's token for "previous" heads
            given a topology). Nodes the search did not reach, or
            past the positions the model serves, become masked pads (nobody attends to them, no walk enters).
  mask      [1, 1, N, capacity] from the cache's length AS A DEVICE TENSOR (the static layers' own
            `cumulative_length`): the cached columns, then the tree's ancestor mask at columns
            length .. length + N - 1, the rest masked.
  forward   the tree on the static cache (`StaticLayer.update` writes at length + arange(N)), position
            ids length + depth.
  accept    greedy: the deepest node whose path the model's argmax agrees with (`greedy_last_node`'s rule),
            its path as [D + 1] node indices, the emitted tokens and their count; and what each smaller
            bucket's tree (this tree's first s nodes) would have emitted, for the bucket chooser.
  learn     a grown tree's calibration sums updated from the walk (`observe_walk`, what
            `BlockDrafter.observe` learns on the host), so the next step is weighed with them.
  compact   the kept nodes' keys/values copied (device indices, `index_copy_`) to the front of the tree slot
            of every layer, and every layer's `cumulative_length` set in place to length + count: no
            `crop(int)`, no host integer.
  next      the next step's root (the bonus token) and hidden state (the last accepted node's) written
            into the decoder's state buffers.
It returns one small int64 buffer [count, tokens..., smaller buckets' counts...]: the host reads it with one
copy per step (into pinned memory, non-blocking, on an accelerator; `stats.host_syncs["read"]`), and runs
eos, max length, the streamer and the stats on it, ONE STEP BEHIND: on an accelerator the next step is
launched before the last one is read (`CapturedDecoder`'s loop keeps at most two steps in flight, within the
cache's room), and a step launched after the one that stopped is simply dropped (the cache's length is put
back at the end).

Buckets: the tree sizes of `CAPTURED_TREE_SIZES` up to the drafter's tree budget and `MAX_BUCKET_COST`
(or `drafter.captured_sizes = (...)`), one graph each, all compiled before a call's first step
(`CapturedDecoder.warm_up`). The host picks each step's bucket (`BucketChooser`): the most tokens per
second, both learned online on this device (so a GPU's flat cost curve picks large trees and a CPU's
steep one small trees), among those that fit the cache's room (a bound, while a step is in flight). A
fixed topology (`Topology.best_first` from a table of per-(depth, rank) acceptance, `rank_prior` by default,
`rank_acceptance` measured on the base model's own greedy answers, or Medusa-style rank paths,
`Topology.from_paths`; `drafter.captured_topology = ...` makes any drafter use one) is pure tensor
indexing of the heads' top-k, its bucket n its first n nodes; it cannot follow each step's head
probabilities, which is why "previous" heads grow theirs.

What the captured step does not do (the call then takes the existing static path, `row.decode`, or is
refused when `captured_step=True` asked for it; `captured_refusal`): sampling, logits processors, stopping
criteria without a host form (`HostStop`), per-token scores/logits, batches, recurrent state, attention
windows, padded prompts, rescorers, context-copy heads, retrieval corpora. The n-gram context lookup (`BlockDrafter.
context_lookup`) runs ON THE DEVICE inside the step (`lookup.lookup_on_device`, over a sequence buffer the
step appends its tokens to) for grown trees, and is off for fixed topologies. The drafter's calibration
sums are read at a call's start, learned on by every step and written back after the call's last one.

Host waits are counted with `syncs.StepSyncCounter` (device-to-host reads, `.item()`, `.tolist()`,
blocking cross-device copies, tensors made from host values): an uncompiled step makes none, the loop one
read per step (`BlockDrafter.count_host_syncs`; tests/test_captured_step.py). A compiled step's graph
cannot hold one (`fullgraph=True` raises on the graph break a host read is).

On a CPU, `captured_step="inductor"` compiles the step with the drafter's CPU kernels inside
(`packed_linear`: oneDNN's and the streamed kernel's packed weights are custom ops in the graph, packed
before the first compile, `PackedLinear.pack_planned`); the graphs are never frozen (`CapturedDecoder.run`).

Only the public extension points: 4D masks, `position_ids` and the static cache's own tensors.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import time
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from ..compat import CACHE_NAMES, cache_argument, last_hidden_state_request
from ..cpu.packed_linear import active_packed_linear
from ..drafting.calibration import HEADS
from ..drafting.expansion import grow_on_device
from ..drafting.lookup import LOOKUP_PROBABILITY, MAX_NGRAM, lookup_on_device, lookup_source
from .accept import AcceptResult
from .cost import running_mean
from .static_cache import is_static, static_capacity
from .support import has_recurrent_state, index_position_block
from .syncs import StepSyncCounter, phase

# tree sizes a captured step is compiled for (one graph each), cut to the drafter's tree budget
CAPTURED_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# buckets whose tree costs more than this many one-token forwards by the drafter's forward-cost curve are
# not compiled (a CPU's steep curve; a GPU's flat one keeps them all): each is a graph to compile per cache
# capacity, and a tree that dear would need a tau the heads do not reach to pay for itself
MAX_BUCKET_COST = 2.0
# graphs the compiled step may hold: a few buckets for each cache capacity a process decodes on
RECOMPILE_LIMIT = 64
# device types where `captured_step=None` (auto) takes the captured step: none until a GPU run has checked
# it (research/gpu; CUDA graphs cannot be exercised on a CPU), then {"cuda"}
AUTO_DEVICES: frozenset[str] = frozenset()
# values `generate(captured_step=...)` takes besides a torch.compile backend name
CAPTURED_SETTINGS = (None, True, False)
# the calibration's sources a grown tree's arcs come from, by row of the step's count table: the heads'
# arcs, then the context-lookup chains of an n-gram match, n = 1 .. MAX_NGRAM
CALIBRATION_SOURCES = (HEADS, *(lookup_source(n) for n in range(1, MAX_NGRAM + 1)))


# --------------------------------------------------------------------------------------------- topology
@dataclass(frozen=True)
class Topology:
    """A fixed draft-tree shape: node i > 0 is rank `ranks[i]` (0-based) of the heads' top-k at its depth,
    below node `parents[i]` (< i). Node 0 is the root (parent -1)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1 or len(self.ranks) != len(self.parents):
            raise ValueError("a topology starts with its root (parent -1) and gives every node a rank")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i or self.ranks[i] < 0:
                raise ValueError(f"node {i}: its parent must precede it and its rank be >= 0")
        seen = set(zip(self.parents[1:], self.ranks[1:]))
        if len(seen) != len(self.parents) - 1:
            raise ValueError("two nodes of a topology share a parent and a rank")

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        out = [0]
        for p in self.parents[1:]:
            out.append(out[p] + 1)
        return tuple(out)

    def prefix(self, n: int) -> Topology:
        """The first `n` nodes: a tree, since parents precede their children."""
        return Topology(self.parents[:n], self.ranks[:n])

    @classmethod
    def from_paths(cls, paths) -> Topology:
        """Medusa's form: each path a tuple of ranks from the root's child down (`(0,)`, `(1,)`, `(0, 0)`,
        ...), in order of preference; prefixes missing from the list are added before their path."""
        parents, ranks, index = [-1], [0], {(): 0}
        for path in paths:
            for d in range(1, len(path) + 1):
                key = tuple(path[:d])
                if key not in index:
                    index[key] = len(parents)
                    parents.append(index[key[:-1]])
                    ranks.append(int(key[-1]))
        return cls(tuple(parents), tuple(ranks))

    def paths(self) -> list[tuple[int, ...]]:
        """Every node's rank path (the root's: empty): `from_paths` of it gives this topology back."""
        out: list[tuple[int, ...]] = [()]
        for p, r in zip(self.parents[1:], self.ranks[1:]):
            out.append((*out[p], r))
        return out

    @classmethod
    def best_first(cls, size: int, depth: int, top_k: int, accept: list[list[float]] | None = None) -> Topology:
        """The `size` nodes of highest path probability (ties: first found), where `accept[d][r]` is the
        chance that the node of rank r at depth d + 1 is the base model's token when its parent is: the
        static tree with the most expected accepted tokens under that table (`rank_prior` by default)."""
        accept = rank_prior(depth, top_k) if accept is None else accept
        parents, ranks, depths, probs = [-1], [0], [0], [1.0]
        heap: list[tuple[float, int, int, int]] = []
        counter = 0

        def push(node: int) -> None:
            nonlocal counter
            d = depths[node]
            if d < min(depth, len(accept)):
                for r, p in enumerate(accept[d][:top_k]):
                    heapq.heappush(heap, (-probs[node] * p, counter, node, r))
                    counter += 1

        push(0)
        while len(parents) < size and heap:
            neg, _, parent, rank = heapq.heappop(heap)
            parents.append(parent)
            ranks.append(rank)
            depths.append(depths[parent] + 1)
            probs.append(-neg)
            push(len(parents) - 1)
        return cls(tuple(parents), tuple(ranks))


def rank_prior(depth: int, top_k: int) -> list[list[float]]:
    """A prior of per-(depth, rank) acceptance for `Topology.best_first`: the top-1 token of head d is
    accepted with 0.6 * 0.85^d and each next rank half as often. A table measured on the heads' own data
    (accepted rank counts) is the better choice where one exists."""
    return [[0.6 * 0.85**d * 0.5**r for r in range(top_k)] for d in range(depth)]


def rank_acceptance(model, heads, sequences, top_k: int) -> list[list[float]]:
    """The `accept` table of `Topology.best_first` measured on the base model's own greedy answers:
    `sequences` are (prompt length, ids [L]) pairs of a prompt and what plain greedy `generate` answered.
    At each answer position, head d reads the base model's hidden state there and (for token-input heads)
    the true token before its target, exactly what a tree node under a correct parent sees, so the share of
    positions where the true token is rank r of its top-k is the chance that node (d + 1, r) is accepted
    once its parent is. Returns [num_heads][top_k] shares."""
    counts = torch.zeros(heads.num_heads, top_k, dtype=torch.float64)
    totals = torch.zeros(heads.num_heads, dtype=torch.float64)
    with torch.no_grad():
        for prompt_len, ids in sequences:
            ids = ids.view(-1)
            out = model(ids[None], output_hidden_states=True, return_dict=True)
            hidden = out.hidden_states[-1][0].to(heads.dtype)  # [L, H]: position t predicts ids[t + 1]
            t = torch.arange(max(prompt_len - 1, 0), ids.numel() - 2, device=ids.device)
            if t.numel() == 0:
                continue
            # tokens t+1, t+2, ... (-1 past the end): the true tokens the heads read, teacher forced
            ahead = t[:, None] + 1 + torch.arange(heads.num_heads, device=ids.device)
            continuation = torch.where(ahead < ids.numel(), ids[ahead.clamp_max(ids.numel() - 1)], -1)
            states = heads.head_states(hidden[t], heads.teacher_forced_tokens(continuation))  # [n, h, H]
            for d in range(heads.num_heads):
                valid = t < ids.numel() - 2 - d  # head d's target: ids[t + 2 + d]
                if not bool(valid.any()):
                    continue
                top, _ = heads.top_tokens(states[valid, d], top_k)
                counts[d] += (top == ids[t[valid] + 2 + d][:, None]).sum(0).double().cpu()
                totals[d] += int(valid.sum())
    return (counts / totals.clamp_min(1)[:, None]).tolist()


# ----------------------------------------------------------------------------------------------- buckets
class TreeBucket:
    """The constant device tensors of one topology prefix of N nodes (made once, never per step): the tree's
    levels (which nodes each depth's head expands, which rank each node takes), depths, parents, the
    ancestor mask, and the path selector of the accept walk."""

    def __init__(
        self,
        topology: Topology | None,
        token_input: str,
        device: torch.device,
        capacity: int,
        *,
        size: int | None = None,
        max_depth: int | None = None,
        top_k: int | None = None,
        sizes: tuple[int, ...] = (),
        lookup: int = 0,
    ) -> None:
        self.columns = torch.arange(capacity, device=device)
        self.compiled = False  # its graph was compiled (`CapturedDecoder.run`)
        self.topology = topology
        if topology is None:  # grown each step (`grown_tree`): only its size and depth are constants
            n = self.size = size
            # the heads' depth, and a context-lookup chain of `lookup` nodes that competes with their nodes
            self.head_depth, self.lookup = min(max_depth, n - 1), min(lookup, n - 1)
            self.max_depth, self.top_k, self.levels = max(self.head_depth, self.lookup), top_k, []
            self.chain_depths = torch.arange(1, self.lookup + 1, device=device)
            # chain node j (merged index n + j) hangs below node n + j - 1, the first below the root
            self.chain_parents = torch.tensor([0, *range(n, n + self.lookup - 1)][: self.lookup], device=device)
            self.merged_slots = torch.arange(n + self.lookup, device=device)
            self._common(device, sizes)
            return
        n = self.size = len(topology)
        depths = topology.depths
        self.max_depth = max(depths)
        levels = [[0]]
        for d in range(1, self.max_depth + 1):
            levels.append([i for i in range(n) if depths[i] == d])
        self.levels = []  # per depth d >= 1: (expanded parents' index in level d-1, state index, rank), k
        for d in range(1, self.max_depth + 1):
            nodes = levels[d]
            previous = {node: j for j, node in enumerate(levels[d - 1])}
            if token_input == "previous":
                expanded = sorted({topology.parents[i] for i in nodes})
                slot = {p: j for j, p in enumerate(expanded)}
                expand = [previous[p] for p in expanded]
                state = [slot[topology.parents[i]] for i in nodes]
            else:  # plain and "next" heads: one state per depth, whatever the parent
                expand, state = [0], [0] * len(nodes)
            ranks = [topology.ranks[i] for i in nodes]
            self.levels.append(
                (
                    torch.tensor(expand, device=device),
                    torch.tensor(state, device=device),
                    torch.tensor(ranks, device=device),
                    max(ranks) + 1,
                )
            )
        level_order = [i for level in levels for i in level]
        self.node_order = torch.tensor(sorted(range(n), key=level_order.__getitem__), device=device)
        self.depths = torch.tensor(depths, device=device)
        self.ranks = torch.tensor(topology.ranks, device=device)
        self.parents = torch.tensor([max(p, 0) for p in topology.parents], device=device)
        ancestors = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            ancestors[i] |= ancestors[topology.parents[i]]
        self.ancestors = ancestors.to(device)
        self.top_k = max([k for *_, k in self.levels], default=1)
        self._common(device, sizes)

    def _common(self, device: torch.device, sizes: tuple[int, ...]) -> None:
        n = self.size
        self.is_root = torch.arange(n, device=device) == 0
        self.drafted = torch.ones(n, dtype=torch.bool, device=device)
        self.eye = torch.eye(n, dtype=torch.bool, device=device)
        self.path_depths = torch.arange(self.max_depth + 1, device=device)
        self.slots = torch.arange(n, device=device)
        # the smaller buckets whose steps this one's walk also scores (its first s nodes: `BucketChooser`)
        self.within = tuple(s for s in sizes if s <= n) or (n,)
        self.within_sizes = torch.tensor(self.within, device=device)

    @property
    def grown(self) -> bool:
        return self.topology is None


def draft_tokens(heads, bucket: TreeBucket, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """The tree's tokens [N] (node order) from `hidden [1, H]` and `root [1]`, level by level: pure
    indexing of each depth's top-k."""
    kind = heads.config.token_input
    level_tokens = [root]
    level_states = [None]  # chained heads: each level's nodes' states, as their children read them
    for d, (expand, state, rank, k) in enumerate(bucket.levels):
        parent_tokens = level_tokens[-1].index_select(0, expand)  # [m]
        if kind == "previous":
            tokens = parent_tokens
        elif kind == "next":
            tokens = root
        else:
            tokens = None
        parents = level_states[-1].index_select(0, expand) if heads.chained and d else None
        states = heads.step(d, hidden.expand(expand.shape[0], -1), tokens, parents)
        ids, _ = heads.top_tokens(states, k)  # [m, k]
        level_tokens.append(ids[state, rank])
        level_states.append(states[state])
    return torch.cat(level_tokens).index_select(0, bucket.node_order)


@dataclass
class DeviceTree:
    """One step's draft tree on the device, N nodes in an order where parents precede their children: token
    ids, depths, parent indices (the root's: 0), the ancestor mask [N, N] (each node's row: itself and its
    ancestors) and which nodes were drafted (the others are masked pads no walk enters)."""

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    ancestors: torch.Tensor
    drafted: torch.Tensor
    # grown trees: each node's raw arc log-probability and its `CALIBRATION_SOURCES` row, which the step's
    # calibration learns from (`observe_walk`); a fixed topology has no estimates to calibrate
    arc_logprobs: torch.Tensor | None = None
    sources: torch.Tensor | None = None


def fixed_tree(heads, bucket: TreeBucket, state: CapturedState) -> DeviceTree:
    """The bucket's fixed topology filled from the heads' top-k (`draft_tokens`)."""
    tokens = draft_tokens(heads, bucket, state.hidden, state.root)
    return DeviceTree(tokens, bucket.depths, bucket.parents, bucket.ancestors, bucket.drafted)


def ancestry(parents: torch.Tensor, slots: torch.Tensor, eye: torch.Tensor, max_depth: int):
    """(depths [N], ancestor mask [N, N]) of a tree given by its parents (the root's: 0), by `max_depth`
    gathers that walk every node up one level at a time, in parallel."""
    node, depths, ancestors = slots, torch.zeros_like(slots), eye
    for _ in range(max_depth):
        depths = depths + (node != 0).long()
        node = parents.index_select(0, node)
        ancestors = ancestors | eye.index_select(0, node)
    return depths, ancestors


def grown_tree(heads, bucket: TreeBucket, state: CapturedState, length: torch.Tensor) -> DeviceTree:
    """The tree the best-first search grows this step ("previous" heads; `expansion.grow_on_device`, the
    search the eager path runs, with the calibration's depth weights as a device buffer): its nodes follow
    each step's head probabilities, where a fixed topology only follows ranks. A search that stops short of
    N nodes leaves masked pads. With `bucket.lookup`, the context-lookup chain (`lookup_on_device` over
    the sequence buffer, whose first `length` + 1 tokens are the context) joins the heads' nodes and the N
    of highest calibrated path probability are kept, as the eager drafter's `merge_lookup` does (a chain
    token the heads drafted too is a second node here, not merged into theirs)."""
    n = bucket.size
    scales = calibrated_log_scales(state)
    grown = grow_on_device(heads, state.hidden, state.root, bucket.top_k, n, scales[0], depth_limit=bucket.head_depth)
    pad = n - 1 - grown.tokens.shape[1]  # a Python int while tracing: shapes are static
    device = state.root.device
    tokens = torch.cat([state.root, grown.tokens[0], state.root.new_zeros(pad)])
    parents = torch.cat([state.root.new_zeros(1), grown.parents[0], state.root.new_zeros(pad)])
    reached = torch.cat(
        [bucket.is_root[:1], grown.logprobs[0] > -math.inf, torch.zeros(pad, dtype=torch.bool, device=device)]
    )
    depths, ancestors = ancestry(parents, bucket.slots, bucket.eye, bucket.head_depth)
    raw = torch.cat([tokens.new_zeros(1).float(), grown.logprobs[0].float(), tokens.new_zeros(pad).float()])
    raw = raw.masked_fill(~reached, -1e4)  # the heads' own arc estimates (pads: none)
    if not bucket.lookup:
        return DeviceTree(tokens, depths, parents, ancestors, reached, raw, torch.zeros_like(tokens))
    # the heads' nodes' calibrated arcs (as the search ranked them), then the chain's
    arcs = (raw + scales[0].index_select(0, depths)).clamp_max(0.0).masked_fill(~reached, -1e4)
    chain, real, ngram = lookup_on_device(state.sequence, length + 1, bucket.lookup)
    chain_raw = torch.full_like(bucket.chain_depths, math.log(LOOKUP_PROBABILITY), dtype=raw.dtype)
    chain_scales = scales.index_select(0, ngram.view(1))[0, 1 : bucket.lookup + 1]
    chain_arcs = (chain_raw + chain_scales).clamp_max(0.0)
    merged, into = merged_chain_prefix(tokens, parents, reached & ~bucket.is_root, chain, real)
    # a merged node keeps the better of its two arcs, as `merge_lookup` does (slot n: a sink for the others)
    better = torch.where(merged & (chain_arcs > arcs.index_select(0, into)), into, n)
    arcs = torch.cat([arcs, arcs[:1]]).scatter(0, better, chain_arcs)[:n]
    raw = torch.cat([raw, raw[:1]]).scatter(0, better, chain_raw)[:n]
    sources = torch.zeros(n + 1, dtype=torch.long, device=device).scatter(0, better, ngram.expand(bucket.lookup))[:n]
    paths = (ancestors.float() * arcs[None, :]).sum(-1).masked_fill(~reached, -math.inf)
    # the chain's own nodes hang below the deepest merged one (the root when none is)
    deepest = into.index_select(0, merged.long().sum(0, keepdim=True).sub(1).clamp_min(0)) * merged.any()
    own = chain_arcs.masked_fill(merged, 0.0).cumsum(0)
    chain_paths = (paths.index_select(0, deepest) + own).masked_fill(~real | merged, -math.inf)
    follows_merged = torch.cat([merged.new_zeros(1), merged[:-1]])
    chain_parents = torch.where(follows_merged, torch.cat([into[:1], into[:-1]]), bucket.chain_parents)
    keys = torch.cat([paths.masked_fill(bucket.is_root, math.inf), chain_paths])
    # by path probability, then depth, then index: parents before children (a child's path is never more
    # probable, and ties go to the shallower node), so the first N are a tree
    by_depth = torch.sort(torch.cat([depths, bucket.chain_depths]), stable=True).indices
    keep = by_depth.index_select(0, torch.sort(-keys.index_select(0, by_depth), stable=True).indices[:n])
    where = torch.zeros_like(bucket.merged_slots).scatter(0, keep, bucket.slots)  # merged index -> kept index
    parents = where.index_select(0, torch.cat([parents, chain_parents]).index_select(0, keep))
    tokens = torch.cat([tokens, chain]).index_select(0, keep)
    drafted = (keys > -math.inf).index_select(0, keep)
    raw = torch.cat([raw, chain_raw]).index_select(0, keep)
    sources = torch.cat([sources, ngram.view(1).expand(bucket.lookup)]).index_select(0, keep)
    depths, ancestors = ancestry(parents, bucket.slots, bucket.eye, bucket.max_depth)
    return DeviceTree(tokens, depths, parents, ancestors, drafted, raw, sources)


def merged_chain_prefix(tokens, parents, drafted, chain, real) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the chain's first tokens the heads drafted too, as a path from the root (`merge_lookup`
    merges those into the heads' nodes), and the heads' node each merges into: ([L] bool, [L] node index,
    0 where not merged). Siblings never share a token, so each is found by one comparison over the tree."""
    node = torch.zeros(1, dtype=torch.long, device=tokens.device)
    on_heads = torch.ones(1, dtype=torch.bool, device=tokens.device)
    merged, into = [], []
    for j in range(chain.shape[0]):
        hit = (parents == node) & (tokens == chain[j : j + 1]) & drafted
        on_heads = on_heads & hit.any(0, keepdim=True) & real[j : j + 1]
        node = torch.where(on_heads, hit.long().argmax(0, keepdim=True), node)
        merged.append(on_heads)
        into.append(node * on_heads)
    return torch.cat(merged), torch.cat(into)


def calibrated_log_scales(state: CapturedState) -> torch.Tensor:
    """[len(CALIBRATION_SOURCES), C]: the calibration's log multiplier of an arc of each source (row) at each
    depth (column d: depth d), from the step's count table, as `AcceptanceCalibration.scale` computes it."""
    accepted, predicted = state.calibration.unbind(0)
    return ((accepted + state.prior) / (predicted + state.prior)).log().index_select(1, state.depth_keys)


def observe_walk(state: CapturedState, tree: DeviceTree, on_walk: torch.Tensor, compared: torch.Tensor) -> None:
    """The calibration learns from one step, on the device, as `BlockDrafter.observe` does on the host:
    every `compared` node whose parent is on the accepted walk adds its estimated acceptance (its raw arc
    probability) to its (source, depth) key's predicted sum, and 1 to the accepted sum when the walk took
    it. So the next step's tree is grown and merged with what this call has shown (repetitive text: the
    lookup chains' weights rise within the call), with no host value."""
    observed = (on_walk.index_select(0, tree.parents) & compared).float() * state.learning
    columns = state.calibration.shape[2]
    keys = tree.sources * columns + state.depth_keys.index_select(0, tree.depths)
    counts = state.calibration.view(2, -1)
    counts[0].index_add_(0, keys, on_walk.float() * observed)
    counts[1].index_add_(0, keys, tree.arc_logprobs.exp() * observed)


def captured_step(model, heads, bucket: TreeBucket, cache, state: CapturedState) -> torch.Tensor:
    """One greedy decoding step on the device (module docstring): draft, mask, forward, accept, compact,
    and the next root and hidden state into `state`. Returns [1 + D + 1 + S] int64: the count of emitted
    tokens, the tokens (padded past the count), then the count each smaller bucket's tree (this one's first
    s nodes, s in `bucket.within`) would have emitted. Nothing in it reads a value on the host."""
    device = state.root.device
    n = bucket.size
    length = cache.layers[0].cumulative_length.clone()  # the forward adds n to it in place
    with torch.no_grad():
        tree = grown_tree(heads, bucket, state, length) if bucket.grown else fixed_tree(heads, bucket, state)
        tokens, depths, ancestors = tree.tokens, tree.depths, tree.ancestors
        valid = ((length + depths) < state.limit) & tree.drafted  # positions the model serves, drafted nodes
        seen = (ancestors & valid[None, :]) | bucket.eye
        rel = bucket.columns - length
        in_tree = (rel >= 0) & (rel < n)
        tree_columns = seen.index_select(1, rel.clamp(0, n - 1)) & in_tree[None, :]
        allowed = (bucket.columns < length)[None, :] | tree_columns
        dtype = state.hidden.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        positions = (length + depths).clamp_max(state.limit - 1)
        out = model(
            input_ids=tokens[None],
            attention_mask=mask[None, None],
            position_ids=positions[None],
            **{state.cache_name: cache},
            use_cache=True,
            output_hidden_states=state.hidden_request,
            return_dict=True,
        )
        choices = out.logits[0].argmax(dim=-1)  # [N]
        matched = (tokens == choices.index_select(0, tree.parents)) | bucket.is_root
        good = matched & valid
        reached = ~(ancestors & ~good[None, :]).any(-1)
        last = (reached.long() * (depths + 1)).argmax(dim=0, keepdim=True)  # [1]: no 0-d index (a host int)
        count = depths.index_select(0, last) + 1  # [1]
        by_depth = depths[None, :] == bucket.path_depths[:, None]  # [D + 1, N]
        on_path = ancestors.index_select(0, last) & by_depth
        path = on_path.long().argmax(-1)  # node at each depth of the walk (0 past its end)
        prefix = reached[None, :] & (bucket.slots[None, :] < bucket.within_sizes[:, None])  # [S, N]
        within = (prefix.long() * (depths + 1)[None, :]).amax(-1)
        emitted = choices.index_select(0, path)
        if tree.arc_logprobs is not None:
            observe_walk(state, tree, ancestors.index_select(0, last)[0], valid & ~bucket.is_root)
        target = length + bucket.path_depths
        source = length + path
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                t.index_copy_(2, target, t.index_select(2, source))
            layer.cumulative_length.copy_((length + count).view(()))
        state.sequence.index_copy_(0, length + 1 + bucket.path_depths, emitted)  # past the count: never read
        state.root.copy_(choices.index_select(0, last))
        state.hidden.copy_(out.hidden_states[-1][0].index_select(0, last).to(dtype))
        return torch.cat([count, emitted, within])


@dataclass
class CapturedState:
    """What the step carries from one step to the next, on the device: the root token [1], the hidden state
    [1, H] it came from, the first position the model does not serve (0-d), the sequence so far, the
    calibration's sums (learned by every step: `observe_walk`), and two constants of the call."""

    root: torch.Tensor
    hidden: torch.Tensor
    limit: torch.Tensor
    sequence: torch.Tensor  # [capacity + room]: the context, then the tokens each step emits (context lookup)
    # [2, len(CALIBRATION_SOURCES), C]: accepted and predicted sums per (source, depth key), C > any depth
    calibration: torch.Tensor
    depth_keys: torch.Tensor  # [C]: a depth's column in `calibration` (deeper than its max_depth: that one)
    prior: torch.Tensor  # 0-d: the calibration's pseudo-observations
    learning: torch.Tensor  # 0-d: 1, or 0 for a drafter without a calibration (its weights stay neutral)
    cache_name: str
    hidden_request: int | bool

    @classmethod
    def empty(
        cls, hidden_size: int, depth: int, sequence_length: int, device, dtype, cache_name="", hidden_request=True
    ) -> CapturedState:
        """Buffers for trees up to `depth` deep (heads or a lookup chain), to be `load`ed per call."""
        columns = depth + 1

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            root=zeros(1),
            hidden=zeros(1, hidden_size, dtype=dtype),
            limit=zeros(),
            sequence=zeros(sequence_length),
            calibration=zeros(2, len(CALIBRATION_SOURCES), columns, dtype=torch.float32),
            depth_keys=torch.arange(columns, device=device),
            prior=zeros(dtype=torch.float32),
            learning=zeros(dtype=torch.float32),
            cache_name=cache_name,
            hidden_request=hidden_request,
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer (CUDA graphs need their addresses fixed)."""
        fields = (self.root, self.hidden, self.limit, self.sequence, self.calibration, self.depth_keys)
        return (*fields, self.prior, self.learning)

    def load(self, ids: torch.Tensor, hidden: torch.Tensor, limit: int, calibration) -> None:
        """A call's start: the context `ids [L]` (its last token the first root), the hidden state that
        predicted it, the first position the model does not serve, and the drafter's `calibration`'s greedy
        sums (an `AcceptanceCalibration`, or None: neutral weights, nothing learned)."""
        self.root.copy_(ids[-1:])
        self.hidden.copy_(hidden.view(1, -1))
        self.limit.fill_(limit)
        self.sequence[: ids.shape[0]].copy_(ids)
        columns = self.calibration.shape[2]
        if calibration is None:
            self.calibration.zero_()
            self.prior.fill_(1.0)
            self.learning.fill_(0.0)
            return
        self.calibration.copy_(calibration.count_table(CALIBRATION_SOURCES, columns))
        self.depth_keys.copy_(torch.arange(columns).clamp_max(calibration.max_depth))
        self.prior.fill_(calibration.prior)
        self.learning.fill_(1.0)

    def save(self, calibration) -> None:
        """What the call's steps learned, into the drafter's `calibration` (one read, after the call)."""
        if calibration is not None:
            calibration.load_count_table(CALIBRATION_SOURCES, self.calibration.cpu())


_COMPILED: dict = {}  # backend -> the compiled step


def compiled_step(backend, device_type: str):
    """`captured_step` compiled with `backend` (fullgraph, static shapes: one graph per bucket and cache
    capacity; shared by every decoder, so a second call with the same shapes compiles nothing), or as it is
    for None. Inductor on a GPU replays it as CUDA graphs (mode "reduce-overhead"); on a CPU the graph calls
    the drafter's packed CPU kernels (`packed_linear`) as custom ops. Never frozen (`CapturedDecoder.run`)."""
    if backend is None:
        return captured_step
    fn = _COMPILED.get((backend, device_type))
    if fn is None:
        mode = "reduce-overhead" if backend == "inductor" and device_type == "cuda" else None
        fn = torch.compile(captured_step, backend=backend, fullgraph=True, dynamic=False, mode=mode)
        _COMPILED[(backend, device_type)] = fn
    return fn


class CapturedDecoder:
    """The buckets, state buffers and compiled step of one (model, heads, cache shape): kept across
    `generate` calls (`decoder_for`), so their graphs are reused."""

    def __init__(
        self,
        model,
        heads,
        topology: Topology | None,
        sizes,
        capacity: int,
        device,
        dtype,
        backend,
        top_k: int,
        lookup: int = 0,
    ):
        self.heads, self.backend = heads, backend  # not the model: decoders are kept per model, weakly
        kind = heads.config.token_input
        if topology is None:  # grown each step by the best-first search, with a context-lookup chain
            self.buckets = {
                n: TreeBucket(
                    None,
                    kind,
                    device,
                    capacity,
                    size=n,
                    max_depth=heads.num_heads,
                    top_k=top_k,
                    sizes=sizes,
                    lookup=lookup,
                )
                for n in sizes
            }
        else:
            self.buckets = {n: TreeBucket(topology.prefix(n), kind, device, capacity, sizes=sizes) for n in sizes}
        self.lookup = min(lookup, max(sizes) - 1) if topology is None else 0  # the longest bucket's chain
        deepest = max(b.max_depth for b in self.buckets.values())
        self.state = CapturedState.empty(
            heads.config.hidden_size,
            max(deepest, heads.num_heads),
            capacity + deepest + 2,
            device,
            dtype,
            cache_argument(model),
            last_hidden_state_request(model),
        )
        if device.type == "cuda":  # updated in place by every replay: fixed addresses for CUDA graphs
            for t in self.state.tensors():
                torch._dynamo.mark_static_address(t)
        self.step_fn = compiled_step(backend, device.type)
        active_packed_linear()  # makes this thread's packed-linear stack, which the heads' graph guards on

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, limit: int, drafter) -> None:
        """The call's state, once before its first step (`CapturedState.load`), and the packed CPU kernels'
        weights: every weight the plan packs is packed here, not on its first use inside a step (setup work
        a step should not do), and a traced step only reads the packed copies there are
        (`PackedLinear.pack_planned`)."""
        self.state.load(ids, hidden, limit, drafter.calibration)
        packed = active_packed_linear()
        if packed is not None:
            packed.pack_planned(self.heads.packed_extra_weights())  # the LM-head rows the heads borrow

    def fitting(self, room: int) -> list[int]:
        """The bucket sizes of at most `room` nodes (none: not even the root fits)."""
        return [n for n in self.buckets if n <= room]

    def warm_up(self, model, cache) -> float:
        """Compile every bucket not compiled yet, before the call's first step is timed (issue #58, point
        3): each runs once from the call's state, which is then put back, with the cache's length (what
        a step wrote past it is never read). Returns the seconds it took (0: nothing to compile)."""
        cold = [b for b in self.buckets.values() if not b.compiled]
        if self.backend is None or not cold:
            return 0.0
        t0 = time.perf_counter()
        kept = (self.state.root, self.state.hidden, self.state.calibration)  # what a step changes that is read
        saved = [t.clone() for t in kept]
        length = cache.layers[0].cumulative_length.clone()
        for bucket in cold:
            self.run(model, bucket, cache)
            for t, value in zip(kept, saved):
                t.copy_(value)
            for layer in cache.layers:
                layer.cumulative_length.copy_(length)
        return time.perf_counter() - t0

    def run(self, model, bucket: TreeBucket, cache) -> torch.Tensor:
        if self.backend is None:
            return self.step_fn(model, self.heads, bucket, cache, self.state)
        # never inductor's freezing, which a process may have turned on for a compiled forward (the bench does):
        # dynamo and inductor would make constants of the step's state and cache tensors, which change from call
        # to call (read where a graph is compiled, so around every call: any may recompile)
        import torch._inductor.config as inductor_config  # loaded by torch.compile on first use: not before

        with inductor_config.patch(freezing=False):
            if bucket.compiled:
                return self.step_fn(model, self.heads, bucket, cache, self.state)
            return self._compile(model, bucket, cache)

    def _compile(self, model, bucket: TreeBucket, cache) -> torch.Tensor:
        # a bucket's first call compiles its graph: every decoder's graphs are entries of the one compiled
        # function, so its entry limit (8 by default) is raised to the graphs decoders may hold
        with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)):
            out = self.step_fn(model, self.heads, bucket, cache, self.state)
        bucket.compiled = True
        return out


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_for(call, cache, backend: str | None, topology: Topology | None = None) -> CapturedDecoder:
    """The decoder of this call's model, heads, cache shape, topology and backend (made once, then reused)."""
    drafter, model = call.drafter, call.model
    heads = drafter.heads
    budget = max(1, min(drafter.tree_budget, CAPTURED_TREE_SIZES[-1]))
    if topology is None:
        topology = getattr(drafter, "captured_topology", None)  # set by the user (module docstring)
    if topology is None and not heads.conditions_on_draft:  # only "previous" heads grow trees on the device
        topology = Topology.best_first(budget, heads.num_heads, drafter.top_k)
    if topology is not None:
        budget = min(budget, len(topology))
    sizes = tuple(n for n in CAPTURED_TREE_SIZES if n < budget) + (budget,)
    cost = drafter.forward_cost
    if cost is not None:
        sizes = tuple(n for n in sizes if n == sizes[0] or cost(n) <= MAX_BUCKET_COST * cost(1))
    chosen = getattr(drafter, "captured_sizes", None)  # set by the user (module docstring)
    if chosen:
        sizes = tuple(sorted({min(max(int(n), 1), budget) for n in chosen}))
    layer = cache.layers[0]
    lookup = drafter.context_lookup if topology is None else 0  # the chain joins grown trees only
    shape = (id(heads), layer.keys.device, layer.keys.dtype, topology, sizes, backend, drafter.top_k, lookup)
    decoders = _DECODERS.setdefault(model, {})
    key = (shape, static_capacity(cache))
    decoder = decoders.get(key)
    if decoder is None:
        dtype = next(model.parameters()).dtype
        decoder = CapturedDecoder(
            model,
            heads,
            topology,
            sizes,
            static_capacity(cache),
            layer.keys.device,
            dtype,
            backend,
            drafter.top_k,
            lookup,
        )
        decoders[key] = decoder
    # one chooser for every capacity: the buckets' costs and yields do not depend on it
    decoder.chooser = decoders.setdefault(("chooser", shape), BucketChooser())
    return decoder


class BucketChooser:
    """Which bucket each step verifies: the most expected tokens per second of step, both measured online.
    A bucket's tokens: a running mean of what its tree emitted, from its own steps and from every larger
    bucket's (the step scores each smaller bucket's first nodes: `TreeBucket.within`). Its seconds: a
    running mean of its steps' host-measured time (launch to read, or read to read while steps overlap).
    Every size is tried once, largest first (its steps score the smaller ones), and one left unchosen for
    `revisit` steps is tried again, so a load that came and went does not fix the choice for good.
    The sizes it learns are the GPU's own on a GPU: not the eager forward-cost curve."""

    def __init__(self, rate: float = 0.1, revisit: int = 100) -> None:
        self.rate, self.revisit = rate, revisit
        self.tokens: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.chosen_at: dict[int, int] = {}
        self.steps = 0

    def choose(self, fits: list[int]) -> int:
        untried = [n for n in fits if n not in self.seconds]
        if untried:
            return max(untried)
        stale = [n for n in fits if self.steps - self.chosen_at[n] > self.revisit]
        if stale:
            return max(stale)
        return max(fits, key=lambda n: self.tokens[n] / self.seconds[n])

    def observe(self, size: int, within: dict[int, int], seconds: float) -> None:
        """One step of bucket `size`: the tokens it and each smaller bucket would have emitted, its time."""
        self.steps += 1
        self.chosen_at[size] = self.steps
        for n, tokens in within.items():
            self.tokens[n] = running_mean(self.tokens.get(n), tokens, self.rate)
        self.seconds[size] = running_mean(self.seconds.get(size), seconds, self.rate)


# ------------------------------------------------------------------------------------------ the call
def captured_refusal(call, input_ids: torch.Tensor, model_kwargs: dict) -> str | None:
    """Why the captured step does not serve this call (module docstring), or None."""
    model, drafter = call.model, call.drafter
    if input_ids.shape[0] != 1:
        return f"it decodes one row, got a batch of {input_ids.shape[0]}"
    if has_recurrent_state(model):
        return f"{type(model).__name__} keeps a recurrent state"
    cache = next((model_kwargs[name] for name in CACHE_NAMES if model_kwargs.get(name) is not None), None)
    if not is_static(cache):
        return "it runs on a static cache of full-attention layers: pass cache_implementation='static'"
    if call.windows is not None or index_position_block(model) is not None:
        return f"{type(model).__name__} has attention windows or reads positions by cache index"
    if not call.plain_greedy:
        return (
            "it is greedy without logits processors, stopped by max length and eos only (sampling, processors and "
            "other stopping criteria take the static path)"
        )
    if call.wants("scores") or call.wants("logits"):
        return "it returns no per-token scores or logits"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):  # one read, before decoding
        return "the prompt is padded"
    if drafter.rescorer is not None:
        return "its tree is the heads' alone: the drafter has a rescorer"
    if drafter.heads.context_copy is not None:
        return "its heads have no context-copy pointer"
    if drafter.reads_context:
        return "its trees are grown by heads on the device, not by an EAGLE draft layer"
    if drafter.corpus is not None:
        return "its tree has no retrieval chains: the drafter has a corpus"
    if drafter.context_vocab:
        return "its heads draft their draft vocabulary alone: the drafter sets context_vocab"
    if drafter.context_lookup and (drafter.context_lookup_nodes or drafter.lookup_after_drafts):
        return "its context lookup is one chain: the drafter sets context_lookup_nodes or lookup_after_drafts"
    return None


def use_captured(call, input_ids: torch.Tensor, model_kwargs: dict) -> bool:
    """Whether `row.decode` hands this call to `decode_captured`: `captured_step` False never, None (auto) on
    the `AUTO_DEVICES` where it serves, True or a backend name always, refusing (ValueError) where it does
    not serve (before any forward)."""
    setting = getattr(call, "captured", None)
    if setting is False or (setting is None and input_ids.device.type not in AUTO_DEVICES):
        return False
    reason = captured_refusal(call, input_ids, model_kwargs)
    if reason is not None:
        if setting is None:
            return False
        raise ValueError(f"captured_step={setting!r} cannot serve this call: {reason}")
    return True


def check_captured_setting(setting, batched: bool, recurrent: bool) -> None:
    """Refuse a `captured_step` value `generate` cannot take, or one asked for a batch or recurrent model."""
    if setting not in CAPTURED_SETTINGS and not isinstance(setting, str) and not callable(setting):
        raise ValueError(f"captured_step takes None (auto), True, False or a torch.compile backend, got {setting!r}")
    if setting not in (None, False) and (batched or recurrent):
        what = "a batch" if batched else "a model with recurrent state"
        raise ValueError(
            f"captured_step={setting!r} cannot serve this call: it decodes one row of a full-attention model, "
            f"got {what}"
        )


def backend_of(setting, device: torch.device):
    """The torch.compile backend of a `captured_step` setting: a name (or a backend callable) as given;
    True/None: inductor (CUDA graphs) on a GPU, no compile on a CPU (the same step, run eagerly)."""
    if isinstance(setting, str) or callable(setting):
        return setting
    return "inductor" if device.type == "cuda" else None


class HostRead:
    """A step's output on its way to the host: on an accelerator a non-blocking copy into pinned memory and
    an event, waited for when read; on a CPU the tensor itself."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = values.clone(), None  # the next step may run before it is read

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()  # the step's one host read


def decode_captured(call, input_ids: torch.Tensor, model_kwargs: dict, ahead: bool | None = None):
    """`row.decode` for a call `use_captured` accepted: prefill as `generate`, then captured steps, the host
    one step behind (module docstring). `ahead`: launch a step before reading the last one (default: on
    an accelerator, where the two overlap; on a CPU it would only waste the last step)."""
    stats, drafter = call.stats, call.drafter
    start = call.prefill(input_ids, model_kwargs)
    _, cache, hidden_last, sequences, finished = start.state()
    ids = sequences[0]
    device = ids.device
    sequence = ids[0].tolist()
    if finished[0]:
        return call.output([ids], cache)
    backend = backend_of(getattr(call, "captured", None), device)
    decoder = decoder_for(call, cache, backend)
    capacity = static_capacity(cache)
    limit = call.context if call.context is not None else capacity + decoder.buckets[max(decoder.buckets)].max_depth + 1
    decoder.start(ids[0], hidden_last, limit, drafter)
    stats.time_warm_up = decoder.warm_up(call.model, cache)
    ahead = device.type != "cpu" if ahead is None else ahead
    counter = StepSyncCounter() if drafter.count_host_syncs else None
    stop, max_length = call.stop, call.stop.max_length
    in_flight: deque[tuple[TreeBucket, HostRead, float]] = deque()
    cached = len(sequence) - 1  # tokens in the cache as the host knows them (the root is not cached)
    done, last_read = False, time.perf_counter()
    while not done:
        while len(in_flight) < (2 if ahead else 1):
            bound = cached + sum(b.max_depth + 1 for b, *_ in in_flight)
            sure = len(sequence) + len(in_flight)  # each step in flight adds at least one token
            if max_length is not None and sure >= max_length:
                break  # a step in flight ends the call: launching another would be wasted
            fits = decoder.fitting(capacity - bound)
            if not fits:
                break
            bucket = decoder.buckets[decoder.chooser.choose(fits)]
            launched = time.perf_counter()
            with phase(counter, "step") if backend is None else contextlib.nullcontext():
                values = decoder.run(call.model, bucket, cache)
            in_flight.append((bucket, HostRead(values), launched))
        if not in_flight:
            raise RuntimeError(f"a static cache of {capacity} positions has no room left for the next step")
        bucket, pending, launched = in_flight.popleft()
        with phase(counter, "read"):
            values = pending.read()
        now = time.perf_counter()
        d = bucket.max_depth
        decoder.chooser.observe(bucket.size, dict(zip(bucket.within, values[d + 2 :])), now - max(launched, last_read))
        last_read = now
        count, tokens = values[0], []
        for token in values[1 : 1 + count]:
            sequence.append(token)
            tokens.append(token)
            if stop(len(sequence), token):
                done = True
                break
        cached += count
        stats.record_step(True, len(tokens), bucket.size)
        call.emit(AcceptResult(nodes=list(range(len(tokens))), tokens=tokens, scores=[], logits=[], finished=done))
    for layer in cache.layers:  # steps launched after the last one read are dropped: the cache as `generate` leaves it
        layer.cumulative_length.fill_(len(sequence) - 1)
    decoder.state.save(drafter.calibration)
    new = torch.tensor([sequence[ids.shape[1] :]], dtype=ids.dtype, device=device)
    out = call.output([torch.cat([ids, new], dim=-1)], cache)
    if counter is not None:
        stats.host_syncs = {**stats.host_syncs, **counter.counts}
    return out
