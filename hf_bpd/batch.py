"""Batches: one draft tree per row, all rows verified in ONE forward, rows accepting different lengths.

transformers' caches hold one length for every row, while each row accepts its own number of tokens per
step. The design keeps that single length and lets rows differ in which cache slots are real:

- `past_mask [B, S]` marks every cache slot that holds a real token of its row (1) or not (0): left
  padding to begin with, then *holes*. After a step in which the rows accepted k_b tokens, every row keeps
  K = max_b k_b slots of its tree: its own accepted nodes first, then K - k_b holes (mask 0, never
  attended). A finished row keeps holes only.
- Each row's tree nodes attend to its real slots and to their own ancestors (the 4D mask); position ids
  are the row's real-token count plus the node's depth, which is what plain `generate` computes from the
  2D mask for left-padded rows. So a row decodes exactly as it would without the holes.
- Holes cost no correctness (attention windows too count positions, so real tokens only:
  `verify.tree_attention_mask`), but every step pays for them: attention reads them and the cache's
  growth copies them. `squeeze_holes` gathers each row's real slots to the right end again (left-padded
  form), one gather per layer, about one copy of the cache. `HoleLedger` weighs the two: it squeezes once
  the slots the holes have cost since the last squeeze add up to the cache's length (and whenever the
  cache nears a window the masks cannot serve past, and before the first plain step after drafted ones,
  so that plain steps are timed without the holes drafting left: `cost.StepChooser`).

Finished rows leave the batch (`retire_due`, `drop_rows`): plain batched `generate` keeps feeding a finished row
pad tokens to the end, and so would this loop, each such row costing its share of every later forward
(on a CPU, where the forward is compute-bound, about 1/B of it). Once what the finished rows would cost
over the steps left adds up to a whole step, they are dropped from the cache (`Cache.reorder_cache`, one
copy of it), the mask and the hidden states. Rows that accept more tokens finish sooner, so in a batch
the accepted tokens of fast rows turn into cheaper forwards for the slow ones.

Tree sizes: with a fixed `max_tree_tokens` every row gets that many. With "auto" each unfinished row
grows a tree of at most the forward-cost curve's largest size divided among them, and one width w is then
chosen for all rows (`cost.best_batch_width`): the verification forward holds B x w tokens (trees are
padded to the widest, finished rows included), so w maximises the batch's expected accepted tokens per
cost(B x w), and a bigger batch, already compute-bound on a CPU, verifies smaller trees. That cost is the
call's own (`cost.BatchForwardCost`): its first step is a plain one, and every forward is timed, because a
batch at long contexts costs far more than the one-row start-up curve says. Unless drafted steps yield
clearly more tokens per second than plain ones (drafting included; `batch_draft_margin`), the call takes
plain steps, the roots alone (`cost.StepChooser`); and a drafted step verifies more than its roots only
where the rows' calibrated estimates expect that to beat the roots alone by the same margin
(`cost.best_batch_width`). Below a window the masks cannot serve past
(`support.AttentionWindows.cap`), trees are capped so the cache plus the tree stays within it, as for one
row. Sampling works row by row (each row's own draws, so the random stream differs from plain batched
sampling while each row's law is plain sampling's). Streamers and per-token scores are refused for batches.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from .calibration import SamplingWarp
from .cost import BatchForwardCost
from .decoding import (
    AcceptResult,
    HostStop,
    accept_greedy,
    accept_tree,
    choose_tokens,
    prefill,
    prompt_mask,
)
from .drafter import BlockDrafter
from .stats import DecodingStats
from .support import AttentionWindows, drafting_context
from .syncs import HostSyncCounter, phase
from .tree import DraftTree, batch_trees, root_batch
from .verify import verify_tree

# A batch's drafted steps gain little over its plain ones where they gain at all (the forward is already
# compute-bound, and the rows' acceptances average out), so the measured gain is often within the noise of
# a few step times: drafting is taken only where it out-yields plain steps by this share (`cost.StepChooser`),
# and a drafted step's width above its roots only where expected to beat them by it (`cost.best_batch_width`).
BATCH_DRAFT_MARGIN = 0.05
# Above 8 rows the margin grows (to 0.10 at 16): each row's tree gets a smaller share of the budget and a
# drafted step's gain over a plain one shrinks toward the noise of its step times. A guard, not a measured
# gain: in claim batch_fastest_plain_pc1_amd_isotonic it cut drafting at 16 rows but not the loss there.
BATCH_DRAFT_MARGIN_PER_ROW_ABOVE_8 = 0.00625


def batch_draft_margin(rows: int) -> float:
    """The share by which a batch of `rows` unfinished rows must out-yield plain steps to draft."""
    return BATCH_DRAFT_MARGIN + BATCH_DRAFT_MARGIN_PER_ROW_ABOVE_8 * max(0, rows - 8)


def check_batch_supported(input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    """Refuse, naming the reason, a batch the loop would not decode exactly (raised before any forward)."""
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        # left padding: in every row, once a real token came, every later one is real
        seen = mask.long().cummax(dim=-1).values
        if bool((seen != mask.long()).any()):
            right = bool((mask[:, -1] == 0).any())
            raise ValueError(
                "hf_bpd.generate needs left-padded batches (tokenizer padding_side='left'): "
                + ("a row ends with padding" if right else "a row's attention mask has a hole between real tokens")
            )
    if generation_config._pad_token_tensor is None:
        raise ValueError("batched hf_bpd.generate needs a pad token (pad_token_id) for finished rows")
    if generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    ):
        raise ValueError("batched hf_bpd.generate does not return per-token scores or logits: use batch size 1")


def row_processors(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors plain batched `generate` built, as they apply to row `row` alone: `accept_tree` runs
    them on one row's sequence at a time, so state kept per batch row is cut to that row (the repetition
    penalty's per-row prompt padding, `prefix_allowed_tokens_fn`'s batch id)."""
    out = LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
            processor.prompt_ignore_length, torch.Tensor
        ):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = lambda _, sent, allowed=allowed: allowed(row, sent)
        out.append(processor)
    return out


def compact_rows(cache, num_tree: int, keep: torch.Tensor) -> None:
    """Of the last `num_tree` entries of every layer keep, per row, the tree indices `keep [B, K]` (row b's
    accepted nodes first; the rest of its K slots are holes its mask hides). In place, as
    `decoding.compact_cache`: only the tree slot is touched, whatever the context length."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, heads, S, dim]
            start = t.shape[-2] - num_tree
            index = (keep + start)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
            t[..., start : start + keep.shape[1], :] = t.gather(2, index)
            setattr(layer, name, t[..., : start + keep.shape[1], :])
        if hasattr(layer, "cumulative_length"):  # sliding-window layers count what they hold
            layer.cumulative_length -= num_tree - keep.shape[1]


@dataclass
class HoleLedger:
    """When to squeeze a batch's holes out (`squeeze_holes`). Each step a hole costs about what a real slot
    does (attention reads it, the cache's growth copies it), and a squeeze costs about one copy of the
    whole cache. So the ledger adds up, step by step, the holes the cache holds, and squeezes once that sum
    reaches the cache's length: the holes have then cost what a squeeze does. If holes grow by g a step,
    that squeezes at about sqrt(2 g S) holes for a cache of S slots, the period that minimises the two
    costs together; a fixed share of the cache would let a long cache carry many holes for many steps,
    and charge them to the steps after the drafted ones that made them, plain steps included."""

    slot_steps: int = 0  # holes summed over the steps since the last squeeze

    def due(self, holes: int, length: int) -> bool:
        """Whether to squeeze before this step, the cache holding `holes` holes in `length` slots."""
        self.slot_steps += holes
        return holes > 0 and self.slot_steps >= length

    def squeezed(self) -> None:
        """The holes were squeezed out (for this ledger's reason or another, a window): count again."""
        self.slot_steps = 0


def retire_due(finished_in_cache: int, rows_in_cache: int, steps_left: int) -> bool:
    """Whether to drop the batch's finished rows before this step: each costs about its share of every
    forward left (1 / rows of a compute-bound one) and dropping them costs about one copy of the cache, at
    most about a step; so they go once their share over the steps left adds up to one whole step."""
    return finished_in_cache > 0 and finished_in_cache * steps_left >= rows_in_cache


def drop_rows(cache, past_mask: torch.Tensor, hidden_last: torch.Tensor, keep: list[int]):
    """Keep only the cache rows `keep` (in that order): the cache (through its own `reorder_cache`, which
    beam search uses, so every layer kind drops them), the past mask and the last hidden states."""
    index = torch.tensor(keep, device=past_mask.device)
    cache.reorder_cache(index)
    return past_mask.index_select(0, index), hidden_last.index_select(0, index)


def squeeze_holes(cache, past_mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Gather every row's real cache slots (in order) to the right end, dropping holes down to the longest
    row (`width` real slots, when the caller knows it on the host: then no synchronisation); returns the
    new mask (left-padded form)."""
    width = int(past_mask.long().sum(-1).max()) if width is None else width
    # a stable sort of 0/1 puts each row's holes first and its real slots after them, both in slot order
    index = torch.sort(past_mask.long(), dim=-1, stable=True).indices[:, -width:]
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])))
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = width
    return past_mask.gather(1, index)


def decode_batch(
    model,
    drafter: BlockDrafter,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    windows: AttentionWindows | None = None,
    typical: tuple[float, float] | None = None,
):
    """The decoding loop for B > 1 rows (module docstring). Returns the sequences [B, L] padded on the
    right with the pad token, as plain batched `generate` returns them. `windows`: the model's attention
    windows (`support.py`; where they have a `cap`, `check_call_supported` made sure every row's text fits
    in it). `typical`: as in `decoding.decode`.

    Each row's real-token count is kept on the host (it grows by what the row accepts), and greedy steps
    without logits processors read every row's choices at every node in one copy (`accept_greedy`), so a
    step synchronises once for its accept whatever the number of rows, as one row does."""
    window = None if windows is None else windows.cap
    stats = drafter.stats
    batch_size, device = input_ids.shape[0], input_ids.device
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    context = drafting_context(model, context, input_ids.shape[1])  # below a LongRoPE switch (`support.py`)
    do_sample = bool(generation_config.do_sample)
    warp = SamplingWarp.from_config(generation_config)
    rows = [DecodingStats() for _ in range(batch_size)]
    stats.rows = rows
    processors = [row_processors(logits_processor, b) for b in range(batch_size)]
    auto = drafter.max_tree_tokens == "auto" and drafter.forward_cost is not None
    batch_cost = BatchForwardCost(drafter.step_cost, batch_size) if auto else None
    syncs = HostSyncCounter() if drafter.count_host_syncs else None  # a test's or measurement's, never timed
    stop = HostStop.of(stopping_criteria)
    # greedy without processors: one argmax over every row and node, read in one copy per step
    greedy_walk = stop is not None and not do_sample and typical is None and len(logits_processor) == 0
    # the original row of each cache row: finished rows leave the cache (`drop_rows`), the rest keep order
    slot_rows = list(range(batch_size))
    slot = {b: b for b in slot_rows}  # each row's place in the cache

    t0 = time.perf_counter()
    with phase(syncs, "prefill"):
        pad = int(generation_config._pad_token_tensor)
        past_mask = prompt_mask(input_ids, model_kwargs)
        logits, hidden_last, cache = prefill(model, input_ids, model_kwargs)
        scores = logits_processor(input_ids, logits)
        first = choose_tokens(scores, do_sample)
        sequences = [torch.cat([input_ids[b : b + 1], first[b].view(1, 1)], dim=-1) for b in range(batch_size)]
        roots = first.tolist()  # each row's last token, kept on the host
        finished = [bool(stopping_criteria(sequences[b], scores[b : b + 1]).any()) for b in range(batch_size)]
        real = past_mask.long().sum(-1).tolist()  # real tokens per row in the cache, kept on the host
    stats.time_prefill = time.perf_counter() - t0
    stats.new_tokens = batch_size
    for row in rows:
        row.new_tokens = 1
    # plain steps where drafting does not pay ("auto" trees): a plain step's time is the batch's own, and
    # drafting must out-yield it by batch_draft_margin
    chooser = None
    ledger = HoleLedger()
    drafted_last = False  # whether the last step drafted
    if batch_cost is not None:
        chooser = drafter.step_chooser(lambda: batch_cost.seconds.get(1), margin=batch_draft_margin(batch_size))

    while not all(finished):
        active = [b for b in range(batch_size) if not finished[b]]
        steps_left = generation_config.max_length - min(sequences[b].shape[1] for b in active)
        if retire_due(len(slot_rows) - len(active), len(slot_rows), steps_left):
            with phase(syncs, "cache"):
                past_mask, hidden_last = drop_rows(cache, past_mask, hidden_last, [slot[b] for b in active])
            slot_rows, slot = active, {b: p for p, b in enumerate(active)}
            if batch_cost is not None:  # a smaller batch's forwards: timed again, from a plain step
                batch_cost = BatchForwardCost(drafter.step_cost, len(slot_rows))
        in_cache = max(real[b] for b in slot_rows)  # the longest cache row's real slots
        t0 = time.perf_counter()
        max_depth = None if context is None else max(context - max(real[b] for b in active) - 1, 0)
        share = None if drafter.max_tree_tokens != "auto" else max(1, drafter.tree_budget // len(active))
        # a plain step first, timed: the batch's own one-token cost at its contexts
        drafting = not (batch_cost is not None and not batch_cost.seconds)
        if chooser is not None:  # rows finish: the margins follow those left
            chooser.margin = batch_cost.margin = batch_draft_margin(len(active))
        drafting = drafting and (chooser is None or chooser.draft_next(len(active)))
        holes = past_mask.shape[1] - in_cache
        crowded = window is not None and past_mask.shape[1] + (share or drafter.tree_budget) >= window
        # Plain steps the chooser takes after drafted ones run on a cache without the drafted steps' holes:
        # timed on them, plain steps would look dearer than plain decoding is, keeping drafting ahead where
        # it does not pay. (Later plain steps add a hole per finished row only: the ledger's business.)
        previous_drafted, drafted_last = drafted_last, drafting
        to_plain = chooser is not None and previous_drafted and not drafting and holes > 0
        # drafted steps' holes (in a plain streak after that squeeze only finished rows make any)
        drafted_holes = previous_drafted or drafting
        if ledger.due(holes, past_mask.shape[1]) or (holes and crowded) or to_plain:
            ledger.squeezed()
            with phase(syncs, "cache"):
                past_mask = squeeze_holes(cache, past_mask, in_cache)
            if chooser is not None and drafted_holes:  # not this step's choice: drafting pays for it
                squeezed = time.perf_counter()
                chooser.charge_drafting(squeezed - t0)
                t0 = squeezed
        if window is not None:  # every row's text fits the window, so at least the root does
            share = min(share or drafter.tree_budget, window - 1 - past_mask.shape[1])
        with phase(syncs, "draft"):
            if drafting:
                length = max(s.shape[1] for s in sequences)
                contexts = torch.stack(
                    [torch.nn.functional.pad(s[0], (length - s.shape[1], 0), value=pad) for s in sequences]
                )
                rows_hidden = hidden_last[[slot[b] for b in active]]
                drafted = drafter.draft(rows_hidden, contexts[active], max_depth, share, batch_cost, warp=warp)
                trees = [DraftTree.root_only(pad)] * len(slot_rows)  # by cache row
                for b, tree in zip(active, drafted):
                    trees[slot[b]] = tree
                batch = batch_trees(trees, pad_token_id=pad, device=device)
            else:  # the roots alone, as tensors: no tree objects unless a walk needs them (`accept_rows`)
                root_tokens = [pad if finished[b] else roots[b] for b in slot_rows]
                batch = root_batch(root_tokens, device)
        t1 = drafter._sync(device)
        with phase(syncs, "verify"):
            out = verify_tree(model, batch, cache, past_mask, windows)
        t2 = drafter._sync(device)
        with phase(syncs, "accept"):
            if greedy_walk and not drafting:
                results = accept_greedy_roots(out.logits, active, slot, sequences, stop)
            elif greedy_walk:
                results = accept_greedy_rows(trees, out.logits, active, slot, sequences, stop)
            else:
                if not drafting:
                    trees = drafter.root_trees(root_tokens)
                results = accept_rows(
                    trees, out.logits, active, slot, sequences, processors, stopping_criteria, stop, do_sample, typical
                )
            if drafting:  # a plain step verified nothing drafted: nothing to learn
                drafter.observe([results[b].nodes for b in active], [results[b].finished for b in active], 0, None)
        t3 = time.perf_counter()
        if batch_cost is not None:
            # on a CPU the forward's own time; on an accelerator the accept (which reads the logits on the
            # host) is the first sync after the forward, so the time up to its end
            batch_cost.observe(batch.input_ids.shape[1], (t2 if device.type == "cpu" else t3) - t1)
        with phase(syncs, "cache"):
            past_mask, hidden_last = keep_accepted(
                cache, past_mask, out, results, batch.input_ids.shape[1], real, slot_rows
            )
        for b, result in results.items():
            sequences[b] = torch.cat([sequences[b], sequences[b].new_tensor([result.tokens])], dim=-1)
            roots[b] = result.tokens[-1]
            finished[b] = result.finished
            rows[b].steps += 1
            rows[b].new_tokens += len(result.tokens)
            rows[b].accepted_lengths.append(len(result.tokens))
            rows[b].tree_sizes.append(batch.sizes[slot[b]])
        t4 = time.perf_counter()
        if chooser is not None:  # the whole step (the accept read the tokens: on an accelerator too, t4 is after it)
            chooser.observe(drafting, sum(len(r.tokens) for r in results.values()), t4 - t0)
        added = sum(len(r.tokens) for r in results.values())
        stats.record_batch_step((t1, t2, t3, t4), drafting, added, sum(batch.sizes[slot[b]] for b in active))

    if syncs is not None:
        stats.host_syncs = dict(syncs.counts)
    length = max(s.shape[1] for s in sequences)
    return torch.cat([torch.nn.functional.pad(s, (0, length - s.shape[1]), value=pad) for s in sequences])


def accept_rows(
    trees: list[DraftTree],
    logits: torch.Tensor,
    active: list[int],
    slot: dict[int, int],
    sequences: list[torch.Tensor],
    processors: list[LogitsProcessorList],
    stopping_criteria: StoppingCriteriaList,
    stop: HostStop | None,
    do_sample: bool,
    typical: tuple[float, float] | None,
) -> dict[int, AcceptResult]:
    """Each active row's walk through its tree (`decoding.accept_tree`), with the processors cut to that
    row (`row_processors`): sampled rows draw row by row. `trees` and `logits` are by cache row, row b's
    at `slot[b]`; the rest by the call's rows."""
    return {
        b: accept_tree(
            trees[slot[b]], logits[slot[b]], sequences[b], processors[b], stopping_criteria, do_sample, typical, stop
        )
        for b in active
    }


def accept_greedy_rows(
    trees: list[DraftTree],
    logits: torch.Tensor,
    active: list[int],
    slot: dict[int, int],
    sequences: list[torch.Tensor],
    stop: HostStop,
) -> dict[int, AcceptResult]:
    """`accept_rows` for greedy decoding without processors: the base model's token at every node of every
    row in one argmax and one copy to the host, then each row's walk there (`decoding.accept_greedy`)."""
    choices = logits.argmax(dim=-1).tolist()  # [rows in cache][N], finished rows' too: one read, no gather
    return {
        b: accept_greedy(trees[slot[b]], logits[slot[b]], sequences[b].shape[1], stop, choices[slot[b]]) for b in active
    }


def accept_greedy_roots(
    logits: torch.Tensor, active: list[int], slot: dict[int, int], sequences: list[torch.Tensor], stop: HostStop
) -> dict[int, AcceptResult]:
    """`accept_greedy_rows` for a plain step (every cache row verified its root alone, `tree.root_batch`):
    one argmax over every row's logits and one copy to the host; each row's token is its bonus token."""
    choices = logits[:, 0].argmax(dim=-1).tolist()
    results = {}
    for b in active:
        token, raw = choices[slot[b]], [logits[slot[b], 0].float()]
        results[b] = AcceptResult([0], [token], raw, raw, stop(sequences[b].shape[1] + 1, token))
    return results


def keep_accepted(
    cache,
    past_mask: torch.Tensor,
    out,
    results: dict[int, AcceptResult],
    num_tree: int,
    real: list[int],
    slot_rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """After a verification of `num_tree` slots per row: keep each row's accepted nodes (its first slots;
    K - k_b holes after them, K the most any row kept; a finished row keeps holes only), counting them into
    `real` (host-side real tokens per row of the call). `slot_rows`: the call's row in each cache row.
    Returns the new past mask and each cache row's last hidden state."""
    batch_size = past_mask.shape[0]
    nodes = [results[b].nodes if b in results else [0] for b in slot_rows]
    width = max(len(n) for n in nodes)
    keep = [n + [n[-1]] * (width - len(n)) for n in nodes]
    slots = [[1] * len(n) + [0] * (width - len(n)) if b in results else [0] * width for b, n in zip(slot_rows, nodes)]
    for b in results:
        real[b] += len(results[b].nodes)
    device = past_mask.device
    # nothing to move when every row kept its whole tree in order (plain steps: each row its root)
    if width < num_tree or any(k != list(range(width)) for k in keep):
        compact_rows(cache, num_tree, torch.tensor(keep, device=device))
    past_mask = torch.cat([past_mask, torch.tensor(slots, dtype=past_mask.dtype, device=device)], dim=-1)
    last = torch.tensor([n[-1] for n in nodes], device=device)
    return past_mask, out.hidden_states[-1][torch.arange(batch_size, device=device), last]
