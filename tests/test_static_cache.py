"""Decoding on a static cache (`static_cache.py`): the same tokens as plain `generate` on a static cache,
greedy and seeded sampling; trees padded to a compiled forward's fixed sizes; the cache compacted in
place; static caches the loop would not decode exactly refused before any forward."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, spec_bench_prompts, tiny_model
from transformers import StaticCache

import hf_bpd
import hf_bpd.decode.row as decoding
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.compat import GENERATE_CACHE_FIELD, cache_argument
from hf_bpd.decode.static_cache import GRAPH_TREE_SIZES, graph_tree_size, static_capacity
from hf_bpd.io.models import chat_inputs
from hf_bpd.kv import compact_static_cache


def generate(model, ids, drafter=None, **kw):
    if drafter is not None:
        kw.update(custom_generate=hf_bpd.generate, assistant=drafter)
    return model.generate(ids, cache_implementation="static", **kw)


@pytest.mark.parametrize("heads", ["random", "copying"])
def test_greedy_on_a_static_cache_gives_plain_generate_s_tokens(heads):
    model = tiny_model("llama", eos_token_id=None)
    head = random_heads(model) if heads == "random" else BlockDraftHeads.for_base_model(model, num_heads=4)
    drafter = BlockDrafter(head, top_k=3, max_tree_tokens=12)
    g = torch.Generator().manual_seed(3)
    for _trial in range(4):
        ids = torch.randint(3, 97, (1, int(torch.randint(1, 15, (1,), generator=g))), generator=g)
        for max_new in (1, 5, 40):  # up to the cache's last slot: trees shrink to the room left
            ref = generate(model, ids, do_sample=False, max_new_tokens=max_new)
            out = generate(model, ids, drafter, do_sample=False, max_new_tokens=max_new)
            assert out.tolist() == ref.tolist() == model.generate(ids, do_sample=False, max_new_tokens=max_new).tolist()
            assert drafter.stats.new_tokens == max_new
    assert heads == "random" or max(drafter.stats.accepted_lengths) > 1  # drafts were accepted, not only roots


def test_seeded_sampling_on_a_static_cache_gives_plain_sampling_s_tokens():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=10)
    ids = torch.tensor([[5, 6, 7, 8]])
    for seed in range(3):
        torch.manual_seed(seed)
        ref = generate(model, ids, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=30)
        torch.manual_seed(seed)
        out = generate(model, ids, drafter, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=30)
        assert out.tolist() == ref.tolist()


def test_trees_padded_to_graph_sizes_give_the_same_tokens_and_leave_the_cache_compacted(monkeypatch):
    # where generate would compile, trees are padded to GRAPH_TREE_SIZES; the padding is exercised here with
    # the eager forward standing in for the compiled call (compiling is torch's, not this loop's, to test)
    model = tiny_model("llama", eos_token_id=None)
    sizes = []
    real_verify = decoding.verify_tree

    def verify(model_, tree, cache, past_mask, windows=None, forward=None, capacity=None):
        sizes.append((tree.input_ids.shape[1], capacity - past_mask.shape[1]))  # (size, room left)
        return real_verify(model_, tree, cache, past_mask, windows, forward=forward, capacity=capacity)

    monkeypatch.setattr(decoding, "compiled_static_call", lambda m, config, kwargs: m.__call__)
    monkeypatch.setattr(decoding, "verify_tree", verify)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=4), top_k=3, max_tree_tokens=11)
    ids = torch.tensor([[5, 6, 7]])
    ref = generate(model, ids, do_sample=False, max_new_tokens=45)
    out = generate(model, ids, drafter, do_sample=False, max_new_tokens=45, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.tolist()
    capacity = ids.shape[1] + 45 - 1
    # every forward has a graph size, but where the cache's end squeezes it into the room left
    assert all(size in GRAPH_TREE_SIZES or size == room for size, room in sizes)
    assert all(size <= room for size, room in sizes) and 16 in {size for size, _ in sizes}
    cache = getattr(out, GENERATE_CACHE_FIELD)
    assert static_capacity(cache) == capacity and cache.get_seq_length() == ids.shape[1] + 45 - 1


def test_graph_tree_size_rounds_up_within_the_room_left():
    assert graph_tree_size(1, 100) == 1 and graph_tree_size(3, 100) == 4 and graph_tree_size(9, 100) == 16
    assert graph_tree_size(9, 12) == 12  # the cache's end: no slot past it
    assert graph_tree_size(200, 300) == 200  # beyond the largest size: as it is


def test_compact_static_cache_moves_the_kept_nodes_to_the_tree_slot_s_front_in_place():
    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), **{cache_argument(model): cache})  # 3 cached + 4 tree
    keys = cache.layers[0].keys
    before = keys.clone()
    compact_static_cache(cache, past_len=3, num_tree=4, keep=torch.tensor([0, 2]))
    assert cache.layers[0].keys is keys  # the same storage: a captured graph keeps reading it
    assert torch.equal(keys[..., :3, :], before[..., :3, :])
    assert torch.equal(keys[..., 3, :], before[..., 3, :]) and torch.equal(keys[..., 4, :], before[..., 5, :])
    assert cache.get_seq_length() == 5


def test_static_caches_the_loop_would_not_decode_exactly_are_refused_before_any_forward():
    model = tiny_model("llama")
    drafter = BlockDrafter(random_heads(model), top_k=3, max_tree_tokens=8)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="one row"):
        generate(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), drafter, max_new_tokens=4)
    windowed = tiny_model("mistral", sliding_window=6)
    windowed.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="static cache"):
        generate(windowed, torch.tensor([[5, 6, 7]]), BlockDrafter(random_heads(windowed), top_k=3), max_new_tokens=4)
    small = StaticCache(config=model.config, max_cache_len=6)
    with pytest.raises(ValueError, match="max_cache_len >= 7"):
        model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=5, custom_generate=hf_bpd.generate, assistant=drafter, cache=small
        )
    assert calls == []


@pytest.mark.parametrize("fused_sampling", [False, True])
@pytest.mark.parametrize("do_sample", [False, True])
def test_previous_heads_on_padded_trees_give_plain_static_generate_s_tokens(monkeypatch, do_sample, fused_sampling):
    # a GPU user's call, run on the CPU: trees padded to graph sizes (the compiled call stood in by the eager
    # forward) with heads that read the previous token, so greedy steps take the fused walk
    # (`accept_greedy_and_grow`) and sampled steps the device walk when `fused_sampling`: both combine the
    # padded batch's tensors with the unpadded tree's
    model = tiny_model("llama", eos_token_id=None)
    monkeypatch.setattr(decoding, "compiled_static_call", lambda m, config, kwargs: m.__call__)
    fused_steps = []  # (finished, the next tree was kept): it is dropped only where decoding stops
    real_fused = decoding.accept_greedy_and_grow

    def fused(*args):
        result, grown = real_fused(*args)
        fused_steps.append((result.finished, grown is not None))
        return result, grown

    monkeypatch.setattr(decoding, "accept_greedy_and_grow", fused)
    heads = random_heads(model, num_heads=4, token_input="previous", std=0.05)
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=11)
    drafter.fused_sampling = fused_sampling
    assert drafter.grows_on_device
    sample = dict(do_sample=True, temperature=0.8, top_k=20) if do_sample else dict(do_sample=False)
    for seed, ids in enumerate(([[5, 6, 7]], [[9, 3, 4, 8, 11, 12]])):
        ids = torch.tensor(ids)
        torch.manual_seed(seed)
        ref = generate(model, ids, max_new_tokens=40, **sample)
        torch.manual_seed(seed)
        out = generate(model, ids, drafter, max_new_tokens=40, **sample)
        assert out.tolist() == ref.tolist()
        padded = [n for n in drafter.stats.tree_sizes if n not in GRAPH_TREE_SIZES]
        assert padded, "no tree was padded: the test would not exercise the padded path"
    if not do_sample:  # the walk's end read from the padded batch is the host walk's: its tree is used
        assert len(fused_steps) > 10 and all(kept for finished, kept in fused_steps if not finished)


@pytest.mark.real
def test_shipped_drafter_on_padded_static_trees_gives_plain_static_generate_s_tokens(smollm2, monkeypatch):
    # the shipped heads (previous-token input: the fused greedy walk) and the device sampled walk, as a GPU
    # call runs them: trees padded to graph sizes, the compiled call stood in by the eager forward; a fixed
    # tree budget instead of "auto" (whose forward-cost curve is the cost module's, not this path's, to test)
    model, tokenizer = smollm2
    monkeypatch.setattr(decoding, "compiled_static_call", lambda m, config, kwargs: m.__call__)
    drafter = hf_bpd.load_packaged_drafter(max_tree_tokens=12)
    drafter.fused_sampling = True
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": spec_bench_prompts(1)[0]}])
    for seed, sample in enumerate((dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_p=0.9))):
        torch.manual_seed(seed)
        ref = generate(model, inputs["input_ids"], max_new_tokens=32, **sample)
        torch.manual_seed(seed)
        out = generate(model, inputs["input_ids"], drafter, max_new_tokens=32, **sample)
        assert out.tolist() == ref.tolist()
        assert any(n not in GRAPH_TREE_SIZES for n in drafter.stats.tree_sizes)  # padded trees were verified
