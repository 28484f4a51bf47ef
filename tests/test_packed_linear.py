"""oneDNN pre-packed linears (`hf_bpd.packed_linear`): same numbers as `F.linear` up to rounding, used
only inside the context, never stale, and lossless decoding with them."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import hf_bpd
from hf_bpd.cost import measure_forward_cost
from hf_bpd.packed_linear import (
    PackedLinear,
    active_packed_linear,
    linear_context,
    packed_linear_available,
    wants_packed_linear,
)

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")


def test_packed_linear_matches_the_layer_for_any_row_count_and_reuses_its_packing():
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 96)
    plain = torch.nn.Linear(40, 96, bias=False)
    mode = PackedLinear(torch.nn.Sequential(layer, plain))
    assert mode.layers == [layer, plain]
    for shape in [(40,), (1, 40), (3, 40), (2, 5, 40), (70, 40)]:
        x = torch.randn(*shape)
        with mode, torch.no_grad():
            got, got_nobias = layer(x), plain(x)
        assert got.shape == (*shape[:-1], 96)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_nobias, F.linear(x, plain.weight), rtol=1e-4, atol=1e-4)
    assert len(mode) == 2  # one packed copy per weight, made on first use (one-row calls pack nothing)


def test_packed_linear_repacks_a_weight_changed_in_place():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with PackedLinear(layer), torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # e.g. merging an adapter into the base weights
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


def test_packed_linear_leaves_what_it_cannot_serve_to_the_layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    mode = PackedLinear(layer)
    with mode:
        layer(x).sum().backward()  # autograd: the packed op has no backward
        one_row = layer(x.detach()[:1])
    assert x.grad is not None and x.grad.shape == x.shape
    assert one_row.shape == (1, 8)
    assert len(mode) == 0  # neither call used a packed weight


def test_packed_linear_is_scoped_to_its_blocks():
    layer = torch.nn.Linear(4, 8)
    mode = PackedLinear(layer)
    with mode:
        with mode:  # re-entered (the heads inside a verification): still packed after the inner exit
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__  # outside: the layer's own class forward again
    with pytest.raises(KeyError), mode:
        raise KeyError("boom")
    assert "forward" not in layer.__dict__


def test_the_heads_softmax_over_the_base_lm_head_is_packed_inside_a_block():
    model = tiny_model("llama")
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2, token_input="previous").bind(model)
    assert heads.config.tie_lm_head  # the softmax borrows the base LM head: a weight, not an nn.Linear
    states = torch.randn(5, model.config.hidden_size)
    outer, inner = PackedLinear(model), PackedLinear(heads)
    assert active_packed_linear() is None
    with outer, inner, torch.no_grad():
        assert active_packed_linear() is inner  # the innermost block serves non-layer linears
        got = heads.project(states)
    assert active_packed_linear() is None
    torch.testing.assert_close(got, F.linear(states, heads.__dict__["_tied_weight"]), rtol=1e-4, atol=1e-4)
    assert len(inner) == 1 and len(outer) == 0


def test_auto_resolution_and_refusals():
    model = tiny_model("llama")
    assert wants_packed_linear(model, None)  # float32, CPU, tiny
    assert not wants_packed_linear(model, False)
    assert isinstance(linear_context(model, False), contextlib.nullcontext)
    assert linear_context(model, True) is linear_context(model, None)  # one packed copy per model
    assert not wants_packed_linear(model.to(torch.bfloat16), None)
    with pytest.raises(ValueError, match="float32 models on a CPU; this one is torch.bfloat16"):
        wants_packed_linear(model, True)
    with pytest.raises(ValueError, match="packed_linear must be True, False or None"):
        hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(tiny_model(), num_heads=2), packed_linear="yes")


def test_a_torch_whose_private_ops_changed_turns_packing_off_or_raises(monkeypatch):
    import hf_bpd.packed_linear as packed_linear

    def changed(*args):
        raise RuntimeError("mkldnn::_linear_pointwise() expected at most 5 arguments")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", changed)
    assert packed_linear.packed_linear_available.__wrapped__() is False  # the self-check, uncached
    monkeypatch.setattr(packed_linear, "packed_linear_available", lambda: False)
    model = tiny_model("llama")
    assert not packed_linear.wants_packed_linear(model, None)
    with pytest.raises(RuntimeError, match="needs oneDNN's packed linear ops"):
        packed_linear.wants_packed_linear(model, True)


@pytest.mark.parametrize("token_input", ["next", "previous"])
def test_generate_with_packed_linear_equals_greedy(token_input):
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    heads = copying_heads(model, 4)
    if token_input == "previous":
        heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=60)
    for packed in (True, False):
        drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=16, packed_linear=packed)
        got = model.generate(
            ids, do_sample=False, max_new_tokens=60, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert got.tolist() == ref.tolist()
        assert token_input == "previous" or max(drafter.stats.accepted_lengths) > 1
        assert isinstance(drafter.linear_context, PackedLinear) == packed
    assert len(linear_context(model, True)) > 0  # the verification forward ran on packed weights


def test_forward_cost_is_measured_the_way_verification_runs():
    model = tiny_model("llama")
    mode = linear_context(model, True)
    mode.clear()
    measure_forward_cost(model, sizes=(1, 2), context=8, repeats=1, packed_linear=False)
    assert len(mode) == 0
    measure_forward_cost(model, sizes=(1, 2), context=8, repeats=1, packed_linear=True)
    assert len(mode) > 0
