"""Attention windows at every length (hf_bpd/decode/support.py, `verify.tree_attention_mask`): every windowed
family transformers has, built tiny with a window of 8, decodes prompts + generations of 1-10 windows token
for token as plain `generate` does: greedy with an oracle drafter (deep trees accepted whole, siblings
before the true path, so node index != depth), seeded sampling, and left-padded batches."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model
from support_matrix import Row, build
from test_decoding import OracleDrafter

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.compat import GENERATE_CACHE_FIELD
from hf_bpd.decode.support import attention_windows
from hf_bpd.kv import GrowingLayer

W = 8
MIXED = ["sliding_attention", "full_attention"]
FAMILIES = {
    "mistral": Row("Mistral", "mistral", "exact", overrides=dict(sliding_window=W)),
    "qwen2": Row(
        "Qwen2", "qwen2", "exact", overrides=dict(use_sliding_window=True, sliding_window=W, max_window_layers=1)
    ),
    "gemma2": Row("Gemma-2", "gemma2", "exact", overrides=dict(head_dim=8, sliding_window=W)),
    "gemma3": Row("Gemma-3", "gemma3_text", "exact", overrides=dict(head_dim=8, sliding_window=W, layer_types=MIXED)),
    "cohere2": Row("Cohere-2", "cohere2", "exact", overrides=dict(sliding_window=W, layer_types=MIXED)),
    "gpt_oss": Row(
        "gpt-oss",
        "gpt_oss",
        "exact",
        overrides=dict(sliding_window=W, head_dim=8, num_local_experts=4, num_experts_per_tok=2, layer_types=MIXED),
    ),
    "llama4": Row(
        "Llama-4 (text, chunked)",
        "llama4_text",
        "exact",
        overrides=dict(
            attention_chunk_size=W,
            head_dim=8,
            num_local_experts=2,
            intermediate_size_mlp=64,
            layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 0],
        ),
    ),
}
_models: dict[str, torch.nn.Module] = {}


def model_for(family: str):
    if family not in _models:
        _models[family] = build(FAMILIES[family])
    return _models[family]


def generate(model, ids, drafter=None, seed=0, **kw):
    kw = dict(pad_token_id=0, eos_token_id=None, **kw)
    if drafter is not None:
        kw.update(custom_generate=hf_bpd.generate, assistant=drafter)
    torch.manual_seed(seed)
    return model.generate(ids, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_family_is_exact_past_its_window(family):
    model = model_for(family)
    windows = attention_windows(model)
    assert windows is not None and windows.cap is None and {size for _, size in windows.layers.values()} == {W}
    g = torch.Generator().manual_seed(3)

    # greedy, oracle drafts: every step accepts a whole chain of a tree with siblings, 10 windows long
    ids = torch.randint(3, 97, (1, 5), generator=g)
    reference = generate(model, ids, do_sample=False, max_new_tokens=10 * W - 5)
    h = 4
    drafter = OracleDrafter(random_heads(model, num_heads=h), reference, top_k=3, max_tree_tokens=12)
    out = generate(model, ids, drafter, do_sample=False, max_new_tokens=10 * W - 5, return_dict_in_generate=True)
    assert out.sequences.tolist() == reference.tolist()
    assert drafter.stats.accepted_lengths[:-1] == [h + 1] * (drafter.stats.steps - 1)
    # the returned cache keeps every key (full layers, grown in place)
    assert all(type(layer) is GrowingLayer for layer in getattr(out, GENERATE_CACHE_FIELD).layers)

    # seeded sampling, a prompt longer than the window
    ids = torch.randint(3, 97, (1, 2 * W + 3), generator=g)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    for seed in (0, 1):
        ref = generate(model, ids, seed=seed, do_sample=True, max_new_tokens=3 * W)
        assert generate(model, ids, drafter, seed=seed, do_sample=True, max_new_tokens=3 * W).tolist() == ref.tolist()

    # a left-padded batch: rows accept differently, holes in the cache
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (1, W + 3, 4)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    drafter = BlockDrafter(random_heads(model, num_heads=3), top_k=3, max_tree_tokens=8)
    ref = generate(model, ids, attention_mask=mask, do_sample=False, max_new_tokens=4 * W)
    out = generate(model, ids, drafter, attention_mask=mask, do_sample=False, max_new_tokens=4 * W)
    assert out.tolist() == ref.tolist()


def test_returned_cache_continues_as_plain_generate():
    model = model_for("gemma3")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    first = generate(model, ids, drafter, do_sample=False, max_new_tokens=2 * W, return_dict_in_generate=True)
    cache = getattr(first, GENERATE_CACHE_FIELD)
    more = generate(model, first.sequences, do_sample=False, max_new_tokens=2 * W, **{GENERATE_CACHE_FIELD: cache})
    assert more.tolist() == generate(model, ids, do_sample=False, max_new_tokens=4 * W).tolist()


def test_windows_are_per_layer_type_and_bind_only_past_the_window():
    from hf_bpd.decode.verify import tree_attention_mask
    from hf_bpd.drafting.tree import DraftTree, batch_trees

    model = model_for("gemma2")
    windows = attention_windows(model)
    tree = DraftTree.from_paths(5, [[6, 7], [8]], max_nodes=8)  # depths 0, 1, 2, 1
    batch = batch_trees([tree], pad_token_id=0, device=torch.device("cpu"))
    short = tree_attention_mask(batch, torch.ones(1, W - 4, dtype=torch.long), torch.float32, windows)
    assert isinstance(short, torch.Tensor)  # below the window: one plain mask for every layer
    masks = tree_attention_mask(batch, torch.ones(1, 20, dtype=torch.long), torch.float32, windows)
    assert set(masks) == {"full_attention", "sliding_attention"}
    seen = masks["sliding_attention"][0, 0] == 0
    assert (masks["full_attention"][0, 0] == 0)[:, :20].all()
    # node 2 (position 22) sees cached positions 15..19 and its ancestors at 20, 21 and itself: 8 keys
    assert seen[2].nonzero().flatten().tolist() == [15, 16, 17, 18, 19, 20, 21, 22]
    assert seen[3].nonzero().flatten().tolist() == [14, 15, 16, 17, 18, 19, 20, 23]


def test_gpt_neo_local_layers_stay_capped_below_their_window():
    # GPT-Neo masks local keys by cache index inside its attention module: served below the window only
    local = dict(attention_types=[[["global", "local"], 1]], window_size=24)
    model = build(Row("GPT-Neo", "gpt_neo", "exact", overrides=local))
    drafter = BlockDrafter(random_heads(model, num_heads=4), top_k=3, max_tree_tokens=16)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = generate(model, ids, do_sample=False, max_new_tokens=20)
    assert generate(model, ids, drafter, do_sample=False, max_new_tokens=20).tolist() == ref.tolist()
    with pytest.raises(ValueError, match="attention window of 24 tokens.*cache index"):
        generate(model, ids, drafter, do_sample=False, max_new_tokens=21)


def test_flex_attention_is_refused_with_its_reason():
    # a 4D float mask becomes a flex score_mod, which crashed torch 2.13's compiled CPU kernels on a tree
    model = tiny_model("mistral", attn="flex_attention", sliding_window=W)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=2, max_tree_tokens=4)
    with pytest.raises(ValueError, match="flex_attention takes a BlockMask"):
        generate(model, torch.tensor([[5, 6, 7]]), drafter, do_sample=False, max_new_tokens=4)
