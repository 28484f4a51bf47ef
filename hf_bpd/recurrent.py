"""Drafted decoding for hybrid and recurrent models (Mamba-2, Qwen3-Next, LFM2, Falcon-H1, ...): one chain of
drafts per step, verified by a plain causal forward, with the recurrent state restored where a draft fails.

A tree forward cannot serve a recurrent or convolutional layer: it reads its tokens in order, so siblings
and rejected drafts would all flow into one state. So each step verifies ONE chain, the draft tree reduced to
its most promising root-to-leaf path (`BlockDrafter.chains`), through the model's own causal forward, the
inputs prepared by its `prepare_inputs_for_generation` exactly as plain `generate` prepares a step's:

  snapshot   copy every conv / recurrent state of the cache (`LinearAttentionCacheLayerMixin` layers)
  verify     ONE forward of [replay..., root, chain...] on the cache
  accept     the base model's own choices along the chain (`decoding.accept_tree`: greedy or sampled)
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

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .accept import HostStop
from .batch import HoleLedger, row_processors, squeeze_holes
from .calibration import SamplingWarp
from .chain import drop_last, restore, snapshot, state_tensors, verify_chain
from .compat import GENERATE_CACHE_FIELD
from .decoding import accept_tree, choose_tokens, prefill, prompt_mask
from .drafter import BlockDrafter
from .stats import DecodingStats
from .support import AttentionWindows
from .tree import DraftTree

# ----------------------------------------------------------------------------------------------------------
# one step


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


def decode_recurrent(
    model,
    drafter: BlockDrafter,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer,
    windows: AttentionWindows | None,
    model_kwargs: dict,
    typical: tuple[float, float] | None = None,
):
    """The chain loop (module docstring) for one row or a batch, on a call already checked and a drafter
    prepared for `model`. Returns what `generate` returns: one row as `decoding.decode` does, a batch padded
    on the right with the pad token as `batch.decode_batch` does."""
    stats = drafter.stats
    batch_size, device = input_ids.shape[0], input_ids.device
    prompt_len = input_ids.shape[1]
    pad = 0 if generation_config._pad_token_tensor is None else int(generation_config._pad_token_tensor)
    do_sample = bool(generation_config.do_sample)
    warp = SamplingWarp.from_config(generation_config)
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    stop = HostStop.of(stopping_criteria)
    processors = (
        [logits_processor] if batch_size == 1 else [row_processors(logits_processor, b) for b in range(batch_size)]
    )
    rows = [DecodingStats() for _ in range(batch_size)] if batch_size > 1 else []
    stats.rows = rows

    t0 = time.perf_counter()
    past_mask = prompt_mask(input_ids, model_kwargs)
    logits, hidden_last, cache = prefill(model, input_ids, model_kwargs)
    _check_state_in_cache(model, cache)
    scores = logits_processor(input_ids, logits)
    first = choose_tokens(scores, do_sample)
    sequences = [torch.cat([input_ids[b : b + 1], first[b].view(1, 1)], dim=-1) for b in range(batch_size)]
    finished = [bool(stopping_criteria(sequences[b], scores[b : b + 1]).any()) for b in range(batch_size)]
    replays: list[list[int]] = [[] for _ in range(batch_size)]
    stats.time_prefill = time.perf_counter() - t0
    stats.new_tokens = batch_size
    for row in rows:
        row.new_tokens = 1
    all_scores.append(scores)
    all_logits.append(logits)
    if streamer is not None:
        streamer.put(first.cpu())
    chooser = drafter.step_chooser() if batch_size == 1 else None  # plain steps where drafting does not pay
    ledger = HoleLedger()

    while not all(finished):
        t0 = time.perf_counter()
        active = [b for b in range(batch_size) if not finished[b]]
        real = past_mask.long().sum(-1)
        holes = past_mask.shape[1] - int(real.max())
        # the model windows its layers by cache index: holes would count as tokens there
        if ledger.due(holes, past_mask.shape[1]) or (holes and windows is not None):
            ledger.squeezed()
            past_mask = squeeze_holes(cache, past_mask)
        room = chain_room(drafter, replays, active)
        drafting = (chooser is None or chooser.draft_next()) and max(room) > 1
        if drafting:
            longest = int(real[active].max()) + max(len(replays[b]) for b in active)
            max_depth = None if context is None else max(context - longest - 1, 0)
            contexts = [sequences[b][0] for b in active]
            length = max(len(c) for c in contexts)
            padded = torch.stack([torch.nn.functional.pad(c, (length - len(c), 0), value=pad) for c in contexts])
            trees = drafter.draft(
                hidden_last[active],
                padded,
                max_depth,
                max(room),
                warp=warp,
                host_context=[c.tolist() for c in contexts],
            )
            drafted = drafter.chains(trees, room)
        else:
            drafted = drafter.root_trees([int(sequences[b][0, -1]) for b in active])
        chains: list[DraftTree | None] = [None] * batch_size
        for b, chain in zip(active, drafted):
            chains[b] = chain
        ids = torch.tensor(row_inputs(replays, chains, pad), device=device)
        width = ids.shape[1]
        t1 = drafter._sync(device)
        saved = snapshot(cache)
        out = verify_chain(model, ids, cache, past_mask)
        t2 = drafter._sync(device)
        results = {}
        for b in active:
            start = len(replays[b])
            results[b] = accept_tree(
                chains[b],
                out.logits[b, start : start + len(chains[b])],
                sequences[b],
                processors[b],
                stopping_criteria,
                do_sample,
                typical,
                stop,
            )
        timed = device.type == "cpu" or drafter.profile
        drafter.observe(
            [results[b].nodes for b in active], [results[b].finished for b in active], width, t2 - t1 if timed else None
        )
        t3 = time.perf_counter()
        if chooser is not None:
            chooser.observe(drafting, len(results[active[0]].tokens), t3 - t0)
        # a row commits when the forward read nothing of it that was not accepted
        committed = [b in results and len(replays[b]) + len(results[b].nodes) == width for b in range(batch_size)]
        restored = [b for b in range(batch_size) if not committed[b]]
        if len(restored) == batch_size:  # no row keeps this forward: drop its entries, not make holes
            restore(cache, saved)
            drop_last(cache, width)
        else:
            if restored:
                restore(cache, saved, restored)
            slots = torch.tensor([[int(c)] * width for c in committed], dtype=past_mask.dtype, device=device)
            past_mask = torch.cat([past_mask, slots], dim=-1)
        last = [len(replays[b]) + results[b].nodes[-1] if b in results else 0 for b in range(batch_size)]
        hidden_last = out.hidden_states[-1][torch.arange(batch_size, device=device), torch.tensor(last, device=device)]
        for b, result in results.items():
            chain = chains[b]
            stats.replayed += len(replays[b])
            replays[b] = [] if committed[b] else replays[b] + [chain.tokens[i] for i in result.nodes]
            sequences[b] = torch.cat([sequences[b], sequences[b].new_tensor([result.tokens])], dim=-1)
            finished[b] = result.finished
            if rows:
                rows[b].steps += 1
                rows[b].new_tokens += len(result.tokens)
                rows[b].accepted_lengths.append(len(result.tokens))
                rows[b].tree_sizes.append(len(chain))
        t4 = time.perf_counter()
        added = sum(len(r.tokens) for r in results.values())
        stats.record_batch_step((t1, t2, t3, t4), drafting, added, sum(len(chains[b]) for b in active))
        if batch_size == 1:
            result = results[0]
            if want_scores:
                all_scores.extend(s[None] for s in result.scores)
            if want_logits:
                all_logits.extend(x[None] for x in result.logits)
            if streamer is not None:
                for token in result.tokens:
                    streamer.put(torch.tensor([token]))

    if streamer is not None:
        streamer.end()
    if batch_size > 1:
        length = max(s.shape[1] for s in sequences)
        return torch.cat([torch.nn.functional.pad(s, (0, length - s.shape[1]), value=pad) for s in sequences])
    sequence = sequences[0]
    assert sequence.shape[1] - prompt_len == stats.new_tokens
    if generation_config.return_dict_in_generate:
        # a cache behind the text (a replay pending) is not handed out as if it held it
        kept = cache if generation_config.use_cache and not replays[0] else None
        return GenerateDecoderOnlyOutput(
            sequences=sequence,
            scores=tuple(all_scores) if want_scores else None,
            logits=tuple(all_logits) if want_logits else None,
            **{GENERATE_CACHE_FIELD: kept},
        )
    return sequence


def _check_state_in_cache(model, cache) -> None:
    """The served families keep their state in the cache's linear-attention layers (a guard: a model
    that kept it elsewhere would decode wrongly, so stop rather than answer)."""
    if not isinstance(cache, DynamicCache) or not state_tensors(cache):
        raise RuntimeError(
            f"{type(model).__name__} keeps no conv or recurrent state in its cache's layers after the prefill, so "
            "hf_bpd cannot restore it after a rejected draft (please report this model type)"
        )
