"""The blockwise parallel decoding loop of one row (`decode`), run by `hf_bpd.generate` (`generation.py`):

    model.generate(**inputs, custom_generate=hf_bpd.generate, assistant=drafter, max_new_tokens=N)

Phases, each a plain function below (gpt-fast style):
  prefill        the prompt through the model exactly as `generate` does: its token is the first root
  draft          heads on the last accepted hidden state -> lattice -> draft tree (`BlockDrafter.draft`)
  verify_tree    ONE forward over the tree on the existing cache: 4D tree mask + depth-based position ids
                 (`verify.py`: the forward-cost timer makes that very call too)
  accept_tree    walk the tree along the base model's own choices: its processed greedy token, or (sampling)
                 one draw from its processed distribution at each reached node (fused with the next tree's
                 growth into one host copy per step: `accept_greedy_and_grow`, and for sampling on an
                 accelerator `sampled_walk.accept_sampled_and_grow`)
  compact_cache  keep only the accepted tree positions in the KV cache

Sampling is exact. The drafts are deterministic, so the rule is the plain one: at the root, draw y from the
base model's processed distribution there (every processor and warper `generate` built, run on the ids of
that node's path); if y is a drafted child, move to it and draw again from its distribution; otherwise emit
y and stop (a leaf also ends with a draw). By induction over the depth, every emitted token has exactly the
law plain sampling gives it, and because one `torch.multinomial` draw is made per emitted token, in order,
as `generate`'s sampling loop makes them, the same seed gives the same tokens as plain
`model.generate(do_sample=True)` (up to the rounding difference between a tree forward and a one-token
forward).

Lossy, off by default: `lossy_typical_acceptance=True` (or `(epsilon, delta)`) in the `generate` call
takes Medusa's typical acceptance instead when sampling: at a reached node, a drafted child is accepted
without a draw when its processed probability p(x) > min(epsilon, delta * exp(-H(p))) (Medusa's defaults
0.09 and 0.3; the most probable such child), and the step ends with one ordinary draw where no child
qualifies. It accepts more drafts than the exact rule, but its outputs no longer follow plain sampling's
law (tests/test_sampling.py shows the χ² test failing) and no seed reproduces plain sampling.

Only public extension points are used (4D attention masks, `position_ids`, the Cache API): no modeling
file is copied or patched, so any causal LM whose attention honours a 4D mask works (sdpa, eager).

Batches (B > 1) run the same phases in `batch.py`: one tree per row, all verified in one forward, rows
accepting different lengths (their rejected slots become masked holes in the shared cache). What the
loop serves and refuses, and why, is in `support.py`.
"""

from __future__ import annotations

import time

import torch

from ..drafting.drafter import BlockDrafter
from ..drafting.expansion import GrownTree
from ..drafting.tree import DraftTree, TreeBatch, batch_trees
from ..kv import compact_cache, compact_static_cache
from .accept import AcceptResult, HostStop, accept_greedy, greedy_tokens
from .call import DecodeCall
from .captured import decode_captured, use_captured
from .sampled_walk import accept_sampled_and_grow, walk_serves
from .static_cache import compiled_static_call, graph_tree_size, static_capacity
from .support import AttentionWindows, index_position_block, index_position_room
from .verify import verify_tree


def greedy_last_node(tree: TreeBatch, parents: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """The node `accept_greedy` ends row 0's walk at, computed on the device: a node is reached when every
    drafted token on its path is the base model's choice at the node before it, and the reached nodes
    form one chain, so the walk ends at the deepest. `parents [N]` (the root's: -1), `choices [N]` the
    argmax at each node. Returns `[1]` (long)."""
    ids, depths, ancestors = tree.row(0)
    matched = ids == choices[parents.clamp_min(0)]
    matched[0] = True
    reached = ~(ancestors & ~matched[None, :]).any(-1)
    return (reached.long() * (depths + 1)).argmax().view(1)


def accept_greedy_and_grow(
    drafter: BlockDrafter,
    tree: DraftTree,
    batch: TreeBatch,
    out,
    length: int,
    stop: HostStop,
    max_depth: int | None,
) -> tuple[AcceptResult, list[tuple[DraftTree, list]] | None]:
    """`accept_greedy` fused with the next step's drafting, for one row and "previous" heads that grow on
    the device (`BlockDrafter.grows_on_device`): the walk's last node, its bonus token and hidden state
    are found on the device (`greedy_last_node`), the next tree is grown from them there
    (`BlockDrafter.grow`), and ONE device-to-host copy reads the step's choices and that tree together.
    So a greedy step synchronises once, drafting included. Returns (the step's result, the next step's
    grown tree for `BlockDrafter.draft(grown=...)`, or None when decoding stops here). The next tree is
    grown before this step's verification is fed back (`BlockDrafter.observe`), so its calibration lags
    one step; `max_depth`: the next step's depth limit (a bound: the step's length is not known yet)."""
    device = batch.input_ids.device
    n = len(tree)
    # the tree's own nodes only: a compiled forward's batch is padded past them, and the copy below reads
    # the walk's last node right after the tree's choices
    logits, hidden = out.logits[0, :n], out.hidden_states[-1][0, :n]
    choices = greedy_tokens(logits)
    last = greedy_last_node(batch, torch.tensor(tree.parents, device=device), choices)
    t0 = time.perf_counter()
    grown = drafter.grow(hidden.index_select(0, last), choices.index_select(0, last), max_depth=max_depth)
    values = torch.cat([choices.double(), last.double(), grown.flat().to(device)]).tolist()  # the one copy
    drafter.stats.time_heads += time.perf_counter() - t0
    result = accept_greedy(tree, logits, length, stop, [int(v) for v in values[:n]])
    if result.finished or result.nodes[-1] != int(values[n]):  # stopped (eos, length) inside the path
        return result, None
    return result, [GrownTree.on_host(result.tokens[-1], values[n + 1 :])]


def step_limit(windows: AttentionWindows | None, capacity: int | None, block: int | None, past_len: int):
    """(the most nodes a step's tree may have, or None; a static cache's free slots, or None) with `past_len`
    tokens cached. A window the masks cannot serve past (GPT-Neo's local layers): below it every layer
    attends like full attention, so context + tree stay there (`check_call_supported` made sure the root
    fits). A static cache (`capacity`): the tree fits its free slots. A model reading positions by cache
    index over blocks (`support.index_position_room`): the tree stays in one block."""
    room = None if capacity is None else capacity - past_len
    limits = [
        None if windows is None or windows.cap is None else windows.cap - 1 - past_len,
        room,
        index_position_room(block, past_len),
    ]
    return min((n for n in limits if n is not None), default=None), room


def fused_walks(call: DecodeCall, device: torch.device) -> tuple[bool, bool, bool]:
    """(greedy steps read their tokens and the next tree in one copy: `accept_greedy_and_grow`; sampled steps
    walk on the device: `sampled_walk.py`; the next tree is grown inside a step's accept, read in the same
    copy). The next tree can be grown there only before its length is known, so not below a window cap."""
    drafter = call.drafter
    grows_next = drafter.grows_on_device and (call.windows is None or call.windows.cap is None)
    on_device = drafter.fused_sampling if drafter.fused_sampling is not None else device.type != "cpu"
    sampled = call.stop is not None and call.do_sample and call.typical is None and on_device
    return call.plain_greedy and grows_next, sampled and walk_serves(call.processors, device), grows_next


def decode(call: DecodeCall, input_ids: torch.LongTensor, model_kwargs: dict):
    """The decoding loop of one row, on a call already checked and a drafter prepared for its model (inside
    its linear context: `generation._prepared`): prefill, then draft, verify, accept and compact until a
    stopping criterion holds."""
    if use_captured(call, input_ids, model_kwargs):  # greedy on a static cache: one device step (`captured.py`)
        return decode_captured(call, input_ids, model_kwargs)
    model, drafter, clock, stats = call.model, call.drafter, call.clock, call.stats
    start = call.prefill(input_ids, model_kwargs)
    past_mask, cache, hidden_last, sequences, finished = start.state()
    input_ids, finished = sequences[0], finished[0]
    sequence = input_ids[0].tolist()  # the row on the host, kept in step with input_ids (no copy back)
    if drafter.reads_context:  # an EAGLE layer: every prompt position's feature and the token after it
        drafter.start_context(start.hidden_prompt[0], sequence[1:])
    device = input_ids.device
    capacity = static_capacity(cache)  # a static cache: trees fit its free slots (`static_cache.py`)
    static_call = None if capacity is None else compiled_static_call(model, call.config, model_kwargs)
    block = index_position_block(model)  # queries read their cache index as position (Llama-4): trees bounded
    chooser = call.step_chooser()  # plain steps where drafting does not pay ("auto" trees)
    fuse, fuse_sampled, grows_next = fused_walks(call, device)
    grown, next_drafts = None, None  # the next step's tree, grown during the last step, and its decision
    drafting = True  # whether the last step drafted

    while not finished:
        if next_drafts is None:  # else decided by the last step's fused accept
            next_drafts = chooser is None or chooser.draft_next()
        if next_drafts and not drafting:  # an EAGLE layer reads the plain steps' rows: not this step's cost
            drafter.catch_up_context()
        clock.start_step()
        past_len = past_mask.shape[1]
        limit, room = step_limit(call.windows, capacity, block, past_len)
        drafting = next_drafts
        with clock.phase("draft"):
            if drafting:
                given = {} if grown is None else {"grown": grown}
                depth = call.max_depth(past_len)
                trees = drafter.draft(
                    hidden_last,
                    input_ids,
                    depth,
                    limit,
                    warp=call.warp,
                    host_context=[sequence],
                    step_cost=call.binding.step_cost,
                    **given,
                )
            else:
                trees = drafter.root_trees([sequence[-1]])
            trees = drafter.cut(trees, limit)  # a tree grown last step, before its limit was known
        grown = next_drafts = None
        with clock.phase("verify"):
            size = None if static_call is None else graph_tree_size(len(trees[0]), room)  # one graph per size
            batch = batch_trees(trees, pad_token_id=trees[0].tokens[0], device=device, pad_to=size)
            out = verify_tree(model, batch, cache, past_mask, call.windows, forward=static_call, capacity=capacity)
            if static_call is not None:  # a replayed graph's outputs are overwritten by its next replay
                out.logits, out.hidden_states = out.logits.clone(), (out.hidden_states[-1].clone(),)
        verify_seconds = clock.last
        expected = drafter.expected_tokens() if drafting and chooser is not None else None  # before it is observed
        heads_before = stats.time_heads  # a fused accept grows the next tree: heads time, not accept time
        with clock.phase("accept"):
            if fuse or fuse_sampled:  # decide the next step now: its tree is grown before this copy
                next_drafts = chooser is None or chooser.draft_next()
            grow = bool(next_drafts) and grows_next
            result, grown = accept_row(call, trees[0], batch, out, input_ids, past_len, fuse_sampled, grow)
            # CPU times are exact; on an accelerator only when the drafter synchronises (profile)
            timed = device.type == "cpu" or drafter.profile
            call.observe([result.nodes], [result.finished], batch.input_ids.shape[1], verify_seconds if timed else None)
        stats.time_accept -= stats.time_heads - heads_before
        sequence.extend(result.tokens)
        with clock.phase("cache"):
            keep = torch.tensor(result.nodes, device=device)
            if capacity is not None:
                compact_static_cache(cache, past_len, batch.input_ids.shape[1], keep)
            elif keep.numel() < batch.input_ids.shape[1]:  # nothing to drop when every node was accepted
                compact_cache(cache, batch.input_ids.shape[1], keep)
            past_mask = torch.cat([past_mask, past_mask.new_ones(1, keep.numel())], dim=-1)
            hidden_last = out.hidden_states[-1][:, result.nodes[-1]]
            if drafter.reads_context:
                drafter.extend_context(out.hidden_states[-1][0, result.nodes], result.tokens)
            input_ids = torch.cat([input_ids, input_ids.new_tensor([result.tokens])], dim=-1)
        if chooser is not None:  # the whole step: a drafted step's compaction is part of what it costs
            chooser.observe(drafting, len(result.tokens), clock.step_seconds(), expected)
        stats.record_step(drafting, len(result.tokens), len(trees[0]))
        call.emit(result)
        finished = result.finished
    return call.output([input_ids], cache)


def accept_row(
    call: DecodeCall, tree: DraftTree, batch: TreeBatch, out, input_ids, past_len: int, fuse_sampled: bool, grow: bool
) -> tuple[AcceptResult, list | None]:
    """`accept_tree` for one row's step, by the fastest walk that serves the call: the device walk for a
    sampled step (`sampled_walk.accept_sampled_and_grow`), the fused greedy walk (`accept_greedy_and_grow`)
    where the next tree is grown now (`grow`: greedy steps only fuse then), else the host walk. Returns the
    result and the next step's grown tree, or None."""
    depth = call.max_depth(past_len + len(tree))  # the next tree's, grown from this step's end
    drafter, stop = call.drafter, call.stop
    if fuse_sampled:
        return accept_sampled_and_grow(
            drafter, tree, batch, out, input_ids, call.processors, stop, grow, depth, call.warp
        )
    if grow:
        return accept_greedy_and_grow(drafter, tree, batch, out, input_ids.shape[1], stop, depth)
    return call.walk(tree, out.logits[0], input_ids), None
