"""The exact sampled accept walk of one row with ONE device-to-host copy per step (`accept_sampled_and_grow`).

`accept.accept_tree` walks a sampled step on the host: at each reached node it draws one token from the
base model's processed distribution and reads it back (`int(token)`) to decide whether to go on. That
is one synchronisation per reached node, each a stall of an accelerator's pipeline. Here the walk runs on
the device instead, with the same draws:

    node = root
    for d in 0 .. the tree's depth:                    (no host read inside the loop)
        y_d = multinomial(softmax(processors(path ids, logits[node])))    exactly plain sampling's call
        generator state after draw d is kept (host-side: seed and offset, or the CPU generator's state)
        node = the child of node carrying y_d, or node itself when there is none (the walk has ended)

and one copy reads every y_d, the node it was drawn at and whether it matched a child, together with the
next step's tree grown from where the walk ended (`BlockDrafter.grow`, as the fused greedy step does).
The host then replays the walk: tokens up to the first unmatched draw (or a stop: eos, max length), and
puts the generator back to its state after the last emitted draw. The draws past the walk's end were
made from a node the walk never reached; putting the generator back undoes them, so the random stream
moves exactly one `torch.multinomial` call per emitted token, in order, as plain `generate` moves it,
and a seed gives the same tokens (the module docstring of `row.py` has the proof of exactness; this
changes only when tokens are read, not which are drawn).

The price is the wasted draws (the tree's depth + 1 draws per step against the emitted tokens): on a CPU,
where reading a token costs nothing, the host walk is cheaper, so `BlockDrafter.fused_sampling` ("auto")
takes this walk on accelerators only. It serves processors that neither read the host nor keep state
between calls (`FUSABLE_PROCESSORS`: temperature, top-k, top-p, min-p, typical, epsilon, eta, repetition
penalty, min length): each runs once per depth, reached or not.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..drafting.drafter import BlockDrafter
from ..drafting.expansion import GrownTree
from ..drafting.tree import DraftTree, TreeBatch
from .accept import AcceptResult, HostStop, choose_tokens

# processors that only read their inputs' values and shapes: calling one at a node the walk never reached
# changes nothing, and none reads a value back to the host
FUSABLE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator `torch.multinomial` draws from on `device` when given none (plain sampling's), or
    None for a device whose generator this module does not know."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


def walk_serves(processors: LogitsProcessorList, device: torch.device) -> bool:
    """Whether the device walk can run a sampled step with these processors on `device`."""
    return default_generator(device) is not None and all(type(p) in FUSABLE_PROCESSORS for p in processors)


def accept_sampled_and_grow(
    drafter: BlockDrafter,
    tree: DraftTree,
    batch: TreeBatch,
    out,
    sequence: torch.Tensor,
    processors: LogitsProcessorList,
    stop: HostStop,
    grow: bool,
    max_depth: int | None = None,
    warp=None,
) -> tuple[AcceptResult, list | None]:
    """One row's exact sampled walk (module docstring) over a verified `tree` (`batch`: its model inputs,
    `out`: the verification forward's output), `sequence [1, L]` the ids so far (ending with the root).
    With `grow`, the next step's tree is grown from the walk's last node and read in the same copy
    (`max_depth`, `warp`: `BlockDrafter.grow`'s). Returns the step's result and the grown tree for
    `BlockDrafter.draft(grown=...)` (None when not grown or when decoding stops inside the walk)."""
    input_ids, logits, hidden = batch.row(0)[0], out.logits[0], out.hidden_states[-1][0]
    device = logits.device
    generator = default_generator(device)
    parents = torch.tensor(tree.parents, device=device)
    node = torch.zeros(1, dtype=torch.long, device=device)
    drawn, at, matched, scores, states = [], [], [], [], []
    for _ in range(max(tree.depths) + 1):
        node_scores = processors(sequence, logits.index_select(0, node).float())
        token = choose_tokens(node_scores, do_sample=True)  # [1], as `generate` draws it
        states.append(generator.get_state())
        child = (parents == node) & (input_ids == token)
        found = child.any(0, keepdim=True)
        drawn.append(token)
        at.append(node)
        matched.append(found)
        scores.append(node_scores[0])
        node = torch.where(found, child.long().argmax(0, keepdim=True), node)
        sequence = torch.cat([sequence, token[:, None]], dim=-1)
    drawn, at, matched = torch.cat(drawn), torch.cat(at), torch.cat(matched)
    depth = len(drawn)
    values = [drawn.double(), at.double(), matched.double()]
    t0 = time.perf_counter()
    if grow:  # from the first unmatched draw: the walk's end unless a stop comes first
        end = (~matched).long().argmax(0, keepdim=True)
        grown = drafter.grow(hidden.index_select(0, at[end]), drawn[end], max_depth=max_depth, warp=warp)
        values.append(grown.flat().to(device))
    host = torch.cat(values).tolist()  # the one copy
    if grow:  # growing is heads time, not accept time (as in `row.accept_greedy_and_grow`)
        drafter.stats.time_heads += time.perf_counter() - t0
    length, finished = sequence.shape[1] - depth, False
    nodes, tokens = [], []
    for d in range(depth):
        nodes.append(int(host[depth + d]))
        tokens.append(int(host[d]))
        length += 1
        if stop(length, tokens[-1]):
            finished = True
            break
        if not host[2 * depth + d]:
            break
    generator.set_state(states[len(tokens) - 1])  # the stream as after the last emitted draw
    raw = [logits[i].float() for i in nodes]
    result = AcceptResult(nodes, tokens, scores[: len(tokens)], raw, finished)
    if not grow or finished:
        return result, None
    return result, [GrownTree.on_host(tokens[-1], host[3 * depth :])]
