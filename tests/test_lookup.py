"""Context lookup: the continuation after the context's last n-gram, merged into the tree by probability."""

import math

import numpy as np
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.drafting.calibration import HEADS, AcceptanceCalibration, Arc
from hf_bpd.drafting.lookup import lookup_continuation, lookup_source, merge_lookup
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
