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

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from ..drafting.tree import DraftTree, batch_trees, root_batch
from ..kv import HoleLedger, compact_rows, drop_rows, squeeze_holes
from .accept import AcceptResult, HostStop, accept_greedy, greedy_tokens
from .call import DecodeCall, row_processors
from .cost import BATCH_PROBES, BatchForwardCost
from .stats import DecodingStats
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


# processors that keep state shaped by the whole batch: the loop runs processors on one row at a time
BATCH_STATE_PROCESSORS = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SynthIDTextWatermarkLogitsProcessor)


def check_batch_supported(
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    logits_processor: LogitsProcessorList | None = None,
    rescorer=None,
):
    """Refuse, naming the reason, a batch the loop would not decode exactly (raised before any forward)."""
    if getattr(rescorer, "one_row_only", False):
        raise ValueError(f"the drafter's rescorer ({type(rescorer).__name__}) drafts for one row: use batch size 1")
    stateful = [type(p).__name__ for p in logits_processor or () if isinstance(p, BATCH_STATE_PROCESSORS)]
    if generation_config.guidance_scale not in (None, 1):
        stateful.append("guidance_scale")
    if generation_config.watermarking_config is not None:
        stateful.append("watermarking_config")
    if stateful:
        raise ValueError(
            f"batched hf_bpd.generate runs logits processors one row at a time; {', '.join(stateful)} keeps "
            "state for the whole batch: use batch size 1"
        )
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


def retire_due(finished_in_cache: int, rows_in_cache: int, steps_left: int) -> bool:
    """Whether to drop the batch's finished rows before this step: each costs about its share of every
    forward left (1 / rows of a compute-bound one) and dropping them costs about one copy of the cache, at
    most about a step; so they go once their share over the steps left adds up to one whole step."""
    return finished_in_cache > 0 and finished_in_cache * steps_left >= rows_in_cache


def decode_batch(call: DecodeCall, input_ids: torch.LongTensor, model_kwargs: dict):
    """The decoding loop for B > 1 rows (module docstring). Returns the sequences [B, L] padded on the
    right with the pad token, as plain batched `generate` returns them. Where the model's attention windows
    have a `cap` (`support.py`), `check_call_supported` made sure every row's text fits in it.

    Each row's real-token count is kept on the host (it grows by what the row accepts), and greedy steps
    without logits processors read every row's choices at every node in one copy (`accept_greedy`), so a
    step synchronises once for its accept whatever the number of rows, as one row does."""
    model, drafter, clock, stats = call.model, call.drafter, call.clock, call.stats
    window = None if call.windows is None else call.windows.cap
    batch_size, device, pad = input_ids.shape[0], input_ids.device, call.pad
    rows = stats.rows = [DecodingStats() for _ in range(batch_size)]
    processors = [row_processors(call.processors, b) for b in range(batch_size)]
    auto = drafter.max_tree_tokens == "auto" and drafter.forward_cost is not None
    batch_cost = BatchForwardCost(call.binding.step_cost, batch_size) if auto else None
    # the original row of each cache row: finished rows leave the cache (`drop_rows`), the rest keep order
    slot_rows = list(range(batch_size))
    slot = {b: b for b in slot_rows}  # each row's place in the cache
    start = call.prefill(input_ids, model_kwargs)
    past_mask, cache, hidden_last, sequences, finished = start.state()
    roots = start.first.tolist()  # each row's last token, kept on the host
    real = past_mask.long().sum(-1).tolist()  # real tokens per row in the cache, kept on the host
    # plain steps where drafting does not pay ("auto" trees): a plain step's time is the batch's own, and
    # drafting must out-yield it by batch_draft_margin
    chooser = None
    ledger = HoleLedger()
    drafted_last = False  # whether the last step drafted
    if batch_cost is not None:
        chooser = call.step_chooser(lambda: batch_cost.seconds.get(1), batch_draft_margin(batch_size), BATCH_PROBES)

    while not all(finished):
        active = [b for b in range(batch_size) if not finished[b]]
        steps_left = call.config.max_length - min(sequences[b].shape[1] for b in active)
        if retire_due(len(slot_rows) - len(active), len(slot_rows), steps_left):
            with clock.phase("cache"):
                past_mask, hidden_last = drop_rows(cache, past_mask, hidden_last, [slot[b] for b in active])
            slot_rows, slot = active, {b: p for p, b in enumerate(active)}
            if batch_cost is not None:  # a smaller batch's forwards: timed again, from a plain step
                batch_cost = BatchForwardCost(call.binding.step_cost, len(slot_rows))
        in_cache = max(real[b] for b in slot_rows)  # the longest cache row's real slots
        clock.start_step()
        share = None if drafter.max_tree_tokens != "auto" else max(1, drafter.tree_budget // len(active))
        # a plain step first, timed: the batch's own one-token cost at its contexts
        drafting = not (batch_cost is not None and not batch_cost.seconds)
        if chooser is not None:  # rows finish: the margins follow those left
            chooser.margin = batch_cost.margin = batch_draft_margin(len(active))
        drafting = drafting and (chooser is None or chooser.draft_next(len(active)))
        previous_drafted, drafted_last = drafted_last, drafting
        past_mask = squeeze_if_due(call, cache, past_mask, ledger, chooser, in_cache, share, drafting, previous_drafted)
        if window is not None:  # every row's text fits the window, so at least the root does
            share = min(share or drafter.tree_budget, window - 1 - past_mask.shape[1])
        with clock.phase("draft"):
            if drafting:
                trees = draft_rows(call, sequences, hidden_last, active, slot, slot_rows, real, share, batch_cost)
                batch = batch_trees(trees, pad_token_id=pad, device=device)
            else:  # the roots alone, as tensors: no tree objects unless a walk needs them (`accept_rows`)
                root_tokens = [pad if finished[b] else roots[b] for b in slot_rows]
                batch = root_batch(root_tokens, device)
        with clock.phase("verify"):
            out = verify_tree(model, batch, cache, past_mask, call.windows)
        verify_seconds = clock.last
        with clock.phase("accept"):
            if call.plain_greedy and not drafting:
                results = accept_greedy_roots(out.logits, active, slot, sequences, call.stop)
            elif call.plain_greedy:
                results = accept_greedy_rows(trees, out.logits, active, slot, sequences, call.stop)
            else:
                if not drafting:
                    trees = drafter.root_trees(root_tokens)
                results = accept_rows(call, trees, out.logits, active, slot, sequences, processors)
            if drafting:  # a plain step verified nothing drafted: nothing to learn
                call.observe([results[b].nodes for b in active], [results[b].finished for b in active], 0, None)
        if batch_cost is not None:
            # on a CPU the forward's own time; on an accelerator the accept (which reads the logits on the
            # host) is the first sync after the forward, so the time up to its end
            batch_cost.observe(batch.input_ids.shape[1], verify_seconds + (0 if device.type == "cpu" else clock.last))
        with clock.phase("cache"):
            past_mask, hidden_last = keep_accepted(
                cache, past_mask, out, results, batch.input_ids.shape[1], real, slot_rows
            )
        for b, result in results.items():
            sequences[b] = torch.cat([sequences[b], sequences[b].new_tensor([result.tokens])], dim=-1)
            roots[b] = result.tokens[-1]
            finished[b] = result.finished
            rows[b].record_step(drafting, len(result.tokens), batch.sizes[slot[b]])
        added = sum(len(r.tokens) for r in results.values())
        if chooser is not None:  # the whole step (the accept read the tokens: on an accelerator too)
            chooser.observe(drafting, added, clock.step_seconds())  # many rows' tokens: less luck in their sum
        stats.record_step(drafting, added, sum(batch.sizes[slot[b]] for b in active))
    return call.output(sequences)


def squeeze_if_due(
    call: DecodeCall, cache, past_mask, ledger: HoleLedger, chooser, in_cache: int, share, drafting, previous_drafted
) -> torch.Tensor:
    """The past mask after squeezing the holes out before this step where that is due (module docstring):
    the ledger says they have cost what a squeeze does, the cache nears a window the masks cannot serve
    past, or plain steps follow drafted ones. A squeeze drafted steps' holes caused is charged to drafting
    (`StepChooser.charge_drafting`), not to this step."""
    window = None if call.windows is None else call.windows.cap
    holes = past_mask.shape[1] - in_cache
    crowded = window is not None and past_mask.shape[1] + (share or call.drafter.tree_budget) >= window
    # Plain steps the chooser takes after drafted ones run on a cache without the drafted steps' holes:
    # timed on them, plain steps would look dearer than plain decoding is, keeping drafting ahead where
    # it does not pay. (Later plain steps add a hole per finished row only: the ledger's business.)
    to_plain = chooser is not None and previous_drafted and not drafting and holes > 0
    if not (ledger.due(holes, past_mask.shape[1]) or (holes and crowded) or to_plain):
        return past_mask
    ledger.squeezed()
    with call.clock.phase("cache"):
        past_mask = squeeze_holes(cache, past_mask, in_cache)
    # drafted steps' holes (in a plain streak after that squeeze only finished rows make any)
    if chooser is not None and (previous_drafted or drafting):
        chooser.charge_drafting(call.clock.step_seconds())
        call.clock.start_step()
    return past_mask


def draft_rows(
    call: DecodeCall,
    sequences,
    hidden_last,
    active: list[int],
    slot: dict,
    slot_rows: list[int],
    real,
    share,
    batch_cost,
) -> list[DraftTree]:
    """The active rows' trees, by cache row (finished rows: their pad token alone): each row's ids left-padded
    into one tensor for the drafter."""
    length = max(s.shape[1] for s in sequences)
    padded = [torch.nn.functional.pad(s[0], (length - s.shape[1], 0), value=call.pad) for s in sequences]
    contexts = torch.stack(padded)
    rows_hidden = hidden_last[[slot[b] for b in active]]
    depth = call.max_depth(max(real[b] for b in active))
    cost = call.binding.step_cost
    drafted = call.drafter.draft(
        rows_hidden, contexts[active], depth, share, batch_cost, warp=call.warp, step_cost=cost
    )
    trees = [DraftTree.root_only(call.pad)] * len(slot_rows)
    for b, tree in zip(active, drafted):
        trees[slot[b]] = tree
    return trees


def accept_rows(
    call: DecodeCall,
    trees: list[DraftTree],
    logits: torch.Tensor,
    active: list[int],
    slot: dict[int, int],
    sequences: list[torch.Tensor],
    processors: list[LogitsProcessorList],
) -> dict[int, AcceptResult]:
    """Each active row's walk through its tree (`accept.accept_tree`), with the processors cut to that
    row (`row_processors`): sampled rows draw row by row. `trees` and `logits` are by cache row, row b's
    at `slot[b]`; the rest by the call's rows."""
    return {b: call.walk(trees[slot[b]], logits[slot[b]], sequences[b], processors[b]) for b in active}


def accept_greedy_rows(
    trees: list[DraftTree],
    logits: torch.Tensor,
    active: list[int],
    slot: dict[int, int],
    sequences: list[torch.Tensor],
    stop: HostStop,
) -> dict[int, AcceptResult]:
    """`accept_rows` for greedy decoding without processors: the base model's token at every node of every
    row in one argmax and one copy to the host, then each row's walk there (`accept.accept_greedy`)."""
    choices = greedy_tokens(logits).tolist()  # [rows in cache][N], finished rows' too: one read, no gather
    return {
        b: accept_greedy(trees[slot[b]], logits[slot[b]], sequences[b].shape[1], stop, choices[slot[b]]) for b in active
    }


def accept_greedy_roots(
    logits: torch.Tensor, active: list[int], slot: dict[int, int], sequences: list[torch.Tensor], stop: HostStop
) -> dict[int, AcceptResult]:
    """`accept_greedy_rows` for a plain step (every cache row verified its root alone, `tree.root_batch`):
    one argmax over every row's logits and one copy to the host; each row's token is its bonus token."""
    choices = greedy_tokens(logits[:, 0]).tolist()
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
