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

import inspect
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionAndFullAttentionLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .accept import AcceptResult, HostStop, choose_tokens
from .calibration import SamplingWarp
from .compat import CACHE_NAMES, GENERATE_CACHE_FIELD, last_hidden_state_request, output_cache
from .drafter import BlockDrafter
from .expansion import GrownTree
from .sampled_walk import accept_sampled_and_grow, walk_serves
from .static_cache import compact_static_cache, compiled_static_call, graph_tree_size, is_static, static_capacity
from .support import AttentionWindows, drafting_context, index_position_block, index_position_room
from .syncs import HostSyncCounter, phase
from .tree import DraftTree, TreeBatch, batch_trees
from .verify import verify_tree


def prompt_mask(input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The prompt's 2D mask of real tokens [B, P] (`generate` drops an all-ones mask: then all ones)."""
    mask = model_kwargs.get("attention_mask")
    return torch.ones_like(input_ids) if mask is None else mask


def keep_every_key(model_kwargs: dict) -> None:
    """Make the cache `generate` prepared keep every key of its windowed layers: each sliding/chunked cache
    layer (which keeps only the last W - 1 entries, so a tree's rejected entries would evict keys a later
    step needs) becomes a full `DynamicLayer`; the tree masks apply the windows instead (`support.py`).
    The returned cache then holds full layers: usable as is, the models build their windows from the
    config, not from the cache. A sliding layer that also keeps recurrent state (`hybrid_sliding`) becomes
    the full layer of the same kind, keeping its number of states."""
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if isinstance(cache, DynamicCache):
            for i, layer in enumerate(cache.layers):
                if getattr(layer, "is_sliding", False):
                    states = getattr(layer, "number_of_states", None)
                    full = DynamicLayer() if states is None else LinearAttentionAndFullAttentionLayer(states)
                    cache.layers[i] = full


def prefill(model, input_ids: torch.Tensor, model_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
    """Run the prompt exactly as `generate` does. Returns (raw next-token logits [B, V] float32, last
    hidden state [B, H], cache)."""
    keep_every_key(model_kwargs)
    # as `generate`'s first forward: with its multimodal inputs (images), which later steps drop
    first = {"is_first_iteration": True} if _takes_first_iteration(model) else {}
    model_inputs = model.prepare_inputs_for_generation(input_ids, **first, **model_kwargs)
    model_inputs["output_hidden_states"] = request = last_hidden_state_request(model)
    out = model(**model_inputs, return_dict=True)
    cache = output_cache(out)
    if not isinstance(cache, DynamicCache) and not is_static(cache):
        raise ValueError(f"hf_bpd needs a DynamicCache (the default) or a StaticCache, got {type(cache).__name__}")
    hidden = out.hidden_states[-1] if out.hidden_states else None
    if hidden is None:
        raise ValueError(f"{type(model).__name__} returns no last hidden state (output_hidden_states={request})")
    if hidden.dim() != 3:
        raise ValueError(
            f"{type(model).__name__} returns last hidden states of shape {tuple(hidden.shape)}, not [batch, tokens, "
            "hidden]: draft heads cannot read them"
        )
    logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    return logits, hidden[:, -1], cache


def _takes_first_iteration(model) -> bool:
    return "is_first_iteration" in inspect.signature(model.prepare_inputs_for_generation).parameters


TYPICAL_ACCEPTANCE = (0.09, 0.3)  # Medusa's (epsilon, delta)


def typical_acceptance(setting) -> tuple[float, float] | None:
    """`lossy_typical_acceptance` of a `generate` call -> (epsilon, delta), or None when off."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return TYPICAL_ACCEPTANCE
    try:
        epsilon, delta = (float(v) for v in setting)
    except (TypeError, ValueError):
        raise ValueError(f"lossy_typical_acceptance takes True or (epsilon, delta), got {setting!r}") from None
    if not (0 < epsilon <= 1 and delta > 0):
        raise ValueError(f"lossy_typical_acceptance needs 0 < epsilon <= 1 and delta > 0, got {setting!r}")
    return epsilon, delta


def typical_child(tree: DraftTree, node: int, scores: torch.Tensor, epsilon: float, delta: float) -> int | None:
    """Medusa's typical acceptance at `node` (lossy): the drafted child whose token's processed probability
    exceeds min(epsilon, delta * exp(-entropy)), the most probable one if several do, else None."""
    children = [i for i in range(node + 1, len(tree)) if tree.parents[i] == node]
    if not children:
        return None
    logp = torch.log_softmax(scores.float(), dim=-1)
    probs = logp.exp()
    entropy = float(-(probs * logp).nan_to_num().sum())  # tokens masked to -inf contribute 0, not NaN
    threshold = min(epsilon, delta * float(torch.exp(torch.tensor(-entropy))))
    p = probs[[tree.tokens[i] for i in children]].tolist()
    best = max(range(len(children)), key=p.__getitem__)
    return children[best] if p[best] > threshold else None


def accept_greedy(
    tree: DraftTree, logits: torch.Tensor, length: int, stop: HostStop, choices: list[int] | None = None
) -> AcceptResult:
    """`accept_tree` for greedy decoding without logits processors and with `HostStop` criteria: the base
    model's token at every node in one argmax (one device-to-host copy for the whole step), then the same
    walk on the host. `length`: the sequence's length, root included. `choices`: that argmax, where the
    caller already read it (`accept_greedy_and_grow`)."""
    if choices is None:
        choices = logits.argmax(dim=-1).tolist()
    nodes, tokens = [], []
    node = 0
    while True:
        nodes.append(node)
        tokens.append(choices[node])
        length += 1
        if stop(length, choices[node]):
            finished = True
            break
        child = tree.child(node, choices[node])
        if child is None:
            finished = False
            break
        node = child
    raw = [logits[i].float() for i in nodes]  # views: no copy to the host (scores = raw logits: no processors)
    return AcceptResult(nodes, tokens, raw, raw, finished)


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
    logits, hidden = out.logits[0], out.hidden_states[-1][0]
    choices = logits.argmax(dim=-1)
    last = greedy_last_node(batch, torch.tensor(tree.parents, device=device), choices)
    t0 = time.perf_counter()
    grown = drafter.grow(hidden.index_select(0, last), choices.index_select(0, last), max_depth=max_depth)
    values = torch.cat([choices.double(), last.double(), grown.flat().to(device)]).tolist()  # the one copy
    drafter.stats.time_heads += time.perf_counter() - t0
    n = len(tree)
    result = accept_greedy(tree, logits, length, stop, [int(v) for v in values[:n]])
    if result.finished or result.nodes[-1] != int(values[n]):  # stopped (eos, length) inside the path
        return result, None
    return result, [GrownTree.on_host(result.tokens[-1], values[n + 1 :])]


def accept_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    sequence: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    do_sample: bool = False,
    typical: tuple[float, float] | None = None,
    stop: HostStop | None = None,
) -> AcceptResult:
    """Follow the base model's own choices through the tree for one row: its greedy token at each node,
    or with `do_sample` one draw from its processed distribution there (module docstring: exact).

    logits [N, V] are the raw logits of every node; `sequence` [1, L] ends with the root. At each visited
    node the processors see exactly the sequence plain `generate` would have had, so the chosen token is
    the one `generate` would choose (or has the law of its draw). A matching child is followed; otherwise
    the chosen token is the bonus token and the step ends. Stopping criteria are checked after every token,
    so eos or max_new_tokens inside an accepted draft stop right there. `typical` (sampling only, lossy):
    accept children by Medusa's typical acceptance instead (`typical_child`; module docstring). `stop`:
    the criteria's host form where they have one (`HostStop.of`): greedy steps without processors then
    take `accept_greedy`, same tokens with one synchronisation, and every other walk checks it on the host
    (one synchronisation per reached node: its token; `sampled_walk.py` makes a sampled step's draws on the
    device with one).
    """
    if stop is not None and not do_sample and typical is None and len(logits_processor) == 0:
        return accept_greedy(tree, logits, sequence.shape[1], stop)
    nodes, tokens, scores, raw = [], [], [], []
    node = 0
    while True:
        nodes.append(node)
        node_logits = logits[node : node + 1].float()
        node_scores = logits_processor(sequence, node_logits)
        accepted = None if typical is None else typical_child(tree, node, node_scores[0], *typical)
        token = int(choose_tokens(node_scores, do_sample)) if accepted is None else tree.tokens[accepted]
        sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
        tokens.append(token)
        scores.append(node_scores[0])
        raw.append(node_logits[0])
        stopped = (
            stop(sequence.shape[1], token) if stop is not None else bool(stopping_criteria(sequence, node_scores).any())
        )
        if stopped:
            return AcceptResult(nodes, tokens, scores, raw, finished=True)
        child = tree.child(node, token)
        if child is None:
            return AcceptResult(nodes, tokens, scores, raw, finished=False)
        node = child


def compact_cache(cache: DynamicCache, num_tree: int, keep: torch.Tensor) -> None:
    """Drop rejected tree entries: of the last `num_tree` entries of every layer keep only the tree
    indices `keep` (ascending, root first), moved to the front of the tree slot.

    Touches only the tree slot, so its cost does not grow with the context length, and leaves each layer
    a view of its old tensor (a compiled forward gets it copied out: `verify_tree`)."""
    dropped = num_tree - keep.numel()
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:  # a layer never written (not in real decoding)
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            start = t.shape[-2] - num_tree
            t[..., start : start + keep.numel(), :] = t.index_select(-2, keep + start)
            setattr(layer, name, t[..., : start + keep.numel(), :])
        if hasattr(layer, "cumulative_length"):  # sliding-window layers count tokens seen
            layer.cumulative_length -= dropped


def decode(
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
    """The decoding loop of `generate`, on a call already checked and a drafter prepared for `model`
    (inside its linear context: `generation._prepared`): prefill, then draft, verify, accept and compact
    until a stopping criterion holds. `windows`: the model's attention windows (`support.py`): they shape
    the tree masks, and a `cap` among them caps trees below it.
    `typical`: Medusa's lossy typical acceptance (epsilon, delta), or None (exact)."""
    stats = drafter.stats
    prompt_len = input_ids.shape[1]
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    context = drafting_context(model, getattr(model.config, "max_position_embeddings", None), prompt_len)
    syncs = HostSyncCounter() if drafter.count_host_syncs else None  # a test's or measurement's, never timed
    stop = HostStop.of(stopping_criteria)
    t0 = time.perf_counter()
    with phase(syncs, "prefill"):
        past_mask = prompt_mask(input_ids, model_kwargs)
        logits, hidden_last, cache = prefill(model, input_ids, model_kwargs)
        do_sample = bool(generation_config.do_sample)
        warp = SamplingWarp.from_config(generation_config)
        scores = logits_processor(input_ids, logits)
        first = choose_tokens(scores, do_sample)[:, None]
        input_ids = torch.cat([input_ids, first], dim=-1)
        finished = bool(stopping_criteria(input_ids, scores).any())
        sequence = input_ids[0].tolist()  # the row on the host, kept in step with input_ids (no copy back)
        root = sequence[-1]
    capacity = static_capacity(cache)  # a static cache: trees fit its free slots (`static_cache.py`)
    static_call = None if capacity is None else compiled_static_call(model, generation_config, model_kwargs)
    chooser = drafter.step_chooser()  # plain steps where drafting does not pay ("auto" trees)
    # the next tree can be grown inside a step's accept, before its length is known
    grows_next = drafter.grows_on_device and (windows is None or windows.cap is None)
    # greedy steps read their tokens and the next tree in one copy (`accept_greedy_and_grow`)
    fuse = stop is not None and not do_sample and typical is None and len(logits_processor) == 0 and grows_next
    # sampled steps walk on the device where that walk serves them (`sampled_walk.py`), growing the next
    # tree in the same copy as greedy steps do
    fuse_sampled = (
        stop is not None
        and do_sample
        and typical is None
        and (drafter.fused_sampling if drafter.fused_sampling is not None else input_ids.device.type != "cpu")
        and walk_serves(logits_processor, input_ids.device)
    )
    grow_sampled = fuse_sampled and grows_next
    grown, next_drafts = None, None  # the next step's tree, grown during the last step, and its decision
    block = index_position_block(model)  # queries read their cache index as position (Llama-4): trees bounded
    stats.time_prefill = time.perf_counter() - t0
    stats.new_tokens = 1
    all_scores.append(scores)
    all_logits.append(logits)
    if streamer is not None:
        streamer.put(first[0].cpu())

    while not finished:
        past_len = past_mask.shape[1]
        # Positions past the model's context would be garbage drafts: cap the tree depth.
        max_depth = None if context is None else max(context - past_len - 1, 0)
        # A window the masks cannot serve past (GPT-Neo's local layers): below it every layer attends like
        # full attention, so keep context + tree there (check_call_supported made sure the root fits).
        cap = None if windows is None else windows.cap
        max_tokens = None if cap is None else cap - 1 - past_len
        room = None if capacity is None else capacity - past_len  # a static cache's free slots
        # nodes whose cache index falls in another block than their position would be scaled wrongly
        limit = min((n for n in (room, index_position_room(block, past_len)) if n is not None), default=None)
        if limit is not None:
            max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        t0 = time.perf_counter()
        if next_drafts is None:  # else decided by the last step's fused accept
            next_drafts = chooser is None or chooser.draft_next()
        drafting = next_drafts
        with phase(syncs, "draft"):
            if drafting:
                given = {} if grown is None else {"grown": grown}
                trees = drafter.draft(
                    hidden_last, input_ids, max_depth, max_tokens, warp=warp, host_context=[sequence], **given
                )
            else:
                trees = drafter.root_trees([root])
            if limit is not None and len(trees[0]) > limit:  # a tree grown last step, before its limit was known
                trees = [trees[0].truncated(limit)]
        grown = next_drafts = None
        t1 = drafter._sync(input_ids.device)
        with phase(syncs, "verify"):
            size = None if static_call is None else graph_tree_size(len(trees[0]), room)  # one graph per size
            batch = batch_trees(trees, pad_token_id=trees[0].tokens[0], device=input_ids.device, pad_to=size)
            out = verify_tree(model, batch, cache, past_mask, windows, forward=static_call, capacity=capacity)
            if static_call is not None:  # a replayed graph's outputs are overwritten by its next replay
                out.logits, out.hidden_states = out.logits.clone(), (out.hidden_states[-1].clone(),)
        t2 = drafter._sync(input_ids.device)
        heads_before = stats.time_heads  # a fused accept grows the next tree: heads time, not accept time
        with phase(syncs, "accept"):
            if fuse or fuse_sampled:  # decide the next step now: its tree is grown before this copy
                next_drafts = chooser is None or chooser.draft_next()
            depth = None if context is None else max(context - past_len - len(trees[0]) - 1, 0)
            if fuse_sampled:
                grow = grow_sampled and next_drafts
                result, grown = accept_sampled_and_grow(
                    drafter, trees[0], batch, out, input_ids, logits_processor, stop, grow, depth, warp
                )
            elif next_drafts:
                result, grown = accept_greedy_and_grow(drafter, trees[0], batch, out, input_ids.shape[1], stop, depth)
            else:
                result = accept_tree(
                    trees[0], out.logits[0], input_ids, logits_processor, stopping_criteria, do_sample, typical, stop
                )
            # CPU times are exact; on an accelerator only when the drafter synchronises (profile)
            timed = input_ids.device.type == "cpu" or drafter.profile
            drafter.observe([result.nodes], [result.finished], batch.input_ids.shape[1], t2 - t1 if timed else None)
        t3 = time.perf_counter()
        root = result.tokens[-1]
        sequence.extend(result.tokens)
        with phase(syncs, "cache"):
            keep = torch.tensor(result.nodes, device=input_ids.device)
            if capacity is not None:
                compact_static_cache(cache, past_len, batch.input_ids.shape[1], keep)
            elif keep.numel() < batch.input_ids.shape[1]:  # nothing to drop when every node was accepted
                compact_cache(cache, batch.input_ids.shape[1], keep)
            past_mask = torch.cat([past_mask, past_mask.new_ones(1, keep.numel())], dim=-1)
            hidden_last = out.hidden_states[-1][:, result.nodes[-1]]
            new = input_ids.new_tensor([result.tokens])
            input_ids = torch.cat([input_ids, new], dim=-1)
        t4 = drafter._sync(input_ids.device)
        if chooser is not None:  # the whole step: a drafted step's compaction is part of what it costs
            chooser.observe(drafting, len(result.tokens), t4 - t0)
        stats.time_verify += t2 - t1
        stats.time_accept += t3 - t2 - (stats.time_heads - heads_before)
        stats.time_cache += t4 - t3
        stats.steps += 1
        stats.plain_steps += not drafting
        stats.new_tokens += len(result.tokens)
        stats.accepted_lengths.append(len(result.tokens))
        stats.tree_sizes.append(len(trees[0]))
        if want_scores:
            all_scores.extend(s[None] for s in result.scores)
        if want_logits:
            all_logits.extend(x[None] for x in result.logits)
        if streamer is not None:
            for token in result.tokens:
                streamer.put(torch.tensor([token]))
        finished = result.finished

    if syncs is not None:
        stats.host_syncs = dict(syncs.counts)
    if streamer is not None:
        streamer.end()
    assert input_ids.shape[1] - prompt_len == stats.new_tokens
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=tuple(all_scores) if want_scores else None,
            logits=tuple(all_logits) if want_logits else None,
            **{GENERATE_CACHE_FIELD: cache if generation_config.use_cache else None},
        )
    return input_ids
