"""Context lookup: the continuation after the context's last n-gram, merged into the tree by probability."""

import math

import numpy as np
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.drafting.calibration import HEADS, AcceptanceCalibration, Arc
from hf_bpd.drafting.lookup import (
    LOOKUP_PROBABILITY,
    lookup_continuation,
    lookup_source,
    lookup_tree,
    merge_lookup,
    merge_lookups_after_drafts,
)
from hf_bpd.drafting.tree import DraftTree


def test_longest_match_most_recent_with_room_wins():
    tokens = np.array([5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 4, 8, 1, 2, 3])
    # "1 2 3" occurred at 1..3 (followed by 9 9 7 ...): the trigram beats the later bigram "2 3" at 7..8
    assert lookup_continuation(tokens, 3) == ([9, 9, 7], 3)
    assert lookup_continuation(np.array([4, 6, 4, 7, 4]), 1) == ([7], 1)  # most recent unigram match
    assert lookup_continuation(np.array([1, 2, 3]), 5) == ([], 0)  # nothing recurs
    assert lookup_continuation(np.array([1, 2, 1]), 0) == ([], 0)


def test_merge_keeps_parents_first_and_the_better_arc():
    tree = DraftTree.from_paths(0, [(1, 2), (3,)], 8)
    arcs = [Arc(0.0, HEADS), Arc(math.log(0.9), HEADS), Arc(math.log(0.1), HEADS), Arc(math.log(0.05), HEADS)]
    merged, merged_arcs = merge_lookup(tree, arcs, [1, 4, 5], 2, AcceptanceCalibration(), 8)
    paths = merged.node_paths()
    assert set(paths) == {(), (1,), (1, 2), (3,), (1, 4), (1, 4, 5)}
    assert all(merged.parents[i] < i for i in range(1, len(merged)))
    assert merged_arcs[paths.index((1,))].source == HEADS  # 0.9 beats the lookup's 0.5
    assert merged_arcs[paths.index((1, 4))].source == lookup_source(2)
    cut, cut_arcs = merge_lookup(tree, arcs, [1, 4, 5], 2, None, 3)
    assert cut.node_paths() == [(), (1,), (1, 4)] and len(cut_arcs) == 3  # the most probable prefix


def test_merge_without_calibration_keeps_parents_first_when_an_arc_rounds_above_zero():
    # sampling's top-p warp renormalises a node whose best child alone holds the nucleus to log(1) in
    # float32, which can land a rounding step above 0: a child must still not outrank its parent
    tree = DraftTree.from_paths(0, [(1, 2)], 8)
    arcs = [Arc(0.0, HEADS), Arc(math.log(0.5), HEADS), Arc(1e-7, HEADS)]
    merged, _ = merge_lookup(tree, arcs, [3], 1, None, 8)
    assert set(merged.node_paths()) == {(), (1,), (1, 2), (3,)}
    assert all(merged.parents[i] < i for i in range(1, len(merged)))


def test_repetitive_text_is_drafted_past_the_heads_depth_and_stays_exact():
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)
    depths = {}
    for lookup in (0, 10):
        drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=24, context_lookup=lookup)
        kw = dict(do_sample=False, max_new_tokens=30, custom_generate=hf_bpd.generate, assistant=drafter)
        out = model.generate(ids, **kw)
        assert out.tolist() == ref.tolist()
        depths[lookup] = max(drafter.stats.accepted_lengths)
    assert depths[0] <= 3  # two heads: at most two drafted tokens and the bonus
    assert depths[10] >= depths[0]


def test_lattice_heads_with_a_fixed_tree_size_hold_the_lookup_chain():
    # Heads without a token input draft from their lattice; with a fixed tree size and no rescorer nothing
    # else asks for the nodes' arcs, and the lookup chain must still be merged (it once was silently not).
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)  # no token input: lattice heads
    assert not heads.conditions_on_draft
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]])  # "5 6 7" was followed by 8 9 10 11 12
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, -1]
    for lookup, holds in ((4, True), (0, False)):
        drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, context_lookup=lookup, calibrate=False)
        hf_bpd.prepare(drafter, model)
        (tree,) = drafter.draft(hidden, ids)
        assert ((8, 9, 10, 11) in tree.node_paths()) is holds


def test_lookup_tree_branches_by_how_many_occurrences_continue_each_path():
    # "0 1 2" occurred three times: twice followed by 3 4, once (the most recent) by 5; the context ends in it
    tokens = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2])
    chains, n = lookup_tree(tokens, 3, 8)
    assert n == 3
    assert [chain for chain, _ in chains] == [[3, 4, 0], [5, 0, 1]]
    assert np.allclose(np.exp(chains[0][1]), [2 / 4, 2 / 3, 2 / 3])  # each arc: its share, add-one smoothed
    assert np.allclose(np.exp(chains[1][1]), [1 / 4, 1 / 2, 1 / 2])


def test_lookup_tree_of_one_occurrence_is_the_chain_at_the_lookup_probability():
    tokens = np.array([5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 4, 4, 8, 1, 2, 3])
    chains, n = lookup_tree(tokens, 3, 8)
    assert (chains[0][0], n) == lookup_continuation(tokens, 3) and len(chains) == 1
    assert np.allclose(chains[0][1], math.log(LOOKUP_PROBABILITY))
    # equal counts: the later occurrence's continuation first; no chain reads past the context's end
    chains, n = lookup_tree(np.array([7, 1, 7, 2, 7]), 4, 8)
    assert n == 1 and [chain for chain, _ in chains] == [[2, 7], [1, 7, 2, 7]]
    assert lookup_tree(np.array([1, 2, 3]), 5, 8) == ([], 0)


def test_a_drafter_with_a_lookup_tree_drafts_every_occurrences_continuation_and_stays_exact():
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 3, 5, 6, 7, 10, 11, 3, 5, 6, 7]])  # "5 6 7" followed by 8 9 and 10 11
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, -1]
    for nodes, branches in ((None, {(10, 11)}), (6, {(8, 9), (10, 11)})):
        drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, context_lookup=4, context_lookup_nodes=nodes)
        hf_bpd.prepare(drafter, model)
        (tree,) = drafter.draft(hidden, ids)
        assert {path for path in branches if path in tree.node_paths()} == branches
        assert (nodes is None) == ((8, 9) not in tree.node_paths())
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    grafting = BlockDrafter(heads, top_k=2, max_tree_tokens=12, context_lookup=4, lookup_after_drafts=3)
    for assistant in (drafter, grafting):
        kw = dict(do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=assistant)
        assert model.generate(ids, **kw).tolist() == ref.tolist()


def test_a_lookup_after_a_drafted_node_continues_the_passage_its_token_picks_out():
    # the context ends in 0, which occurred before 1 2 3 and before 4 5 6: the root's lookup takes the most
    # recent (4 5 6); the heads' second node 1 picks out the other passage, and is continued by 2 3
    tokens = np.array([0, 1, 2, 3, 9, 0, 4, 5, 6, 9, 0])
    tree = DraftTree.from_paths(0, [(4,), (1,)], 8)
    arcs = [Arc(0.0, HEADS), Arc(math.log(0.5), HEADS), Arc(math.log(0.4), HEADS)]
    chain, ngram = lookup_continuation(tokens, 3)
    tree, arcs = merge_lookup(tree, arcs, chain, ngram, None, 16)
    assert chain == [4, 5, 6] and (1, 2) not in tree.node_paths()
    grafted, grafted_arcs = merge_lookups_after_drafts(tree, arcs, tokens, 2, 3, None, 16)
    paths = grafted.node_paths()
    assert {(4, 5, 6), (1, 2, 3)} <= set(paths)
    assert grafted_arcs[paths.index((1,))].source == HEADS  # the drafted node keeps its own arc
    assert grafted_arcs[paths.index((1, 2))].source == lookup_source(2)  # "0 1" matched
    assert merge_lookups_after_drafts(tree, arcs, tokens, 0, 3, None, 16)[0].node_paths() == tree.node_paths()
