"""Draft trees: prefix merging, the node budget, lookups, the ancestor mask, and batching with padding."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_bpd import DraftTree
from hf_bpd.drafting.tree import TreeBatch, batch_trees, root_batch


def brute_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_invariants(tree: DraftTree) -> None:
    n = len(tree)
    assert len(tree.tokens) == len(tree.parents) == len(tree.depths) == n
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, n):
        assert 0 <= tree.parents[i] < i
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
        assert tree.child(tree.parents[i], tree.tokens[i]) == i
    # No two children of one node carry the same token.
    pairs = [(tree.parents[i], tree.tokens[i]) for i in range(1, n)]
    assert len(set(pairs)) == len(pairs)


def drafts_in(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path (root excluded)."""
    return {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}


# ---------------------------------------------------------------------------------------------- from_paths


def test_from_paths_merges_shared_prefixes():
    paths = [(1, 2, 3), (1, 2, 4), (1, 5), (6,), (1, 2, 3)]
    tree = DraftTree.from_paths(9, paths, max_nodes=100)
    # root, 1, 1-2, 1-2-3, 1-2-4, 1-5, 6 -> 7 nodes (the repeated path adds nothing).
    assert len(tree) == 7
    assert tree.tokens == [9, 1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 2, 2, 1, 0]
    assert tree.depths == [0, 1, 2, 3, 3, 2, 1]
    assert drafts_in(tree) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 5), (6,)}
    check_invariants(tree)


def test_from_paths_no_paths_is_root_only():
    tree = DraftTree.from_paths(4, [], max_nodes=10)
    assert tree.tokens == [4] and tree.parents == [-1] and tree.depths == [0]
    assert len(tree) == 1
    assert tree.ancestor_mask().tolist() == [[True]]


def test_from_paths_same_token_under_different_parents_is_not_merged():
    tree = DraftTree.from_paths(0, [(1, 7), (2, 7), (7,)], max_nodes=100)
    assert len(tree) == 6
    assert tree.tokens.count(7) == 3
    check_invariants(tree)


def test_from_paths_truncates_at_max_nodes():
    paths = [(1, 2, 3), (4, 5, 6), (7,)]
    tree = DraftTree.from_paths(0, paths, max_nodes=5)
    # root + 1,2,3 (4 nodes) + 4 = 5: the second path is truncated to its first token, the third dropped.
    assert len(tree) == 5
    assert tree.tokens == [0, 1, 2, 3, 4]
    assert tree.parents == [-1, 0, 1, 2, 0]
    assert drafts_in(tree) == {(1,), (1, 2), (1, 2, 3), (4,)}
    check_invariants(tree)


def test_from_paths_truncation_still_follows_existing_nodes():
    # A full tree: a path sharing (1, 2) walks the existing nodes but must not add its new suffix.
    tree = DraftTree.from_paths(0, [(1, 2), (3,)], max_nodes=4)
    assert tree.tokens == [0, 1, 2, 3]
    tree.add_path([1, 2, 8], max_nodes=4)
    tree.add_path([3, 9], max_nodes=4)
    assert tree.tokens == [0, 1, 2, 3]
    # One more node allowed: the shared prefix is reused, only the first new token is added.
    tree.add_path([1, 2, 8, 9], max_nodes=5)
    assert tree.tokens == [0, 1, 2, 3, 8]
    assert tree.parents == [-1, 0, 1, 0, 2]
    check_invariants(tree)


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5, 8, 13, 40])
def test_from_paths_never_exceeds_max_nodes(max_nodes):
    rng = random.Random(max_nodes)
    paths = [tuple(rng.randrange(3) for _ in range(rng.randint(1, 4))) for _ in range(30)]
    tree = DraftTree.from_paths(0, paths, max_nodes=max_nodes)
    unlimited = DraftTree.from_paths(0, paths, max_nodes=10**6)
    assert len(tree) == min(max_nodes, len(unlimited))
    check_invariants(tree)
    # The budgeted tree is the first nodes of the unlimited one (same insertion order).
    assert tree.tokens == unlimited.tokens[: len(tree)]
    assert tree.parents == unlimited.parents[: len(tree)]
    assert drafts_in(tree) <= drafts_in(unlimited)


def test_max_nodes_one_is_root_only():
    tree = DraftTree.from_paths(3, [(1, 2)], max_nodes=1)
    assert tree.tokens == [3]


@pytest.mark.parametrize("max_nodes", [0, -1])
def test_max_nodes_below_one_raises(max_nodes):
    with pytest.raises(ValueError, match="max_nodes"):
        DraftTree.from_paths(0, [(1,)], max_nodes=max_nodes)


def test_add_path_respects_budget():
    tree = DraftTree.root_only(0)
    tree.add_path([1, 2, 3], max_nodes=3)
    assert tree.tokens == [0, 1, 2]
    tree.add_path([1, 2, 3], max_nodes=3)
    assert len(tree) == 3
    tree.add_path([1, 2, 3], max_nodes=4)
    assert tree.tokens == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- lookups


def test_child_lookup():
    tree = DraftTree.from_paths(9, [(1, 2), (1, 3), (4,)], max_nodes=100)
    assert tree.child(0, 1) == 1
    assert tree.child(1, 2) == 2
    assert tree.child(1, 3) == 3
    assert tree.child(0, 4) == 4
    assert tree.child(0, 2) is None  # 2 exists, but under node 1
    assert tree.child(2, 2) is None
    assert tree.child(4, 1) is None
    assert tree.child(0, 9) is None  # the root token is not its own child


def test_depths_and_path_to():
    tree = DraftTree.from_paths(0, [(1, 2, 3), (1, 4), (5, 6)], max_nodes=100)
    # nodes: 0 root, 1:1, 2:2, 3:3, 4:4 (under 1), 5:5, 6:6 (under 5)
    assert tree.depths == [0, 1, 2, 3, 2, 1, 2]
    assert tree.path_to(0) == [0]
    assert tree.path_to(3) == [0, 1, 2, 3]
    assert tree.path_to(4) == [0, 1, 4]
    assert tree.path_to(6) == [0, 5, 6]
    for i in range(len(tree)):
        assert len(tree.path_to(i)) == tree.depths[i] + 1
        assert tree.path_to(i)[-1] == i


# ---------------------------------------------------------------------------------------------- ancestor mask


def test_ancestor_mask_hand_built():
    tree = DraftTree.from_paths(0, [(1, 2), (3,)], max_nodes=100)
    assert tree.ancestor_mask().tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, True],
    ]


@pytest.mark.parametrize("seed", range(6))
def test_ancestor_mask_matches_brute_force(seed):
    rng = random.Random(seed)
    paths = [tuple(rng.randrange(4) for _ in range(rng.randint(1, 5))) for _ in range(20)]
    tree = DraftTree.from_paths(0, paths, max_nodes=rng.randint(1, 30))
    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool
    assert mask.shape == (len(tree), len(tree))
    assert torch.equal(mask, brute_ancestors(tree.parents))
    # Lower-triangular (parents precede children), diagonal set, row i has depth+1 entries.
    assert torch.equal(mask, mask.tril())
    assert mask.diagonal().all()
    assert mask.sum(1).tolist() == [d + 1 for d in tree.depths]
    for i in range(len(tree)):
        assert mask[i].nonzero().flatten().tolist() == tree.path_to(i)


# ---------------------------------------------------------------------------------------------- batch_trees


def test_batch_trees_pads_smaller_trees():
    big = DraftTree.from_paths(5, [(1, 2), (3,), (1, 4)], max_nodes=100)  # 5 nodes
    small = DraftTree.from_paths(6, [(7,)], max_nodes=100)  # 2 nodes
    single = DraftTree.root_only(8)  # 1 node
    batch = batch_trees([small, big, single], pad_token_id=0, device=torch.device("cpu"))
    assert isinstance(batch, TreeBatch)
    assert batch.sizes == [2, 5, 1]
    assert batch.input_ids.shape == batch.depths.shape == (3, 5)
    assert batch.tree_mask.shape == (3, 5, 5)
    assert batch.input_ids.dtype == batch.depths.dtype == torch.long
    assert batch.tree_mask.dtype == torch.bool

    assert batch.input_ids.tolist() == [[6, 7, 0, 0, 0], big.tokens, [8, 0, 0, 0, 0]]
    assert batch.depths.tolist() == [[0, 1, 0, 0, 0], big.depths, [0, 0, 0, 0, 0]]

    for b, tree in enumerate([small, big, single]):
        m = len(tree)
        mask = batch.tree_mask[b]
        assert torch.equal(mask[:m, :m], tree.ancestor_mask())
        # Padding rows attend only to themselves; nobody else attends to a padding column.
        for i in range(m, 5):
            assert mask[i].nonzero().flatten().tolist() == [i]
            assert mask[:, i].nonzero().flatten().tolist() == [i]
        # Real rows never see padding.
        assert not mask[:m, m:].any()


def test_batch_trees_pad_token_and_equal_sizes():
    a = DraftTree.from_paths(1, [(2, 3)], max_nodes=100)
    b = DraftTree.from_paths(4, [(5,), (6,)], max_nodes=100)
    batch = batch_trees([a, b], pad_token_id=42, device=torch.device("cpu"))
    assert batch.sizes == [3, 3]
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 6]]  # no padding needed, 42 never appears
    assert batch.depths.tolist() == [[0, 1, 2], [0, 1, 1]]
    assert torch.equal(batch.tree_mask[0], a.ancestor_mask())
    assert torch.equal(batch.tree_mask[1], b.ancestor_mask())

    padded = batch_trees([DraftTree.root_only(1), a], pad_token_id=42, device=torch.device("cpu"))
    assert padded.input_ids.tolist() == [[1, 42, 42], [1, 2, 3]]


def test_tensor_tokens_merge_like_ints():
    tree = DraftTree.from_paths(0, [torch.tensor([1, 2]), torch.tensor([1, 2]), (1, 3)], 100)
    assert tree.tokens == [0, 1, 2, 3] and tree.parents == [-1, 0, 1, 1]


def test_root_batch_equals_the_batch_of_root_only_trees():
    roots = [5, 0, 17]
    fast = root_batch(roots, torch.device("cpu"))
    slow = batch_trees([DraftTree.root_only(r) for r in roots], pad_token_id=0, device=torch.device("cpu"))
    for name in ("input_ids", "depths", "tree_mask"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.sizes == slow.sizes == [1, 1, 1]


def test_by_path_probability_puts_every_node_after_its_parent_and_the_likeliest_first():
    from hf_bpd.drafting.calibration import HEADS, Arc

    # grown in rounds: the root's three children first (one of them weak), then the strong child's child
    tree = DraftTree.root_only(1)
    for path in ((10,), (11,), (12,), (10, 20)):
        tree.add_path(path, 8)
    arcs = [Arc(0.0, HEADS), Arc(math.log(0.8), HEADS), Arc(math.log(0.1), HEADS), Arc(math.log(0.05), HEADS)]
    arcs.append(Arc(math.log(0.9), HEADS))  # 0.8 * 0.9 = 0.72 on its path
    ordered, ordered_arcs = tree.by_path_probability(arcs)
    assert ordered.tokens == [1, 10, 20, 11, 12] and ordered.parents == [-1, 0, 1, 0, 0]
    assert ordered_arcs == [arcs[0], arcs[1], arcs[4], arcs[2], arcs[3]]
    logprobs = ordered.path_logprobs(ordered_arcs)
    assert logprobs == sorted(logprobs, reverse=True)
    cut, cut_arcs = tree.by_path_probability(arcs, max_nodes=3)
    assert cut.tokens == [1, 10, 20] and len(cut_arcs) == 3
    same, _ = ordered.by_path_probability(ordered_arcs)
    assert same is ordered  # already in order: the tree as it is


def test_a_drafted_tree_grown_in_rounds_is_ordered_by_path_probability_so_its_prefixes_are_its_best_subtrees():
    from conftest import random_heads, tiny_model

    import hf_bpd
    from hf_bpd import BlockDrafter

    model = tiny_model("llama", eos_token_id=None)
    # heads that read the drafted token grow 12 nodes in rounds of 6: the first round takes six of the
    # root's eight children, weak ones too, before any grandchild is known
    drafter = BlockDrafter(random_heads(model, std=1.0, token_input="previous"), top_k=8, max_tree_tokens=12)
    hf_bpd.prepare(drafter, model)
    ids = torch.tensor([[5, 6, 7, 8]])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, -1]
    (tree,) = drafter.draft(hidden, ids)
    ((verified, arcs),) = drafter._verified
    assert verified.tokens == tree.tokens and len(tree) == 12
    logprobs = tree.path_logprobs(arcs, drafter.calibration)
    assert logprobs == sorted(logprobs, reverse=True)
    assert max(tree.depths[:6]) > 1  # a grandchild ahead of the root's weaker children


def test_a_looked_up_chain_kept_in_a_sized_tree_does_not_raise_the_heads_next_growth():
    from hf_bpd.drafting.assembly import growth_budget, size_trees
    from hf_bpd.drafting.calibration import HEADS, Arc

    tree = DraftTree.root_only(1)
    chain = [10, 11, 12, 13, 14, 15, 16, 17, 18]  # a looked-up chain the model is likely to repeat
    tree.add_path(chain, 64)
    tree.add_path([20], 64)  # two of the heads' children of the root
    tree.add_path([21], 64)
    arcs = [Arc(0.0, HEADS)] + [Arc(math.log(0.95), "lookup3")] * len(chain) + [Arc(math.log(0.3), HEADS)] * 2
    (sized,), grown = size_trees([tree], [arcs], None, lambda n: 1.0)  # a flat cost keeps every node
    assert len(sized) == 12
    assert grown == [3]  # the root and the heads' two nodes: what the next growth should supply
    assert growth_budget(64, grown, True) == 8  # the floor, where the whole tree's 12 nodes would ask for 18
    assert growth_budget(64, [len(sized)], True) == 18
    assert growth_budget(64, [], True) == 64 and growth_budget(64, grown, False) == 64
