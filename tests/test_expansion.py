"""Best-first tree expansion for heads that read the drafted token (`hf_bpd.drafting.expansion`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_heads, tiny_model

from hf_bpd.drafting import expansion
from hf_bpd.drafting.calibration import HEADS, RESCORER
from hf_bpd.drafting.expansion import chain_lattice, expand_tree
from hf_bpd.drafting.tree import DraftTree

ROOT = 11


@pytest.fixture(scope="module", params=["", "state", "beside"], ids=["independent", "chain-state", "chain-beside"])
def setup(request):
    """ "previous" heads, independent (each reads the base hidden state) or chained (each also reads the
    state of the head before it at the node's parent, in place of the hidden state or beside it)."""
    model = tiny_model("llama", eos_token_id=None)
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.2, chain=request.param).eval()
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    return heads, hidden


def child_logprobs(heads, hidden, branch: tuple[int, ...]) -> torch.Tensor:
    """The log-probabilities over the vocabulary of the children of the node whose branch (root first) is
    `branch`, computed head by head along it: chained heads read each previous head's state."""
    with torch.no_grad():
        state = None
        for depth, token in enumerate(branch):
            state = heads.step(depth, hidden, torch.tensor([token]), state)
        return torch.log_softmax(heads.project(state).float(), dim=-1)[0]


def all_paths(heads, hidden, k: int) -> dict[tuple[int, ...], float]:
    """Brute force: every path of the k-ary expansion and its log-probability."""
    out: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0)]
    for _ in range(heads.num_heads):
        nxt = []
        for path, lp in frontier:
            values, ids = child_logprobs(heads, hidden, (ROOT, *path)).topk(k)
            for v, t in zip(values.tolist(), ids.tolist()):
                out[(*path, t)] = lp + v
                nxt.append(((*path, t), lp + v))
        frontier = nxt
    return out


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40])
def test_expansion_picks_the_most_probable_nodes(setup, monkeypatch, budget):
    heads, hidden = setup
    monkeypatch.setattr(expansion, "round_size", lambda budget: 1)  # one candidate per round: strictly best-first
    tree = DraftTree.root_only(ROOT)
    arcs = expand_tree(tree, heads, hidden, top_k=3, budget=budget)
    assert len(tree) == min(budget, 1 + 3 + 9 + 27) and len(arcs) == len(tree)
    brute = all_paths(heads, hidden, 3)
    got = set(tree.node_paths()[1:])
    best = sorted(brute.values(), reverse=True)[: budget - 1]
    assert sorted((brute[p] for p in got), reverse=True) == pytest.approx(best)
    for i, path in enumerate(tree.node_paths()[1:], start=1):
        assert tree.parents[i] < i and tree.depths[i] == len(path) <= heads.num_heads
        assert arcs[i].source == HEADS
        want = child_logprobs(heads, hidden, (ROOT, *path[:-1]))[path[-1]]
        assert arcs[i].logprob == pytest.approx(float(want), abs=1e-5)  # the node's own head, its own parent


def test_batched_expansion_keeps_parents_first_and_respects_limits(setup):
    heads, hidden = setup
    tree = DraftTree.root_only(ROOT)
    arcs = expand_tree(tree, heads, hidden, top_k=4, budget=30, max_depth=2)
    assert len(tree) == 1 + 4 + 16 == len(arcs)  # depth 2 holds all 4 + 16 candidates, under the budget of 30
    assert max(tree.depths) == 2 and all(tree.parents[i] < i for i in range(1, len(tree)))
    # the root's first child is head 1's top token given the root
    assert tree.tokens[1] == int(child_logprobs(heads, hidden, (ROOT,)).argmax())
    logprobs = tree.path_logprobs(arcs)
    assert logprobs[1] == max(logprobs[1:])


def test_rescorer_estimates_compete_and_merged_drafts_are_not_duplicated(setup):
    heads, hidden = setup
    top = child_logprobs(heads, hidden, (ROOT,)).topk(3).indices.tolist()
    outside = next(t for t in range(60) if t not in top)
    tree = DraftTree.root_only(ROOT)
    tree.add_path((top[1], 7), 10)  # a draft without estimates, merged first
    arcs = expand_tree(tree, heads, hidden, top_k=3, budget=10, estimates={(outside,): 0.0, (outside, 5): -50.0})
    paths = tree.node_paths()
    assert len(set(paths)) == len(paths) == 10 == len(arcs)
    assert (outside,) in paths and arcs[paths.index((outside,))].source == RESCORER  # certain: added early
    assert (outside, 5) not in paths  # hopeless estimate: the heads' nodes win the budget
    assert paths.index((top[1],)) == 1 and arcs[1].source == HEADS and arcs[1].logprob > -math.inf  # reached
    assert paths[2] == (top[1], 7)  # the merged draft keeps its slot; its arc is known once the search reaches it
    reached = 7 in child_logprobs(heads, hidden, (ROOT, top[1])).topk(3).indices.tolist()
    assert (arcs[2].logprob > -math.inf) == reached


@pytest.mark.parametrize("budget", [2, 8, 13, 40])
@pytest.mark.parametrize("max_depth", [None, 2])
def test_growing_a_batch_grows_each_row_s_own_tree(setup, budget, max_depth):
    """Rows grown together in one `grow_on_device` call (a batch's step) make the trees each row grows
    alone: the rows share no candidates, only the head calls."""
    from hf_bpd.drafting.expansion import GrownTree, grow_on_device

    heads, _ = setup
    hidden = torch.randn(3, heads.config.hidden_size, generator=torch.Generator().manual_seed(1))
    roots = [ROOT, 3, 40]
    scales = [0.0, -0.1, -0.3, -0.2]
    together = grow_on_device(heads, hidden, torch.tensor(roots), 4, budget, scales, depth_limit=max_depth)
    rows = GrownTree.rows_on_host(roots, together.flat().tolist())
    assert len(rows) == 3
    for b, (tree, arcs) in enumerate(rows):
        alone = grow_on_device(
            heads, hidden[b : b + 1], torch.tensor(roots[b : b + 1]), 4, budget, scales, depth_limit=max_depth
        )
        want_tree, want_arcs = GrownTree.on_host(roots[b], alone.flat().tolist())
        assert (tree.tokens, tree.parents, tree.depths) == (want_tree.tokens, want_tree.parents, want_tree.depths)
        assert [a.logprob for a in arcs] == pytest.approx([a.logprob for a in want_arcs], abs=1e-5)
    assert len({tuple(tree.tokens) for tree, _ in rows}) == 3  # the rows' trees differ: no row copied another


def test_round_sizes_take_fewer_rounds_for_small_trees():
    assert [expansion.round_size(b) for b in (1, 2, 5, 8, 16, 64)] == [1, 1, 4, 4, 5, 16]


def test_chain_lattice_follows_the_greedy_draft(setup):
    heads, hidden = setup
    lattice = chain_lattice(heads, hidden.expand(2, -1), torch.tensor([ROOT, 3]), top_k=4)
    assert lattice.tokens.shape == lattice.logprobs.shape == (2, 3, 4)
    for b, root in enumerate([ROOT, 3]):
        branch = (root,)
        for depth in range(3):
            values, ids = child_logprobs(heads, hidden, branch).topk(4)
            assert lattice.tokens[b, depth].tolist() == ids.tolist()
            torch.testing.assert_close(lattice.logprobs[b, depth], values)
            branch = (*branch, ids[0].item())


def test_expansion_with_a_draft_vocabulary_maps_token_ids():
    model = tiny_model("llama", eos_token_id=None)
    vocab = torch.arange(10, 60, 2)
    heads = random_heads(model, num_heads=2, token_input="previous", draft_vocab=vocab).eval()
    tree = DraftTree.root_only(ROOT)
    expand_tree(tree, heads, torch.randn(1, model.config.hidden_size), top_k=3, budget=13)
    assert len(tree) == 13 and set(tree.tokens[1:]) <= set(vocab.tolist())


def test_a_large_budget_holds_the_whole_expansion(setup):
    heads, hidden = setup
    tree = DraftTree.root_only(ROOT)
    expand_tree(tree, heads, hidden, top_k=2, budget=100)
    assert len(tree) == 1 + 2 + 4 + 8  # the whole 2-ary expansion of 3 heads
    assert set(tree.node_paths()[1:]) == set(all_paths(heads, hidden, 2))


@pytest.mark.parametrize("budget", [2, 5, 8, 13, 16, 24, 40])
@pytest.mark.parametrize("max_depth", [None, 2, 1])
@pytest.mark.parametrize("scaled", [False, True])
def test_growing_on_the_device_makes_the_host_search_s_tree(setup, budget, max_depth, scaled):
    """`grow_on_device` (every decision a tensor op, one copy at the end) grows exactly the tree and arcs of
    `expand_tree`'s host search: same rounds, same order, same calibration scales, same depth limit."""
    from hf_bpd.drafting.calibration import AcceptanceCalibration, Arc
    from hf_bpd.drafting.expansion import GrownTree, grow_on_device

    heads, hidden = setup
    calibration = None
    if scaled:  # depth-dependent multipliers that reorder depths against each other
        calibration = AcceptanceCalibration()
        for depth, (hits, misses) in {1: (9, 1), 2: (1, 9), 3: (3, 3)}.items():
            for _ in range(hits):
                calibration.observe(Arc(math.log(0.5), HEADS), depth, True)
            for _ in range(misses):
                calibration.observe(Arc(math.log(0.5), HEADS), depth, False)
    host = DraftTree.root_only(ROOT)
    host_arcs = expand_tree(host, heads, hidden, 4, budget, max_depth, calibration=calibration)
    scales = [0.0] + [
        0.0 if calibration is None else math.log(calibration.scale(HEADS, d)) for d in range(1, heads.num_heads + 1)
    ]
    grown = grow_on_device(heads, hidden, torch.tensor([ROOT]), 4, budget, scales, depth_limit=max_depth)
    tree, arcs = GrownTree.on_host(ROOT, grown.flat().tolist())
    assert (tree.tokens, tree.parents, tree.depths) == (host.tokens, host.parents, host.depths)
    assert [a.logprob for a in arcs] == pytest.approx([a.logprob for a in host_arcs], abs=1e-6)
    assert all(a.source == HEADS for a in arcs)
