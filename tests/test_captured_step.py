"""The captured decode step (`hf_bpd/decode/captured.py`, issue #58): greedy steps on a static cache as one
device function over a fixed tree topology per bucket. The same tokens as plain static-cache `generate`
(random, oracle and the shipped heads); no host wait inside a step and one read per step; compiled with
`fullgraph=True`, one graph per bucket and none for a second prompt; refusals before any forward."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import random_heads, spec_bench_prompts, tiny_model

import hf_bpd
import hf_bpd.decode.captured as captured
import hf_bpd.decode.row as row
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.compat import GENERATE_CACHE_FIELD
from hf_bpd.decode.captured import Topology, TreeBucket, draft_tokens, rank_acceptance
from hf_bpd.decode.syncs import StepSyncCounter
from hf_bpd.drafting.calibration import GREEDY
from hf_bpd.drafting.corpus import CorpusIndex
from hf_bpd.io.models import chat_inputs

PROMPTS = ([[5, 6, 7]], [[9, 3, 4, 8, 11, 12]], [[40, 41, 40, 41, 40]])


def static_generate(model, ids, drafter=None, **kw):
    if drafter is not None:
        kw.update(custom_generate=hf_bpd.generate, assistant=drafter)
    return model.generate(ids, cache_implementation="static", do_sample=False, **kw)


def heads_of(model, kind: str):
    if kind == "copying":  # plain heads repeating the base model's guess: drafts accepted on repetitive text
        return BlockDraftHeads.for_base_model(model, num_heads=4)
    if kind.startswith("chain-"):  # "previous" heads, each reading the state of the head before it
        return random_heads(model, num_heads=4, token_input="previous", std=0.05, chain=kind[6:])
    return random_heads(model, num_heads=4, token_input=kind, std=0.05)


# ------------------------------------------------------------------------------------------ topology
def test_best_first_topology_is_a_tree_of_the_most_probable_paths_and_every_prefix_is_one():
    top = Topology.best_first(16, depth=4, top_k=3)
    assert len(top) == 16 and top.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(top.parents[1:], 1))
    assert max(top.depths) <= 4 and max(top.ranks) < 3
    assert top.paths()[1:4] == [(0,), (0, 0), (1,)]  # the prior: the top-1 chain, then rank 1 at depth 1
    assert Topology.from_paths(top.paths()[1:]) == top
    for n in (1, 2, 5, 16):
        prefix = top.prefix(n)
        assert len(prefix) == n and prefix.parents == top.parents[:n]


def test_a_topology_built_from_measured_rank_acceptance_is_the_one_decoded_with():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=8)
    hf_bpd.prepare(drafter, model)
    answers = [(len(p[0]), static_generate(model, torch.tensor(p), max_new_tokens=20)[0]) for p in PROMPTS]
    table = rank_acceptance(model, drafter.heads, answers, top_k=3)
    assert len(table) == 4 and all(len(r) == 3 and min(r) >= 0 and sum(r) <= 1 + 1e-9 for r in table)
    top = Topology.best_first(8, 4, 3, [[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]])
    assert top.paths()[1:3] == [(0,), (0, 1)]  # the measured table, not the prior, orders it
    drafter.captured_topology = top
    ids = torch.tensor(PROMPTS[0])
    ref = static_generate(model, ids, max_new_tokens=20)
    assert static_generate(model, ids, drafter, max_new_tokens=20, captured_step=True).tolist() == ref.tolist()
    decoders = captured._DECODERS[model].values()
    assert any(b.topology == top for d in decoders for b in d.buckets.values())


def test_topologies_that_are_not_trees_are_refused():
    with pytest.raises(ValueError, match="root"):
        Topology((0, 0), (0, 0))
    with pytest.raises(ValueError, match="precede"):
        Topology((-1, 2, 0), (0, 0, 1))
    with pytest.raises(ValueError, match="share"):
        Topology((-1, 0, 0), (0, 1, 1))


@pytest.mark.parametrize("chain", ["", "state", "beside"])
def test_device_tree_takes_each_node_s_rank_of_its_head_applied_to_its_parent_s_token(chain):
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=3, token_input="previous", chain=chain).bind(model)
    top = Topology.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    bucket = TreeBucket(top, "previous", torch.device("cpu"), capacity=32)
    hidden, root = torch.randn(1, 32), torch.tensor([7])
    tokens = draft_tokens(heads, bucket, hidden, root).tolist()
    with torch.no_grad():
        for i in range(1, len(top)):
            branch, j = [], top.parents[i]  # the parent's branch, root first
            while j >= 0:
                branch.insert(0, j)
                j = top.parents[j]
            state = None
            for depth, node in enumerate(branch):  # chained heads read the state of the head before them
                state = heads.step(depth, hidden, torch.tensor([tokens[node]]), state)
            ids, _ = heads.top_tokens(state, 3)
            assert tokens[i] == ids[0, top.ranks[i]].item(), i


# ---------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kind", ["previous", "next", "copying", "chain-state", "chain-beside"])
def test_captured_greedy_gives_plain_static_generate_s_tokens_with_one_host_read_per_step(kind):
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, kind), top_k=3, max_tree_tokens=12)
    drafter.count_host_syncs = True
    for ids in PROMPTS:
        ids = torch.tensor(ids)
        for max_new in (1, 40):
            ref = static_generate(model, ids, max_new_tokens=max_new)
            out = static_generate(model, ids, drafter, max_new_tokens=max_new, captured_step=True)
            assert out.tolist() == ref.tolist()
            assert drafter.stats.new_tokens == max_new
            syncs = drafter.stats.host_syncs
            assert syncs.get("step", 0) == 0, syncs  # nothing inside a step waits for the device
            assert syncs.get("read", 0) == drafter.stats.steps, syncs  # one read per step
    learned = drafter.calibration.summary()  # what the steps learned on the device, kept by the drafter
    assert (len(learned) > 0) == (kind not in ("next", "copying")), (
        learned
    )  # grown trees only: a fixed one has no estimates


def test_walks_through_any_rank_are_compacted_and_give_plain_static_generate_s_tokens(monkeypatch):
    # drafts that know the answer: at depth d the right token sits at rank (length + d) % 2 (the other ranks
    # are wrong), so walks end at varied depths and pass through rank-1 nodes, whose keys and values
    # compaction must move; pure device indexing, as the heads' top-k is
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=16)
    drafter.captured_topology = Topology.best_first(16, 4, 3)  # "previous" heads would grow their trees
    seen = {}
    real_run = captured.CapturedDecoder.run

    def run(self, model_, bucket, cache):
        seen["cache"] = cache
        return real_run(self, model_, bucket, cache)

    def knowing(heads, bucket, hidden, root):
        length = seen["cache"].layers[0].cumulative_length
        at = length + bucket.depths  # each node's position
        right = seen["truth"].index_select(0, at)
        good = (bucket.ranks == at % 2) | (bucket.depths == 0)
        return torch.where(good, right, (right + 1 + bucket.ranks) % model.config.vocab_size)

    monkeypatch.setattr(captured.CapturedDecoder, "run", run)
    monkeypatch.setattr(captured.BucketChooser, "choose", lambda self, fits: max(fits))  # the deepest trees
    monkeypatch.setattr(captured, "draft_tokens", knowing)
    for ahead in (False, True):  # one step in flight (a CPU), or two (an accelerator: the host one step behind)
        monkeypatch.setattr(row, "decode_captured", functools.partial(captured.decode_captured, ahead=ahead))
        for ids in PROMPTS[:2]:
            ids = torch.tensor(ids)
            ref = static_generate(model, ids, max_new_tokens=40)
            seen["truth"] = torch.cat([ref[0], ref.new_zeros(64)])  # room for drafts past the end
            out = static_generate(
                model, ids, drafter, max_new_tokens=40, captured_step=True, return_dict_in_generate=True
            )
            assert out.sequences.tolist() == ref.tolist()
            lengths = drafter.stats.accepted_lengths
            assert max(lengths) >= 4 and len(set(lengths)) >= 3, lengths  # deep and varied walks
            cache = getattr(out, GENERATE_CACHE_FIELD)
            assert cache.get_seq_length() == ref.shape[1] - 1  # as `generate` leaves it, steps in flight dropped


@pytest.mark.parametrize("chain", ["", "state", "beside"])
def test_grown_tree_on_the_device_is_the_tree_the_eager_drafter_grows(chain):
    from hf_bpd.drafting.expansion import GrownTree

    model = tiny_model("llama")
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.3, chain=chain)
    drafter = BlockDrafter(heads, top_k=3)
    hf_bpd.prepare(drafter, model)
    heads = drafter.heads
    for n in (1, 2, 8, 16):
        bucket = TreeBucket(None, "previous", torch.device("cpu"), 32, size=n, max_depth=min(3, n - 1), top_k=3)
        state = captured.CapturedState.empty(32, 3, 40, "cpu", torch.float32)
        state.load(torch.tensor([7]), torch.randn(1, 32), 99, drafter.calibration)
        tree = captured.grown_tree(heads, bucket, state, torch.tensor(3))
        eager, _ = GrownTree.on_host(7, drafter.grow(state.hidden, state.root, budget=n).flat().tolist())
        kept = tree.drafted.nonzero().flatten().tolist()
        assert [tree.tokens[i].item() for i in kept] == eager.tokens
        assert [kept.index(tree.parents[i].item()) for i in kept[1:]] == eager.parents[1:]
        for i in kept:  # depths and ancestors: the parents' chain
            chain, j = {i}, i
            while j:
                j = tree.parents[j].item()
                chain.add(j)
            assert tree.depths[i].item() == len(chain) - 1
            assert set(tree.ancestors[i].nonzero().flatten().tolist()) == chain


def test_grown_tree_with_the_context_lookup_chain_keeps_the_nodes_the_eager_merge_keeps():
    from hf_bpd.drafting.expansion import GrownTree
    from hf_bpd.drafting.lookup import lookup_continuation, merge_lookup

    def paths(tokens, parents, kept):  # each kept node's token path from the root
        out = set()
        for i in kept:
            path, j = [], i
            while j:
                path.append(tokens[j])
                j = parents[j]
            out.add(tuple(reversed(path)))
        return out

    model = tiny_model("llama")
    drafter = BlockDrafter(random_heads(model, num_heads=3, token_input="previous", std=0.3), top_k=3)
    hf_bpd.prepare(drafter, model)
    g = torch.Generator().manual_seed(0)
    chained = 0
    for trial in range(18):
        n, chain = (8, 16)[trial % 2], 5
        context = torch.randint(0, 50, (20,), generator=g)
        context[-3:] = context[4:7] if trial % 3 or trial >= 12 else context[-3:]  # a repeated trigram, or not
        hidden = torch.randn(1, 32, generator=g)
        if trial >= 12:  # the chain starts with the heads' own first one or two tokens: merged into their nodes
            eager, _ = GrownTree.on_host(int(context[-1]), drafter.grow(hidden, context[-1:], budget=n).flat().tolist())
            first = eager.parents.index(0, 1)  # the most probable child of the root, then its own
            second = eager.parents.index(first, first + 1) if first in eager.parents[first + 1 :] else None
            context[7] = eager.tokens[first]
            context[8] = eager.tokens[second] if second is not None and trial % 2 else 49
        bucket = TreeBucket(None, "previous", torch.device("cpu"), 64, size=n, max_depth=3, top_k=3, lookup=chain)
        calibration = drafter.calibration  # evidence of every source and depth, different each trial
        for source in captured.CALIBRATION_SOURCES:
            for d in range(1, calibration.max_depth + 1):
                predicted = 20 * float(torch.rand((), generator=g))
                calibration.predicted[(GREEDY, source, d)] = predicted
                calibration.accepted[(GREEDY, source, d)] = predicted * 1.5 * float(torch.rand((), generator=g))
        state = captured.CapturedState.empty(32, chain, 40, "cpu", torch.float32)
        state.load(context, hidden, 99, drafter.calibration)
        tree = captured.grown_tree(drafter.heads, bucket, state, torch.tensor(19))
        kept = tree.drafted.nonzero().flatten().tolist()
        eager, arcs = GrownTree.on_host(
            int(context[-1]), drafter.grow(state.hidden, state.root, budget=n).flat().tolist()
        )
        tokens, ngram = lookup_continuation(context.numpy(), chain)
        merged, _ = merge_lookup(eager, arcs, tokens, ngram, drafter.calibration, n)
        expected = paths(merged.tokens, merged.parents, range(len(merged)))
        assert paths(tree.tokens.tolist(), tree.parents.tolist(), kept) == expected, trial
        assert len(kept) == len(merged), trial  # no node spent on a second copy of a merged token
        chained += any(len(p) > 3 for p in expected)  # deeper than the heads reach: a chain's nodes
    assert chained >= 4


def test_the_step_s_calibration_learns_from_each_walk_what_the_host_calibration_learns():
    from hf_bpd.drafting.calibration import AcceptanceCalibration, Arc

    g = torch.Generator().manual_seed(1)
    sources, deepest, n = captured.CALIBRATION_SOURCES, 6, 12
    host = AcceptanceCalibration()
    host.observe(Arc(-0.3, sources[2]), 2, True)  # earlier evidence, which the call starts from
    state = captured.CapturedState.empty(8, deepest, 16, "cpu", torch.float32)
    state.load(torch.tensor([1, 2]), torch.zeros(1, 8), 99, host)
    for _ in range(30):
        parents, depths = [0], [0]
        for i in range(1, n):
            parent = int(torch.randint(0, i, (), generator=g))
            parent = parent if depths[parent] < deepest else 0
            parents.append(parent)
            depths.append(depths[parent] + 1)
        parents, depths = torch.tensor(parents), torch.tensor(depths)
        ancestors = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            ancestors[i] |= ancestors[parents[i]]
        raw = torch.rand(n, generator=g).log()
        source = torch.randint(0, len(sources), (n,), generator=g)
        compared = torch.rand(n, generator=g) > 0.2
        compared[0] = False  # the root is never an arc
        on_walk = ancestors[int(torch.randint(0, n, (), generator=g))]
        tree = captured.DeviceTree(torch.zeros(n, dtype=torch.long), depths, parents, ancestors, compared, raw, source)
        captured.observe_walk(state, tree, on_walk, compared)
        for i in range(1, n):
            if compared[i] and on_walk[parents[i]]:
                host.observe(Arc(float(raw[i]), sources[source[i]]), int(depths[i]), bool(on_walk[i]))
    torch.testing.assert_close(state.calibration, host.count_table(sources, deepest + 1))
    expected = [[math.log(host.scale(s, d)) for d in range(deepest + 1)] for s in sources]
    torch.testing.assert_close(captured.calibrated_log_scales(state), torch.tensor(expected))
    back = AcceptanceCalibration()
    state.save(back)
    assert back.summary() == pytest.approx(host.summary())


def test_grown_trees_with_deep_walks_and_dropped_nodes_give_plain_static_generate_s_tokens(monkeypatch):
    # a search that knows the answer: its nodes alternate a wrong and a right child of the last right node,
    # the right chain cut at a depth that varies with the position, the wrong nodes sometimes dropped
    # (-inf) and the tree sometimes short of its size (pads): walks of varied depth through nodes whose
    # index is not their depth's, which compaction must move
    from hf_bpd.drafting.expansion import GrownTree

    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=16)
    seen = {}
    real_run = captured.CapturedDecoder.run

    def run(self, model_, bucket, cache):
        seen["cache"] = cache
        return real_run(self, model_, bucket, cache)

    def knowing(heads, hidden, root, top_k, budget, log_scales, warp=None, depth_limit=None):
        length = seen["cache"].layers[0].cumulative_length
        depth = (length % 5).clamp_max(depth_limit)  # the right chain's depth
        truth = seen["truth"]
        tokens, parents, logprobs, right = [], [], [], torch.zeros((), dtype=torch.long)
        for d in range(1, depth_limit + 1):
            if 2 * d > budget - 2:
                break
            good = truth.index_select(0, (length + d).view(1))[0]
            tokens += [(good + 1) % model.config.vocab_size, torch.where(d <= depth, good, (good + 2) % 97)]
            parents += [right, right]
            logprobs += [torch.tensor(-math.inf if d % 2 else -1.0), torch.tensor(-0.5)]
            right = torch.tensor(len(tokens))
        if not tokens:
            empty = torch.zeros(1, 0)
            return GrownTree(empty.long(), empty.long(), empty)
        return GrownTree(torch.stack(tokens)[None], torch.stack(parents)[None], torch.stack(logprobs)[None])

    monkeypatch.setattr(captured.CapturedDecoder, "run", run)
    monkeypatch.setattr(captured.BucketChooser, "choose", lambda self, fits: max(fits))  # the deepest trees
    monkeypatch.setattr(captured, "grow_on_device", knowing)
    for ahead in (False, True):
        monkeypatch.setattr(row, "decode_captured", functools.partial(captured.decode_captured, ahead=ahead))
        for ids in PROMPTS[:2]:
            ids = torch.tensor(ids)
            ref = static_generate(model, ids, max_new_tokens=40)
            seen["truth"] = torch.cat([ref[0], ref.new_zeros(64)])
            out = static_generate(
                model, ids, drafter, max_new_tokens=40, captured_step=True, return_dict_in_generate=True
            )
            assert out.sequences.tolist() == ref.tolist()
            lengths = drafter.stats.accepted_lengths
            assert max(lengths) >= 4 and len(set(lengths)) >= 3, lengths
            assert getattr(out, GENERATE_CACHE_FIELD).get_seq_length() == ref.shape[1] - 1


def test_the_bucket_chooser_tries_every_size_then_takes_the_most_tokens_per_second_and_revisits():
    chooser = captured.BucketChooser(rate=1.0, revisit=5)
    fits = [1, 4, 8]
    assert chooser.choose(fits) == 8
    chooser.observe(8, {1: 1, 4: 2, 8: 3}, 0.30)  # 10 tokens/s
    assert chooser.choose(fits) == 4  # untried, though its tokens are known
    chooser.observe(4, {1: 1, 4: 2}, 0.10)  # 20 tokens/s
    assert chooser.choose(fits) == 1
    chooser.observe(1, {1: 1}, 0.08)  # 12.5 tokens/s
    assert [chooser.choose(fits) for _ in range(1)] == [4]
    for _ in range(5):
        chooser.observe(4, {1: 1, 4: 2}, 0.10)
    assert chooser.choose(fits) == 8  # not chosen for more than 5 steps: tried again
    chooser.observe(8, {1: 1, 4: 2, 8: 3}, 0.12)  # the load is gone: 25 tokens/s
    assert chooser.choose(fits) == 1  # as stale
    chooser.observe(1, {1: 1}, 0.08)
    assert chooser.choose(fits) == 8 and chooser.choose([1, 4]) == 4  # of what fits the cache's room


@pytest.mark.parametrize(
    "seconds, sizes",
    [((1.0, 1.1, 1.2, 1.4, 1.8, 2.6, 4.0), (1, 2, 4, 8, 16)), ((1.0,) * 7, (1, 2, 4, 8, 16, 32, 64))],
)
def test_buckets_are_the_tree_sizes_the_forward_cost_curve_can_pay_for(seconds, sizes):
    from hf_bpd.decode.cost import ForwardCost

    model = tiny_model("llama", eos_token_id=None)
    curve = ForwardCost((1, 2, 4, 8, 16, 32, 64), seconds)  # a CPU's steep curve, a GPU's flat one
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens="auto", forward_cost=curve)
    ids = torch.tensor(PROMPTS[0])
    ref = static_generate(model, ids, max_new_tokens=12)
    assert static_generate(model, ids, drafter, max_new_tokens=12, captured_step=True).tolist() == ref.tolist()
    decoder = next(d for d in captured._DECODERS[model].values() if isinstance(d, captured.CapturedDecoder))
    assert tuple(decoder.buckets) == sizes


def test_eos_inside_an_accepted_walk_stops_there_with_steps_in_flight(monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7]])
    long = static_generate(model, ids, max_new_tokens=30)[0, 3:].tolist()
    eos = next(t for i, t in enumerate(long) if i >= 5 and t not in long[:i])  # first met mid-answer
    drafter = BlockDrafter(heads_of(model, "copying"), top_k=3, max_tree_tokens=8)
    monkeypatch.setattr(row, "decode_captured", functools.partial(captured.decode_captured, ahead=True))
    ref = static_generate(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    out = static_generate(model, ids, drafter, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, captured_step=True)
    assert out.tolist() == ref.tolist() and out[0, -1].item() == eos


# ---------------------------------------------------------------------------------------- compiled
def test_the_step_compiles_to_one_graph_per_bucket_and_a_second_prompt_compiles_nothing():
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):  # a torch.compile backend: called once per graph
        graphs.append(gm)
        return gm.forward

    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=8, packed_linear=False)
    sizes = []
    for ids in PROMPTS[:2]:  # another prompt length, the same cache capacity (max_length)
        ids = torch.tensor(ids)
        ref = static_generate(model, ids, max_length=40)
        before = len(graphs)
        out = static_generate(model, ids, drafter, max_length=40, captured_step=counting)
        assert out.tolist() == ref.tolist()
        sizes.append(set(drafter.stats.tree_sizes))
        decoder = next(d for d in captured._DECODERS[model].values() if isinstance(d, captured.CapturedDecoder))
        if not sizes[:-1]:  # one graph per bucket (fullgraph: no break), all compiled before the first step
            assert len(graphs) - before == len(decoder.buckets) > 1 and drafter.stats.time_warm_up > 0
            assert sizes[0] <= set(decoder.buckets)
        else:
            assert len(graphs) == before and drafter.stats.time_warm_up == 0  # nothing recompiled


@pytest.mark.parametrize(
    "backend, kind, prompt, new",
    [("aot_eager", "copying", 2, 24), pytest.param("inductor", "previous", 1, 20, marks=pytest.mark.slow)],
)
def test_the_compiled_step_gives_the_same_tokens(backend, kind, prompt, new):
    """aot_eager traces what inductor compiles (fast); inductor itself, on a CPU, is slow to compile."""
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, kind), top_k=3, max_tree_tokens=4, packed_linear=False)
    ids = torch.tensor(PROMPTS[prompt])
    assert static_generate(model, ids, drafter, max_new_tokens=new, captured_step=backend).tolist() == (
        static_generate(model, ids, max_new_tokens=new).tolist()
    )


# ---------------------------------------------------------------------------------------- host waits
def test_the_step_counter_counts_host_reads_host_made_tensors_and_blocking_copies():
    counter = StepSyncCounter()
    t = torch.arange(4)
    with counter.phase("step"):
        t.tolist(), t.sum().item()  # reads
        torch.tensor([1, 2]), torch.as_tensor([3]), t.new_tensor([4])  # tensors from host values
        torch.as_tensor(t), t.new_zeros(2), t + 1, t.to(torch.float32), t.to("cpu")  # none of these
    assert counter.counts == {"step": 5}, counter.calls


def test_an_uncompiled_step_waits_for_nothing_on_the_host():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=12)
    drafter.count_host_syncs = True
    static_generate(model, torch.tensor(PROMPTS[0]), drafter, max_new_tokens=30, captured_step=True)
    counts = drafter.stats.host_syncs
    assert drafter.stats.steps > 5 and counts.get("step", 0) == 0 and counts["read"] == drafter.stats.steps
    per_step = drafter.stats.host_syncs_per_step()
    assert sum(v for k, v in per_step.items() if k != "prefill") <= 1


# ---------------------------------------------------------------------------------------- refusals
def test_calls_the_captured_step_cannot_serve_are_refused_before_any_forward_or_left_to_the_static_path(monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=8)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.tensor([[5, 6, 7]])
    gen = dict(custom_generate=hf_bpd.generate, assistant=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="greedy"):
        model.generate(ids, cache_implementation="static", do_sample=True, captured_step=True, **gen)
    with pytest.raises(ValueError, match="static cache"):
        model.generate(ids, do_sample=False, captured_step=True, **gen)
    with pytest.raises(ValueError, match="batch"):
        model.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), do_sample=False, captured_step=True, **gen)
    with pytest.raises(ValueError, match="scores"):
        model.generate(
            ids,
            cache_implementation="static",
            do_sample=False,
            captured_step=True,
            return_dict_in_generate=True,
            output_scores=True,
            **gen,
        )
    with pytest.raises(ValueError, match="captured_step takes"):
        model.generate(ids, cache_implementation="static", do_sample=False, captured_step=3, **gen)
    with_corpus = BlockDrafter(drafter.heads, top_k=3, max_tree_tokens=8, corpus=CorpusIndex.from_answers([[5, 6]]))
    with pytest.raises(ValueError, match="corpus"):
        model.generate(
            ids, cache_implementation="static", do_sample=False, captured_step=True, **{**gen, "assistant": with_corpus}
        )
    for option in ({"context_lookup_nodes": 8}, {"lookup_after_drafts": 2}, {"context_vocab": True}):
        branching = BlockDrafter(drafter.heads, top_k=3, max_tree_tokens=8, **option)
        with pytest.raises(ValueError, match=next(iter(option))):
            model.generate(
                ids,
                cache_implementation="static",
                do_sample=False,
                captured_step=True,
                **{**gen, "assistant": branching},
            )
    assert calls == []
    hook.remove()
    # auto on a CPU, and False anywhere: the static path
    monkeypatch.setattr(row, "decode_captured", lambda *a, **k: pytest.fail("the captured step was taken"))
    ref = static_generate(model, ids, max_new_tokens=10)
    for setting in (None, False):
        assert static_generate(model, ids, drafter, max_new_tokens=10, captured_step=setting).tolist() == ref.tolist()


# ---------------------------------------------------------------------------------------- the shipped model
@pytest.mark.real
@pytest.mark.slow
def test_shipped_drafter_in_the_captured_step_gives_plain_static_generate_s_tokens(smollm2):
    model, tokenizer = smollm2
    drafter = hf_bpd.load_packaged_drafter(max_tree_tokens=16)
    drafter.count_host_syncs = True
    accepted = []
    for prompt in spec_bench_prompts(3):
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
        ref = static_generate(model, inputs["input_ids"], max_new_tokens=40)
        out = static_generate(model, inputs["input_ids"], drafter, max_new_tokens=40, captured_step=True)
        assert out.tolist() == ref.tolist()
        assert drafter.stats.host_syncs.get("step", 0) == 0
        accepted += drafter.stats.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.2  # the shipped heads' drafts are accepted through the fixed tree


# ---------------------------------------------------------------------------------------- CPU kernels
def mixed_kernel_plan(model, **_):
    """A kernel plan for the tiny model's shapes that packs at 1-2 and 5-8 rows and leaves 3-4 rows (the
    first prompt's prefill) and more to BLAS, every other shape on the streamed kernel's panels: the trees'
    kernels are packed before any eager forward needs them, so the compiled step must pack them itself."""
    from hf_bpd.cpu.packed_linear import KERNEL_PLAN_SIZES, STREAMED, KernelPlan, RowPlan

    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear})
    row = RowPlan(KERNEL_PLAN_SIZES, tuple(n in (1, 2, 8) for n in KERNEL_PLAN_SIZES))
    return KernelPlan({s: row for s in shapes}, {s: STREAMED for s in shapes[::2]}), None, False


def compiled_on_cpu_kernels(monkeypatch, backend: str):
    """(plain static greedy, the captured step compiled with `backend` on the drafter's packed CPU kernels)
    tokens, and the kernel ops in each graph compiled."""
    from hf_bpd.cpu.packed_linear import packed_linear_available

    if not packed_linear_available():
        pytest.skip("this torch build has no oneDNN")
    from torch._dynamo.backends.registry import lookup_backend

    monkeypatch.setattr("hf_bpd.cpu.packed_linear.cached_kernel_plan", mixed_kernel_plan)
    monkeypatch.setattr("hf_bpd.decode.binding.cached_kernel_plan", mixed_kernel_plan)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(heads_of(model, "previous"), top_k=3, max_tree_tokens=8, packed_linear=True)
    ids = torch.tensor(PROMPTS[0])
    ref = static_generate(model, ids, max_length=36)
    out = static_generate(model, ids, drafter, max_length=36, captured_step=recording)
    torch._dynamo.reset()
    ops = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in graphs]
    return ref, out, [(sum("hf_bpd.streamed" in o for o in g), sum("hf_bpd.onednn" in o for o in g)) for g in ops]


def test_the_compiled_step_runs_the_packed_cpu_kernels_as_ops_in_its_graphs(monkeypatch):
    ref, out, kernels = compiled_on_cpu_kernels(monkeypatch, "aot_eager")
    assert out.tolist() == ref.tolist()
    # trees of 8, 2 and 1 nodes on both packed kernels (packed before the first was traced), 4 on BLAS but
    # for the heads' LM-head rows (1-2 rows, streamed)
    assert len(kernels) == 4 and all(streamed for streamed, _ in kernels), kernels
    assert sum(onednn > 0 for _, onednn in kernels) == 3, kernels


@pytest.mark.slow
def test_inductor_compiles_the_step_on_the_packed_cpu_kernels_and_gives_the_same_tokens(monkeypatch):
    # with freezing on, as the bench's compiled forwards leave it: the step's graphs must not freeze their state
    monkeypatch.setattr("torch._inductor.config.freezing", True)
    ref, out, kernels = compiled_on_cpu_kernels(monkeypatch, "inductor")
    assert out.tolist() == ref.tolist()
    assert all(streamed for streamed, _ in kernels) and sum(onednn > 0 for _, onednn in kernels) == 3, kernels
