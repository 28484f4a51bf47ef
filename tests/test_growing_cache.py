"""`kv.GrowingLayer`: a DynamicCache layer written in place after its filled front. It must hold what a
`DynamicLayer` holds after any sequence of the operations decoding and transformers apply, give a forward
the same logits, stop copying the context once it has room, and be what hf_bpd decodes on."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.kv import GrowingLayer, compact_cache, compact_rows, drop_last, grow_layers, squeeze_holes


def paired_caches(model):
    """A plain DynamicCache and one grown in place, for the same model."""
    plain, grown = DynamicCache(config=model.config), DynamicCache(config=model.config)
    grow_layers(grown)
    return plain, grown


def assert_same(plain, grown):
    for a, b in zip(plain.layers, grown.layers):
        assert type(b) is GrowingLayer
        assert a.keys.shape == b.keys.shape
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert plain.get_seq_length() == grown.get_seq_length()


def update_both(caches, batch: int, n: int, g: torch.Generator):
    """`n` new random entries [batch, 2 heads, n, 8] written to every layer of each cache; the last
    layer's (keys, values) as the forward would read them."""
    k, v = torch.randn(batch, 2, n, 8, generator=g), torch.randn(batch, 2, n, 8, generator=g)
    for cache in caches:
        for layer in range(len(cache.layers)):
            out = cache.update(k.clone(), v.clone(), layer_idx=layer)
    return out


def test_growing_layer_holds_what_a_dynamic_layer_holds_through_every_operation():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    for batch in (1, 3):
        plain, grown = paired_caches(model)
        update_both((plain, grown), batch, 37, g)  # a prefill
        for step in range(40):  # steps of trees, compactions, crops and batch operations
            n = int(torch.randint(1, 9, (1,), generator=g))
            keys, values = update_both((plain, grown), batch, n, g)
            assert keys.shape[-2] == grown.get_seq_length()  # what the forward reads: every entry, the new last
            kept = int(torch.randint(1, n + 1, (1,), generator=g))
            if batch == 1:
                keep = torch.sort(torch.randperm(n, generator=g)[:kept]).values
                for cache in (plain, grown):
                    compact_cache(cache, n, keep)
            else:
                keep = torch.stack([torch.sort(torch.randperm(n, generator=g)[:kept]).values for _ in range(batch)])
                for cache in (plain, grown):
                    compact_rows(cache, n, keep)
            if step % 7 == 3:
                for cache in (plain, grown):
                    cache.crop(-1)
            if step % 11 == 5:
                for cache in (plain, grown):
                    drop_last(cache, 2)
            if batch > 1 and step % 13 == 6:
                past = torch.ones(batch, grown.get_seq_length())
                past[0, :3] = 0
                for cache in (plain, grown):
                    squeeze_holes(cache, past)
            if batch > 1 and step == 20:  # a finished row dropped (the cache's own reorder)
                for cache in (plain, grown):
                    cache.reorder_cache(torch.tensor([0, 2]))
                batch = 2
            assert_same(plain, grown)


def test_growing_layer_writes_in_place_until_its_buffer_is_full():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 100, 8)
    layer.update(k, -k)
    buffer = layer.key_buffer
    assert buffer.shape[-2] == 100 + GrowingLayer.MIN_ROOM  # room for a quarter more, at least MIN_ROOM
    assert layer.keys.data_ptr() == buffer.data_ptr() and not layer.keys.is_contiguous()
    written = 100
    while written + 8 <= buffer.shape[-2]:
        layer.update(torch.ones(1, 2, 8, 8), torch.ones(1, 2, 8, 8))
        written += 8
        assert layer.key_buffer is buffer  # no copy of the context
    layer.update(torch.ones(1, 2, 8, 8), torch.ones(1, 2, 8, 8))  # full: a new buffer, with the old entries
    assert layer.key_buffer is not buffer and layer.keys.shape[-2] == written + 8
    assert torch.equal(layer.keys[..., :100, :], k) and torch.equal(layer.values[..., :100, :], -k)


def test_a_layer_set_to_another_tensor_is_copied_into_a_new_buffer():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 10, 8)
    layer.update(k, -k)
    old = layer.key_buffer
    layer.keys = layer.keys.contiguous()  # what a compiled forward's `contiguous_kv` does
    layer.values = layer.values.contiguous()
    # the buffer behind must not be written: a forward has been handed `layer.keys`, not the buffer
    old_copy = old.clone()
    new = torch.randn(1, 2, 3, 8)
    keys, _ = layer.update(new, new)
    # bit for bit: the buffer's unwritten tail is uninitialised memory, which may hold NaNs (NaN != NaN)
    assert layer.key_buffer is not old and torch.equal(old.view(torch.int32), old_copy.view(torch.int32))
    assert torch.equal(keys, torch.cat([k, new], dim=-2))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_forward_on_a_grown_cache_gives_the_same_logits_bit_for_bit(attn):
    model = tiny_model("llama", attn=attn)
    prompt = torch.randint(3, 97, (1, 29), generator=torch.Generator().manual_seed(2))
    plain, grown = paired_caches(model)
    outs = [model(input_ids=prompt, cache=c, use_cache=True).logits for c in (plain, grown)]
    assert torch.equal(outs[0], outs[1])
    for n in (1, 5, 1, 8):  # steps, each cropped back by one as a rejected draft would be
        ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n))
        outs = [model(input_ids=ids, cache=c, use_cache=True).logits for c in (plain, grown)]
        assert torch.equal(outs[0], outs[1])
        for cache in (plain, grown):
            cache.crop(-1)
    assert_same(plain, grown)


def test_hf_bpd_decodes_on_a_cache_grown_in_place_and_returns_it():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=40,
        custom_generate=hf_bpd.generate,
        assistant=drafter,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == ref.tolist()
    layers = out.past_key_values.layers
    assert all(type(layer) is GrowingLayer for layer in layers)
    assert all(layer.keys.data_ptr() == layer.key_buffer.data_ptr() for layer in layers)  # no copy since prefill
    assert out.past_key_values.get_seq_length() == ids.shape[1] + 40 - 1  # the last token is not cached yet


def test_only_full_dynamic_layers_grow():
    model = tiny_model("mistral", sliding_window=4)
    cache = DynamicCache(config=model.config)
    kinds = [type(layer) for layer in cache.layers]
    grow_layers(cache)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer if k is DynamicLayer else k for k in kinds]
    lazy = DynamicCache()  # no config: layers are made by the first forward
    grow_layers(lazy)
    lazy.update(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8), layer_idx=0)
    assert type(lazy.layers[0]) is GrowingLayer
