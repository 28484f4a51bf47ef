"""The captured decode step (issue #58, points 2-4): one greedy decoding step as ONE function over device
tensors, with fixed shapes per tree size ("bucket"), so that `torch.compile(fullgraph=True)` makes one
graph of it per bucket and a GPU replays it as one CUDA graph:

    model.generate(**inputs, custom_generate=hf_bpd.generate, assistant=drafter, cache_implementation="static",
                   captured_step=True)    # None (default, auto): the static path until a GPU check
                                          # turns auto on for CUDA (`AUTO_DEVICES`)

The step, in order, all on the device (`captured_step`):
  tree      the heads' top-k, indexed by a FIXED topology (`Topology`: each node a (parent, rank) pair, so
            its token is rank r of its depth's head applied to its parent's token for "previous" heads, to
            the root for "next" heads, to nothing for plain Medusa heads). Nodes that would sit past the
            positions the model serves become masked pads (nobody attends to them, no walk enters them).
  mask      [1, 1, N, capacity] from the cache's length AS A DEVICE TENSOR (the static layers' own
            `cumulative_length`): the cached columns, then the tree's ancestor mask at columns
            length .. length + N - 1, the rest masked.
  forward   the tree on the static cache (`StaticLayer.update` writes at length + arange(N)), position
            ids length + depth.
  accept    greedy: the deepest node whose path the model's argmax agrees with (`greedy_last_node`'s rule),
            its path as [D + 1] node indices, the emitted tokens and their count.
  compact   the kept nodes' keys/values copied (device indices, `index_copy_`) to the front of the tree slot
            of every layer, and every layer's `cumulative_length` set in place to length + count: no
            `crop(int)`, no host integer.
  next      the next step's root (the bonus token) and hidden state (the last accepted node's) written
            into the decoder's state buffers.
It returns one small int64 buffer [count, tokens...]: the host reads it with one copy per step (into pinned
memory, non-blocking, on an accelerator; `stats.host_syncs["read"]`), and runs eos, max length, the
streamer and the stats on it, ONE STEP BEHIND: on an accelerator the next step is launched before the
last one is read (`CapturedDecoder`'s loop keeps at most two steps in flight, within the cache's room), and a
step launched after the one that stopped is simply dropped (the cache's length is put back at the end).

Why a fixed topology per bucket: the tree is then pure tensor indexing of the heads' top-k (the static
Medusa tree), and its depths, ancestor mask and the walk's path selector are constants of the bucket, made
once; the whole step is one graph whose only inputs are the state buffers and the cache. The topology is
built best-first from a table of per-(depth, rank) acceptance (`Topology.best_first`; `rank_prior` by
default, `rank_acceptance` measures it on the base model's own greedy answers) or given as Medusa-style
rank paths (`Topology.from_paths`); `drafter.captured_topology = ...` makes a drafter use one. Bucket n is
its first n nodes (parents come before their children, so every prefix is a tree). The host picks each
step's bucket: the largest that fits the cache's room (a bound, while a step is in flight). A fixed tree
cannot follow each step's head probabilities as the best-first search does (`expansion.grow_on_device`,
which also traces as one fullgraph graph: its per-step parents would make the depths and the ancestor mask
per-step tensors instead of constants, the natural next step).

What the captured step does not do (the call then takes the existing static path, `row.decode`, or is
refused when `captured_step=True` asked for it; `captured_refusal`): sampling, logits processors, stopping
criteria without a host form (`HostStop`), per-token scores/logits, batches, recurrent state, attention
windows, padded prompts, rescorers, context-copy heads. The n-gram context lookup (`BlockDrafter.
context_lookup`) is OFF in this step (it reads the context on the host), and the calibration is neither
read nor updated (the topology does not depend on it).

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
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from ..compat import CACHE_NAMES, cache_argument, last_hidden_state_request
from ..cpu.packed_linear import active_packed_linear
from .accept import AcceptResult
from .static_cache import is_static, static_capacity
from .support import has_recurrent_state, index_position_block
from .syncs import StepSyncCounter, phase

# tree sizes a captured step is compiled for (one graph each), cut to the drafter's tree budget
CAPTURED_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# graphs the compiled step may hold: a few buckets for each cache capacity a process decodes on
RECOMPILE_LIMIT = 64
# device types where `captured_step=None` (auto) takes the captured step: none until a GPU run has checked
# it (research/gpu; CUDA graphs cannot be exercised on a CPU), then {"cuda"}
AUTO_DEVICES: frozenset[str] = frozenset()
# values `generate(captured_step=...)` takes besides a torch.compile backend name
CAPTURED_SETTINGS = (None, True, False)


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
    kind = heads.config.token_input
    counts = torch.zeros(heads.num_heads, top_k, dtype=torch.float64)
    totals = torch.zeros(heads.num_heads, dtype=torch.float64)
    with torch.no_grad():
        for prompt_len, ids in sequences:
            ids = ids.view(-1)
            out = model(ids[None], output_hidden_states=True, return_dict=True)
            hidden = out.hidden_states[-1][0].to(heads.dtype)  # [L, H]: position t predicts ids[t + 1]
            first = max(prompt_len - 1, 0)
            for d in range(heads.num_heads):
                t = torch.arange(first, ids.numel() - 2 - d, device=ids.device)  # head d's target: ids[t + 2 + d]
                if t.numel() == 0:
                    continue
                tokens = ids[t + 1 + d] if kind == "previous" else ids[t + 1] if kind == "next" else None
                top, _ = heads.top_tokens(heads.step(d, hidden[t], tokens), top_k)
                counts[d] += (top == ids[t + 2 + d][:, None]).sum(0).double().cpu()
                totals[d] += t.numel()
    return (counts / totals.clamp_min(1)[:, None]).tolist()


# ----------------------------------------------------------------------------------------------- buckets
class TreeBucket:
    """The constant device tensors of one topology prefix of N nodes (made once, never per step): the tree's
    levels (which nodes each depth's head expands, which rank each node takes), depths, parents, the
    ancestor mask, and the path selector of the accept walk."""

    def __init__(self, topology: Topology, token_input: str, device: torch.device, capacity: int) -> None:
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
        self.topology = topology
        self.depths = torch.tensor(depths, device=device)
        self.ranks = torch.tensor(topology.ranks, device=device)
        self.parents = torch.tensor([max(p, 0) for p in topology.parents], device=device)
        self.is_root = torch.arange(n, device=device) == 0
        ancestors = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            ancestors[i] |= ancestors[topology.parents[i]]
        self.ancestors = ancestors.to(device)
        self.eye = torch.eye(n, dtype=torch.bool, device=device)
        self.path_depths = torch.arange(self.max_depth + 1, device=device)
        self.by_depth = self.depths[None, :] == self.path_depths[:, None]  # [D + 1, N]
        self.columns = torch.arange(capacity, device=device)
        self.slots = torch.arange(n, device=device)
        self.top_k = max([k for *_, k in self.levels], default=1)
        self.compiled = False  # its graph was compiled (`CapturedDecoder.run`)


def draft_tokens(heads, bucket: TreeBucket, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """The tree's tokens [N] (node order) from `hidden [1, H]` and `root [1]`, level by level: pure
    indexing of each depth's top-k."""
    kind = heads.config.token_input
    level_tokens = [root]
    for d, (expand, state, rank, k) in enumerate(bucket.levels):
        parent_tokens = level_tokens[-1].index_select(0, expand)  # [m]
        if kind == "previous":
            tokens = parent_tokens
        elif kind == "next":
            tokens = root
        else:
            tokens = None
        states = heads.step(d, hidden.expand(expand.shape[0], -1), tokens)
        ids, _ = heads.top_tokens(states, k)  # [m, k]
        level_tokens.append(ids[state, rank])
    return torch.cat(level_tokens).index_select(0, bucket.node_order)


def captured_step(model, heads, bucket: TreeBucket, cache, state: CapturedState) -> torch.Tensor:
    """One greedy decoding step on the device (module docstring): draft, mask, forward, accept, compact,
    and the next root and hidden state into `state`. Returns [1 + D + 1] int64: the count of emitted
    tokens, then the tokens (padded past the count). Nothing in it reads a value on the host."""
    device = state.root.device
    n = bucket.size
    length = cache.layers[0].cumulative_length.clone()  # the forward adds n to it in place
    with torch.no_grad():
        tokens = draft_tokens(heads, bucket, state.hidden, state.root)
        valid = (length + bucket.depths) < state.limit  # positions the model serves: others are pads
        seen = (bucket.ancestors & valid[None, :]) | bucket.eye
        rel = bucket.columns - length
        in_tree = (rel >= 0) & (rel < n)
        tree_columns = seen.index_select(1, rel.clamp(0, n - 1)) & in_tree[None, :]
        allowed = (bucket.columns < length)[None, :] | tree_columns
        dtype = state.hidden.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        positions = (length + bucket.depths).clamp_max(state.limit - 1)
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
        matched = (tokens == choices.index_select(0, bucket.parents)) | bucket.is_root
        good = matched & valid
        reached = ~(bucket.ancestors & ~good[None, :]).any(-1)
        last = (reached.long() * (bucket.depths + 1)).argmax(dim=0, keepdim=True)  # [1]: no 0-d index (a host int)
        count = bucket.depths.index_select(0, last) + 1  # [1]
        on_path = bucket.ancestors.index_select(0, last) & bucket.by_depth  # [D + 1, N]
        path = on_path.long().argmax(-1)  # node at each depth of the walk (0 past its end)
        emitted = choices.index_select(0, path)
        target = length + bucket.path_depths
        source = length + path
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                t.index_copy_(2, target, t.index_select(2, source))
            layer.cumulative_length.copy_((length + count).view(()))
        state.root.copy_(choices.index_select(0, last))
        state.hidden.copy_(out.hidden_states[-1][0].index_select(0, last).to(dtype))
        return torch.cat([count, emitted])


@dataclass
class CapturedState:
    """What the step carries from one call to the next, on the device: the root token [1], the hidden state
    [1, H] it came from, the first position the model does not serve (0-d), and two constants of the call."""

    root: torch.Tensor
    hidden: torch.Tensor
    limit: torch.Tensor
    cache_name: str
    hidden_request: int | bool


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

    def __init__(self, model, heads, topology: Topology, sizes, capacity: int, device, dtype, backend):
        self.heads, self.backend = heads, backend  # not the model: decoders are kept per model, weakly
        kind = heads.config.token_input
        self.buckets = {n: TreeBucket(topology.prefix(n), kind, device, capacity) for n in sizes}
        self.state = CapturedState(
            root=torch.zeros(1, dtype=torch.long, device=device),
            hidden=torch.zeros(1, heads.config.hidden_size, dtype=dtype, device=device),
            limit=torch.zeros((), dtype=torch.long, device=device),
            cache_name=cache_argument(model),
            hidden_request=last_hidden_state_request(model),
        )
        if device.type == "cuda":  # updated in place by every replay: fixed addresses for CUDA graphs
            for t in (self.state.root, self.state.hidden, self.state.limit):
                torch._dynamo.mark_static_address(t)
        self.step_fn = compiled_step(backend, device.type)
        active_packed_linear()  # makes this thread's packed-linear stack, which the heads' graph guards on

    def start(self, root: torch.Tensor, hidden: torch.Tensor, limit: int) -> None:
        self.state.root.copy_(root.view(1))
        self.state.hidden.copy_(hidden.view(1, -1))
        self.state.limit.fill_(limit)

    def bucket(self, room: int) -> TreeBucket | None:
        """The largest bucket of at most `room` nodes (None: not even the root fits)."""
        fits = [n for n in self.buckets if n <= room]
        return self.buckets[max(fits)] if fits else None

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
        packed = active_packed_linear()
        if packed is not None:  # the graph takes the packed copies there are (`PackedLinear.pack_planned`)
            tied = self.heads.__dict__.get("_tied_weight")  # the LM-head rows the heads borrow
            packed.pack_planned(() if tied is None else (tied,))
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
    if topology is None:
        topology = Topology.best_first(budget, heads.num_heads, drafter.top_k)
    budget = min(budget, len(topology))
    sizes = tuple(n for n in CAPTURED_TREE_SIZES if n < budget) + (budget,)
    layer = cache.layers[0]
    key = (id(heads), static_capacity(cache), layer.keys.device, layer.keys.dtype, topology, sizes, backend)
    decoders = _DECODERS.setdefault(model, {})
    decoder = decoders.get(key)
    if decoder is None:
        dtype = next(model.parameters()).dtype
        decoder = CapturedDecoder(
            model, heads, topology, sizes, static_capacity(cache), layer.keys.device, dtype, backend
        )
        decoders[key] = decoder
    return decoder


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
    decoder.start(ids[0, -1:], hidden_last, limit)
    ahead = device.type != "cpu" if ahead is None else ahead
    counter = StepSyncCounter() if drafter.count_host_syncs else None
    stop, max_length = call.stop, call.stop.max_length
    in_flight: deque[tuple[TreeBucket, HostRead]] = deque()
    cached = len(sequence) - 1  # tokens in the cache as the host knows them (the root is not cached)
    done = False
    while not done:
        while len(in_flight) < (2 if ahead else 1):
            bound = cached + sum(b.max_depth + 1 for b, _ in in_flight)
            sure = len(sequence) + len(in_flight)  # each step in flight adds at least one token
            if max_length is not None and sure >= max_length:
                break  # a step in flight ends the call: launching another would be wasted
            bucket = decoder.bucket(capacity - bound)
            if bucket is None:
                break
            with phase(counter, "step") if backend is None else contextlib.nullcontext():
                values = decoder.run(call.model, bucket, cache)
            in_flight.append((bucket, HostRead(values)))
        if not in_flight:
            raise RuntimeError(f"a static cache of {capacity} positions has no room left for the next step")
        bucket, pending = in_flight.popleft()
        with phase(counter, "read"):
            values = pending.read()
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
    new = torch.tensor([sequence[ids.shape[1] :]], dtype=ids.dtype, device=device)
    out = call.output([torch.cat([ids, new], dim=-1)], cache)
    if counter is not None:
        stats.host_syncs = {**stats.host_syncs, **counter.counts}
    return out
