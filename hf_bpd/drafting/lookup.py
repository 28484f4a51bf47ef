"""Long copies: a chain drafted by looking the context's last n-gram up in the context itself.

Draft heads propose at most h tokens past the root, so where the answer repeats the prompt (extraction,
names in a translation, summaries, RAG, code edits) or itself (a model that loops), prompt-lookup decoding
wins by drafting ten tokens at once. The drafter does the same inside its tree: the continuation after the
most recent earlier occurrence of the context's last n tokens (the longest n <= `max_ngram` that occurs)
is merged into the heads' tree as one chain from the root.

Its nodes compete with the heads' nodes on calibrated path probability: every chain arc starts at
`LOOKUP_PROBABILITY`, and `AcceptanceCalibration` learns per (match length, depth) how often such arcs are
really accepted (sources "lookup1", "lookup2", ...). The forward-cost curve then decides, per step, how
much of the merged tree is worth verifying, so a chain that keeps being rejected stops costing anything.
Like every draft it only decides what is verified, never a token.

Two options branch it (`BlockDrafter`'s `context_lookup_nodes` and `lookup_after_drafts`): a tree of what
followed every earlier occurrence (`lookup_tree`), and chains looked up below the heads' most probable
nodes, with their drafted tokens appended to the context (`merge_lookups_after_drafts`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .calibration import AcceptanceCalibration, Arc, calibrated_logprob
from .corpus import SEPARATOR, continuation_tree
from .tree import DraftTree

LOOKUP_PROBABILITY = 0.5  # raw acceptance estimate of one chain arc before calibration has evidence
MAX_NGRAM = 3
LOOKUP = "lookup"  # the prefix of every lookup arc's calibration source


def lookup_source(ngram: int) -> str:
    """Calibration source of chain arcs found by an n-gram match of length `ngram`."""
    return f"{LOOKUP}{ngram}"


def context_matches(tokens: np.ndarray, max_ngram: int = MAX_NGRAM) -> tuple[np.ndarray, int]:
    """Where the context's last n tokens occurred before, for the longest n <= `max_ngram` that did: the
    ascending indices of those occurrences' last tokens, and n; (empty, 0) when not even the last token
    occurs before."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        # ends[i]: index of the last token of a match; a match must end before the context's last token
        ends = np.flatnonzero(tokens[n - 1 : length - 1] == tokens[-1]) + (n - 1)
        for k in range(1, n):
            ends = ends[tokens[ends - k] == tokens[length - 1 - k]]
        if ends.size:
            return ends, n
    return np.zeros(0, np.int64), 0


def lookup_continuation(tokens: np.ndarray, max_tokens: int, max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """The tokens that followed an earlier occurrence of the context's last n tokens, for the longest
    n <= `max_ngram` that occurs (most recent occurrence with `max_tokens` tokens after it, else the most
    recent one). Returns (continuation, n); ([], 0) when not even the last token occurs before."""
    if max_tokens < 1 or len(tokens) < 2:
        return [], 0
    ends, n = context_matches(tokens, max_ngram)
    if not ends.size:
        return [], 0
    full = ends[ends + max_tokens < len(tokens)]
    start = int(full[-1] if full.size else ends[-1]) + 1
    return tokens[start : start + max_tokens].tolist(), n


def lookup_tree(
    tokens: np.ndarray, max_depth: int, max_nodes: int, max_ngram: int = MAX_NGRAM
) -> tuple[list[tuple[list[int], list[float]]], int]:
    """What followed every earlier occurrence of the context's last n tokens (the longest n <= `max_ngram`
    that occurs), as a tree of up to `max_nodes` nodes grown by how many occurrences each path continues
    (`corpus.continuation_tree`: each arc estimated by its token's add-one smoothed share, so one occurrence
    gives `LOOKUP_PROBABILITY`'s 0.5 an arc, as the single chain's arcs have). Returns its root-to-leaf
    chains (tokens, arc log-probabilities), most probable first, and n; ([], 0) where nothing occurs."""
    if max_depth < 1 or max_nodes < 1 or len(tokens) < 2:
        return [], 0
    ends, n = context_matches(tokens, max_ngram)
    if not ends.size:
        return [], 0
    ended = np.append(np.asarray(tokens, dtype=np.int64), SEPARATOR)  # no chain runs past the context's end
    return continuation_tree(ended, ends, max_depth, max_nodes), n


def merge_lookup(
    tree: DraftTree,
    arcs: list[Arc],
    chain: list[int],
    ngram: int,
    calibration: AcceptanceCalibration | None,
    max_nodes: int,
) -> tuple[DraftTree, list[Arc]]:
    """Merge the context's `chain` (tokens after the root, found by an n-gram match of length `ngram`) into
    `tree` as `merge_chain` does, every chain arc estimated at `LOOKUP_PROBABILITY`."""
    copy = Arc(math.log(LOOKUP_PROBABILITY), lookup_source(ngram))
    return merge_chain(tree, arcs, chain, [copy] * len(chain), calibration, max_nodes)


def merge_chain(
    tree: DraftTree,
    arcs: list[Arc],
    chain: list[int],
    chain_arcs: list[Arc],
    calibration: AcceptanceCalibration | None,
    max_nodes: int,
) -> tuple[DraftTree, list[Arc]]:
    """Merge `chain` (tokens after the root, with their arcs) into `tree`, whose nodes carry `arcs`, and
    return the tree re-ordered by (calibrated) path probability with its arcs, cut to `max_nodes`. A chain
    token the tree drafted too keeps the better of the two arcs. Parents always come before their children
    (a child's path is never more probable; ties go to the shallower node), so every prefix is a tree."""
    if not chain:
        return tree, arcs
    tree = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depths), dict(tree._children))
    arcs = list(arcs)

    node, path = 0, ()
    for token, copy in zip(chain, chain_arcs):
        path = (*path, token)
        child = tree.child(node, token)
        depth = tree.depths[node] + 1
        if child is None:
            tree.add_path(path, len(tree) + 1)
            child = len(tree) - 1
            arcs.append(copy)
        elif calibrated_logprob(copy, depth, calibration) > calibrated_logprob(arcs[child], depth, calibration):
            arcs[child] = copy
        node = child
    return tree.by_path_probability(arcs, calibration, max_nodes)


def merge_chains(
    tree: DraftTree,
    arcs: list[Arc],
    chains: list[tuple[list[int], list[float]]],
    source: str,
    calibration: AcceptanceCalibration | None,
    max_nodes: int,
) -> tuple[DraftTree, list[Arc]]:
    """Merge every chain of `chains` ((tokens after the root, their arcs' log-probabilities), as
    `lookup_tree` and `CorpusIndex.continuations` give them) as `merge_chain` does, its arcs of calibration
    source `source`."""
    for chain, logprobs in chains:
        tree, arcs = merge_chain(tree, arcs, chain, [Arc(lp, source) for lp in logprobs], calibration, max_nodes)
    return tree, arcs


def merge_lookups_after_drafts(
    tree: DraftTree,
    arcs: list[Arc],
    tokens: np.ndarray,
    count: int,
    max_depth: int,
    calibration: AcceptanceCalibration | None,
    max_nodes: int,
) -> tuple[DraftTree, list[Arc]]:
    """Merge, below each of the `count` most probable nodes of `tree` (in path-probability order) that a
    lookup did not draft, the chain looked up with that node's path appended to the context: the drafted
    tokens can tell which earlier passage is being repeated where the context's own last tokens occur in
    many. Chains end at `max_depth` tokens past the root; their arcs are estimated as `merge_lookup`'s."""
    paths = tree.node_paths()
    drafted = [node for node in range(1, len(tree)) if not arcs[node].source.startswith(LOOKUP)][:count]
    grafts = []
    for node in drafted:
        path = paths[node]
        if len(path) >= max_depth:
            continue
        chain, ngram = lookup_continuation(
            np.concatenate([tokens, np.asarray(path, tokens.dtype)]), max_depth - len(path)
        )
        if chain:
            copy = Arc(math.log(LOOKUP_PROBABILITY), lookup_source(ngram))
            grafts.append(([*path, *chain], [arcs[i] for i in tree.path_to(node)[1:]] + [copy] * len(chain)))
    for chain, chain_arcs in grafts:  # node indices change with every merge: the paths were read first
        tree, arcs = merge_chain(tree, arcs, chain, chain_arcs, calibration, max_nodes)
    return tree, arcs


def lookup_on_device(
    sequence: torch.Tensor, length: torch.Tensor, chain_len: int, max_ngram: int = MAX_NGRAM
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lookup_continuation` as tensor ops with fixed shapes (the captured step's, issue #58): `sequence [S]`
    holds the context in its first `length` (a 0-d device tensor) entries, anything after. Returns the
    chain's `chain_len` tokens, which of them are real (after a match, before the context's end) and the
    match length n (0-d; 0: no match). The same choice: the longest n, then an occurrence with `chain_len`
    tokens after it, then the most recent."""
    size = sequence.shape[0]
    cols = torch.arange(size, device=sequence.device)
    matched = torch.ones(size, dtype=torch.bool, device=sequence.device)
    ngram_at = torch.zeros(size, dtype=torch.long, device=sequence.device)
    for k in range(max_ngram):  # matches of length k + 1 ending at each column
        last = sequence.index_select(0, (length - 1 - k).clamp_min(0).view(1))
        matched = matched & (sequence.index_select(0, (cols - k).clamp_min(0)) == last) & (cols >= k)
        matched = matched & (length - 1 - k >= 0)
        ngram_at = torch.where(matched, k + 1, ngram_at)
    ngram_at = ngram_at * (cols <= length - 2)  # a match ends before the context's last token
    full = (cols + chain_len < length).long()
    key = torch.where(ngram_at > 0, ngram_at * (4 * size) + full * (2 * size) + cols, -1)
    end = key.argmax(dim=0, keepdim=True)  # [1]
    ngram = ngram_at.index_select(0, end)
    at = end + 1 + torch.arange(chain_len, device=sequence.device)
    chain = sequence.index_select(0, at.clamp_max(size - 1))
    return chain, (at < length) & (ngram > 0), ngram[0]
