"""Grouped-query attention without copying the cache (hf_bpd/cpu/grouped_attention.py): the same attention as
transformers' `sdpa` for masked forwards of several tokens, with no per-head copy of the keys and values,
switched on inside a block only, and what `fast_cpu` and hf_bpd's decode run."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers.integrations import sdpa_attention

import hf_bpd
from hf_bpd.cpu.grouped_attention import ATTENTION_NAME, grouped_attention, grouped_sdpa_attention


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch, heads, kv_heads, tokens, keys, mask_heads=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, tokens, 16, generator=g)
    key, value = (torch.randn(batch, kv_heads, keys, 16, generator=g) for _ in range(2))
    allowed = torch.rand(batch, mask_heads, tokens, keys, generator=g) > 0.3
    allowed[..., -1] = True  # every row sees a key
    mask = allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo().min)
    return query, key, value, mask


@pytest.mark.parametrize("tokens", [2, 7])
@pytest.mark.parametrize("mask_heads", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_masked_forward_of_several_tokens_attends_as_sdpa_does_without_copying_the_cache(
    tokens, mask_heads, dtype, monkeypatch
):
    query, key, value, mask = _inputs(3, 6, 2, tokens, 11, mask_heads, dtype)
    module = _Attention(groups=3)
    expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    copies = []
    repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or repeat(x, n))
    out, weights = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert weights is None and out.shape == expected.shape == (3, tokens, 6, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert copies == []  # sdpa's own path copies the keys and values per query head here


def test_what_it_does_not_fold_goes_to_sdpa_unchanged(monkeypatch):
    calls = []
    original = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(
        "hf_bpd.cpu.grouped_attention.sdpa_attention_forward", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    query, key, value, mask = _inputs(2, 4, 2, 1, 9)
    grouped_sdpa_attention(_Attention(2), query, key, value, mask)  # one token: transformers folds it itself
    query, key, value, mask = _inputs(2, 4, 4, 3, 9)
    grouped_sdpa_attention(_Attention(1), query, key, value, mask)  # no grouped heads
    query, key, value, _ = _inputs(2, 4, 2, 3, 9)
    grouped_sdpa_attention(_Attention(2), query, key, value, None)  # no mask: sdpa's own grouped kernel
    assert len(calls) == 3


def test_the_block_switches_a_models_sdpa_layers_and_back_and_nests():
    model = tiny_model("llama")
    config = model.config
    assert config._attn_implementation == "sdpa"
    with grouped_attention(model):
        assert config._attn_implementation == ATTENTION_NAME
        with grouped_attention(model):
            assert config._attn_implementation == ATTENTION_NAME
        assert config._attn_implementation == ATTENTION_NAME  # the outer block is still open
    assert config._attn_implementation == "sdpa"
    eager = tiny_model("llama", attn="eager")
    with grouped_attention(eager):
        assert eager.config._attn_implementation == "eager"  # only sdpa layers are switched


def test_a_tree_forward_inside_the_block_equals_the_one_outside_and_copies_nothing(monkeypatch):
    from hf_bpd.decode.verify import verify_tree
    from hf_bpd.drafting.tree import DraftTree, batch_trees

    model = tiny_model("qwen2")
    prompt = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    trees = [DraftTree.from_paths(5, [[7, 8, 9], [7, 11], [12]], max_nodes=6) for _ in range(2)]
    batch = batch_trees(trees, pad_token_id=0, device=torch.device("cpu"))
    past_mask = torch.ones(2, 12, dtype=torch.long)

    def tree_logits():
        from transformers import DynamicCache

        from hf_bpd.compat import cache_argument

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, **{cache_argument(model): cache}, use_cache=True)
            return verify_tree(model, batch, cache, past_mask).logits

    expected = tree_logits()
    copies = []
    repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(x.shape) or repeat(x, n))
    with grouped_attention(model):
        got = tree_logits()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert copies == []


def test_fast_cpu_and_hf_bpd_run_grouped_attention_and_leave_the_model_as_loaded(monkeypatch):
    model = tiny_model("llama", eos_token_id=None)
    seen = []
    original = grouped_sdpa_attention

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, spy)
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert seen == []
    with hf_bpd.fast_cpu(model):
        fast = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    assert seen and max(seen) > 1  # prompt lookup's verification: several tokens with a mask
    seen.clear()
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    drafted = model.generate(
        ids, max_new_tokens=12, do_sample=False, custom_generate=hf_bpd.generate, assistant=drafter
    )
    assert seen and max(seen) > 1  # its trees
    assert fast.tolist() == plain.tolist() == drafted.tolist()
    assert model.config._attn_implementation == "sdpa"


def test_models_whose_code_tests_the_name_sdpa_are_left_on_sdpa(monkeypatch):
    from all_architectures import build

    import hf_bpd.cpu.grouped_attention as module

    # Gemma 4's modeling file runs code of its own under the exact name "sdpa" (in transformers 5.24 and 5.25;
    # Falcon did until 5.25 moved it onto the attention interface)
    model = build("gemma4_text")
    assert model.config._attn_implementation == "sdpa"
    with grouped_attention(model):
        assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(module, "_names_sdpa", lambda name: False)  # that test of the name alone keeps it there
    with grouped_attention(model):
        assert model.config._attn_implementation == ATTENTION_NAME
    mha = tiny_model("llama", num_key_value_heads=4)  # no grouped heads: nothing to save
    with grouped_attention(mha):
        assert mha.config._attn_implementation == "sdpa"
