"""Drafted decoding for hybrid and recurrent models (Mamba-2, Qwen3-Next, LFM2, Falcon-H1, ...): one chain of
drafts per step, verified by a plain causal forward, with the recurrent state restored where a draft fails.

A tree forward cannot serve a recurrent or convolutional layer: it reads its tokens in order, so siblings
and rejected drafts would all flow into one state. So each step verifies ONE chain, the draft tree reduced to
its most promising root-to-leaf path (`BlockDrafter.chains`), through the model's own causal forward, the
inputs prepared by its `prepare_inputs_for_generation` exactly as plain `generate` prepares a step's:

  snapshot   copy every conv / recurrent state of the cache (`LinearAttentionCacheLayerMixin` layers)
  verify     ONE forward of [replay..., root, chain...] on the cache
  accept     the base model's own choices along the chain (`accept.accept_tree`: greedy or sampled)
  commit     every token of the row accepted: keep the state (the forward left it right)
  restore    otherwise copy the snapshot back, drop the forward's attention entries, and make the row's
             accepted tokens (root included) its *replay*: they lead the NEXT step's forward, whose outputs
             for them are already known, so no forward is spent on them

The replay rides along in a forward that is made anyway; it is capped so that replay plus chain stays within
the drafter's tree budget (a row with a long replay drafts a short chain, down to none, which always commits).
The tokens each step emits are exactly those a tree step would emit along that chain, and every forward
starts from a state plain decoding also had, so greedy output is plain greedy's and sampled output plain
sampling's, seed for seed (one draw per emitted token, in order), up to the rounding difference between a
several-token forward and one-token forwards.

Batches (B > 1): every row's input has one width (replay + root + chain, then filler tokens). A row commits
only when its whole input was accepted, so a filler (never accepted) makes it restore; a row that restores
turns its attention entries into holes of the shared cache (`batch.py`'s past mask), squeezed out before a
forward where windowed layers would count them. Rows restore independently (state tensors by row).

What is served is decided up front by name (`check_recurrent_supported`): families whose transformers torch
path continues a cached state over a several-token forward exactly as one token at a time (checked for each by
tests/test_hybrid.py), keeping that state in the cache's linear-attention layers. Refused by name: Mamba,
Falcon-Mamba and Jamba (their torch scan starts several-token forwards from a zero state), and models keeping
state outside the cache layers (MiniMax, RWKV, xLSTM, RecurrentGemma).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..drafting.drafter import BlockDrafter
from ..drafting.tree import DraftTree
from ..kv import HoleLedger, drop_last, restore, snapshot, squeeze_holes, state_tensors
from .call import DecodeCall, row_processors
from .stats import DecodingStats
from .verify import verify_chain


def row_inputs(replays: list[list[int]], chains: list[DraftTree | None], pad: int) -> list[list[int]]:
    """Each row's forward input, all of one width: its replay, root and chain, then its last token again as
    filler (finished rows: pad tokens only)."""
    rows = [None if c is None else r + c.tokens for r, c in zip(replays, chains)]
    width = max(len(r) for r in rows if r is not None)
    return [[pad] * width if r is None else r + [r[-1]] * (width - len(r)) for r in rows]


def chain_room(drafter: BlockDrafter, replays: list[list[int]], active: list[int]) -> list[int]:
    """Chain tokens (root included) each active row may verify: replay + chain within the tree budget, at
    least the root (a step of the root alone always commits, so replays stay below the budget)."""
    budget = drafter.tree_budget
    return [max(1, budget - len(replays[b])) for b in active]


# ----------------------------------------------------------------------------------------------------------
# the loop


def decode_recurrent(call: DecodeCall, input_ids: torch.LongTensor, model_kwargs: dict):
    """The chain loop (module docstring) for one row or a batch, on a call already checked and a drafter
    prepared for its model. Returns what `generate` returns: one row as `row.decode` does, a batch
    padded on the right with the pad token as `batch.decode_batch` does."""
    model, drafter, clock, stats = call.model, call.drafter, call.clock, call.stats
    batch_size, device, pad = input_ids.shape[0], input_ids.device, call.pad
    processors = (
        [call.processors] if batch_size == 1 else [row_processors(call.processors, b) for b in range(batch_size)]
    )
    rows = stats.rows = [DecodingStats() for _ in range(batch_size)] if batch_size > 1 else []
    start = call.prefill(input_ids, model_kwargs)
    past_mask, cache, hidden_last, sequences, finished = start.state()
    _check_state_in_cache(model, cache)
    replays: list[list[int]] = [[] for _ in range(batch_size)]
    chooser = call.step_chooser() if batch_size == 1 else None  # plain steps where drafting does not pay
    ledger = HoleLedger()

    while not all(finished):
        clock.start_step()
        active = [b for b in range(batch_size) if not finished[b]]
        real = past_mask.long().sum(-1)
        holes = past_mask.shape[1] - int(real.max())
        # the model windows its layers by cache index: holes would count as tokens there
        if ledger.due(holes, past_mask.shape[1]) or (holes and call.windows is not None):
            ledger.squeezed()
            with clock.phase("cache"):
                past_mask = squeeze_holes(cache, past_mask)
        room = chain_room(drafter, replays, active)
        drafting = (chooser is None or chooser.draft_next()) and max(room) > 1
        with clock.phase("draft"):
            chains = draft_chains(call, sequences, hidden_last, replays, active, room, real, drafting)
        ids = torch.tensor(row_inputs(replays, chains, pad), device=device)
        width = ids.shape[1]
        with clock.phase("verify"):
            saved = snapshot(cache)  # what a row that does not commit gets back
            out = verify_chain(model, ids, cache, past_mask)
        verify_seconds = clock.last
        expected = call.drafter.expected_tokens() if drafting and chooser is not None else None  # before observed
        with clock.phase("accept"):
            results = {}
            for b in active:
                start = len(replays[b])
                logits = out.logits[b, start : start + len(chains[b])]
                results[b] = call.walk(chains[b], logits, sequences[b], processors[b])
            timed = device.type == "cpu" or drafter.profile
            nodes, stopped = [results[b].nodes for b in active], [results[b].finished for b in active]
            call.observe(nodes, stopped, width, verify_seconds if timed else None)
        if chooser is not None:
            chooser.observe(drafting, len(results[active[0]].tokens), clock.step_seconds(), expected)
        # a row commits when the forward read nothing of it that was not accepted
        committed = [b in results and len(replays[b]) + len(results[b].nodes) == width for b in range(batch_size)]
        with clock.phase("cache"):
            past_mask = keep_committed(cache, saved, past_mask, committed, width)
        last = [len(replays[b]) + results[b].nodes[-1] if b in results else 0 for b in range(batch_size)]
        hidden_last = out.hidden_states[-1][torch.arange(batch_size, device=device), torch.tensor(last, device=device)]
        for b, result in results.items():
            chain = chains[b]
            stats.replayed += len(replays[b])
            replays[b] = [] if committed[b] else replays[b] + [chain.tokens[i] for i in result.nodes]
            sequences[b] = torch.cat([sequences[b], sequences[b].new_tensor([result.tokens])], dim=-1)
            finished[b] = result.finished
            if rows:
                rows[b].record_step(drafting, len(result.tokens), len(chain))
        stats.record_step(drafting, sum(len(r.tokens) for r in results.values()), sum(len(chains[b]) for b in active))
        if batch_size == 1:
            call.emit(results[0])
    # a cache behind the text (a replay pending) is not handed out as if it held it
    return call.output(sequences, cache if not replays[0] else None)


def draft_chains(call: DecodeCall, sequences, hidden_last, replays, active, room, real, drafting: bool) -> list:
    """Each active row's chain (by the call's rows; None for finished rows): drafted within `room`, or its
    root alone on a plain step."""
    drafter = call.drafter
    if drafting:
        longest = int(real[active].max()) + max(len(replays[b]) for b in active)
        contexts = [sequences[b][0] for b in active]
        length = max(len(c) for c in contexts)
        padded = torch.stack([torch.nn.functional.pad(c, (length - len(c), 0), value=call.pad) for c in contexts])
        host = [c.tolist() for c in contexts]
        depth, cost = call.max_depth(longest), call.binding.step_cost
        trees = drafter.draft(
            hidden_last[active], padded, depth, max(room), warp=call.warp, host_context=host, step_cost=cost
        )
        drafted = drafter.chains(trees, room)
    else:
        drafted = drafter.root_trees([int(sequences[b][0, -1]) for b in active])
    chains: list[DraftTree | None] = [None] * len(sequences)
    for b, chain in zip(active, drafted):
        chains[b] = chain
    return chains


def keep_committed(cache, saved, past_mask: torch.Tensor, committed: list[bool], width: int) -> torch.Tensor:
    """After a chain forward of `width` tokens per row: the rows that did not commit get their state back
    (`saved`: the snapshot before the forward) and their entries masked as holes; where no row committed,
    the forward's entries are dropped instead. Returns the new past mask."""
    restored = [b for b, ok in enumerate(committed) if not ok]
    if len(restored) == len(committed):  # no row keeps this forward: drop its entries, not make holes
        restore(cache, saved)
        drop_last(cache, width)
        return past_mask
    if restored:
        restore(cache, saved, restored)
    slots = torch.tensor([[int(c)] * width for c in committed], dtype=past_mask.dtype, device=past_mask.device)
    return torch.cat([past_mask, slots], dim=-1)


def _check_state_in_cache(model, cache) -> None:
    """The served families keep their state in the cache's linear-attention layers (a guard: a model
    that kept it elsewhere would decode wrongly, so stop rather than answer)."""
    if not isinstance(cache, DynamicCache) or not state_tensors(cache):
        raise RuntimeError(
            f"{type(model).__name__} keeps no conv or recurrent state in its cache's layers after the prefill, so "
            "hf_bpd cannot restore it after a rejected draft (please report this model type)"
        )
