"""Block draft heads: shapes, the zero-residual initialisation, save/load round trips (tied and untied),
binding, and the compatibility checks against a base model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_heads, tiny_model
from safetensors.torch import load_file

import hf_bpd
from hf_bpd import BlockDraftHeads, BlockDraftHeadsConfig
from hf_bpd.drafting.heads import MAX_HEADS

VOCAB, HIDDEN = 97, 32  # conftest.TINY


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def hidden(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


# ---------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("lead", [(), (2,), (2, 5)])
def test_forward_shape(model, lead):
    heads = random_heads(model, num_heads=3)
    x = hidden(*lead)
    out = heads(x)
    assert out.shape == (*lead, 3, VOCAB)
    assert heads.head_states(x).shape == (*lead, 3, HIDDEN)
    assert heads.num_heads == 3
    # forward is project(head_states) and head i depends only on its own block.
    torch.testing.assert_close(out, heads.project(heads.head_states(x)))
    torch.testing.assert_close(out[..., 1, :], model.lm_head(heads.heads[1][0](x)))


def test_next_token_heads_read_token_t_plus_1(model, tmp_path):
    x = hidden(2, 5)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    plain = BlockDraftHeads.for_base_model(model, num_heads=3)
    untrained = BlockDraftHeads.for_base_model(model, num_heads=3, use_next_token=True)
    # zero-initialised residuals: an untrained head ignores the token like a plain one
    assert torch.equal(untrained(x, tokens), plain(x))
    heads = random_heads(model, num_heads=3, use_next_token=True)
    assert heads.heads[0][0].linear.in_features == 2 * HIDDEN
    out = heads(x, tokens)
    assert out.shape == (2, 5, 3, VOCAB)
    emb = model.get_input_embeddings().weight
    block = heads.heads[2][0]
    want = x + block.act(block.linear(torch.cat([x, emb[tokens]], dim=-1)))
    torch.testing.assert_close(out[..., 2, :], model.lm_head(want))
    assert not torch.allclose(out, heads(x, (tokens + 1) % VOCAB))  # the token changes the draft
    with pytest.raises(ValueError, match="next_tokens"):
        heads(x)
    with pytest.raises(ValueError, match="shape"):
        heads(x, tokens[:, :3])
    heads.save_pretrained(tmp_path)
    again = BlockDraftHeads.from_pretrained(tmp_path)
    assert again.config.use_next_token
    with pytest.raises(RuntimeError, match="bind"):
        again(x, tokens)
    assert torch.equal(again.bind(model)(x, tokens), out)
    assert torch.equal(heads.first_heads(2)(x, tokens), out[..., :2, :])
    with pytest.raises(ValueError, match="num_layers"):
        BlockDraftHeads.for_base_model(model, num_layers=0, use_next_token=True)


def test_previous_heads_read_the_token_before_each_target(model, tmp_path):
    x = hidden(2, 5)
    tokens = torch.randint(0, VOCAB, (2, 5, 3), generator=torch.Generator().manual_seed(2))  # tokens t+1..t+3
    heads = random_heads(model, num_heads=3, token_input="previous")
    assert heads.conditions_on_draft and not heads.config.use_next_token
    out = heads(x, tokens)
    assert out.shape == (2, 5, 3, VOCAB)
    emb = model.get_input_embeddings().weight
    for i in range(3):  # head i+1 reads token t+1+i, the one right before its target t+2+i
        block = heads.heads[i][0]
        want = x + block.act(block.linear(torch.cat([x, emb[tokens[..., i]]], dim=-1)))
        torch.testing.assert_close(out[..., i, :], model.lm_head(want))
        torch.testing.assert_close(heads.project(heads.step(i, x, tokens[..., i])), out[..., i, :])
    changed = tokens.clone()
    changed[..., 1] = (changed[..., 1] + 1) % VOCAB
    again = heads(x, changed)
    assert torch.equal(again[..., [0, 2], :], out[..., [0, 2], :])  # only head 2 reads token t+2
    assert not torch.allclose(again[..., 1, :], out[..., 1, :])
    with pytest.raises(ValueError, match="previous"):
        heads(x, tokens[..., 0])  # only token t+1: not enough for heads 2 and 3
    with pytest.raises(ValueError, match="previous"):
        heads(x)
    heads.save_pretrained(tmp_path)
    loaded = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert loaded.config.token_input == "previous" and torch.equal(loaded(x, tokens), out)


@pytest.mark.parametrize("chain", ["state", "beside"])
def test_chained_heads_read_the_state_of_the_head_before_them(model, tmp_path, chain):
    x = hidden(2, 5)
    tokens = torch.randint(0, VOCAB, (2, 5, 3), generator=torch.Generator().manual_seed(2))  # tokens t+1..t+3
    independent = random_heads(model, num_heads=3, token_input="previous")
    given = independent.with_chain(chain)
    before = independent(x, tokens)
    assert given.config.chain == chain and given.chained and not independent.chained
    if chain == "beside":  # the parent's state enters through new weights that start at zero: as before
        assert torch.equal(given(x, tokens), before)
    heads = random_heads(model, num_heads=3, token_input="previous", chain=chain)
    out = heads(x, tokens)
    emb = model.get_input_embeddings().weight
    state = None
    for i in range(3):  # head i+1 reads token t+1+i and (i > 0) head i's state: in place of x, or beside it
        block = heads.heads[i][0]
        base = state if chain == "state" and i else x
        extra = [emb[tokens[..., i]]] + ([state] if chain == "beside" and i else [])
        state = base + block.act(block.linear(torch.cat([base, *extra], dim=-1)))
        torch.testing.assert_close(out[..., i, :], model.lm_head(state))
        step = heads.step(i, x, tokens[..., i], None if i == 0 else heads.head_states(x, tokens)[..., i - 1, :])
        torch.testing.assert_close(heads.project(step), out[..., i, :])
    changed = tokens.clone()
    changed[..., 0] = (changed[..., 0] + 1) % VOCAB
    again = heads(x, changed)  # every later head now reads token t+1 too, through the chain
    assert all(not torch.allclose(again[..., i, :], out[..., i, :]) for i in range(3))
    with pytest.raises(ValueError, match="parent"):
        heads.step(1, x, tokens[..., 1])  # a chained head without its parent's state
    heads.save_pretrained(tmp_path)
    loaded = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert loaded.config.chain == chain and torch.equal(loaded(x, tokens), out)
    with pytest.raises(ValueError, match="chained already"):
        heads.with_chain("state")


@pytest.mark.parametrize("token_input", ["previous", ""])
def test_deeper_heads_start_as_the_heads_they_grow_from(model, tmp_path, token_input):
    """`with_num_layers`: each head gains blocks after its own that start as the identity, so the deeper heads
    draft exactly as the shallow ones until trained; once the new blocks are non-zero they change the output,
    and the deeper heads save and load as such."""
    x = hidden(2, 5)
    tokens = torch.randint(0, VOCAB, (2, 5, 3), generator=torch.Generator().manual_seed(2))
    shallow = random_heads(model, num_heads=3, token_input=token_input)
    read = tokens if token_input == "previous" else None
    deeper = shallow.with_num_layers(3)
    assert deeper.config.num_layers == 3 and shallow.config.num_layers == 1
    assert torch.equal(deeper(x, read), shallow(x, read))
    for i in range(3):
        for j in (1, 2):
            assert not deeper.heads[i][j].linear.weight.any() and not deeper.heads[i][j].linear.bias.any()
    with torch.no_grad():
        deeper.heads[1][2].linear.bias.fill_(0.5)
    changed = deeper(x, read)
    assert torch.equal(changed[..., [0, 2], :], shallow(x, read)[..., [0, 2], :])
    assert not torch.allclose(changed[..., 1, :], shallow(x, read)[..., 1, :])
    deeper.save_pretrained(tmp_path)
    loaded = BlockDraftHeads.from_pretrained(tmp_path).bind(model)
    assert loaded.config.num_layers == 3 and torch.equal(loaded(x, read), changed)
    assert torch.equal(shallow.with_num_layers(1)(x, read), shallow(x, read))
    with pytest.raises(ValueError, match="grow, not shrink"):
        deeper.with_num_layers(2)


def test_chain_config_values():
    assert BlockDraftHeadsConfig(token_input="previous").chain == ""  # configs written before the option
    with pytest.raises(ValueError, match="previous"):
        BlockDraftHeadsConfig(token_input="next", chain="state")
    with pytest.raises(ValueError, match="context-copy"):
        BlockDraftHeadsConfig(token_input="previous", chain="beside", copy_dim=8)
    with pytest.raises(ValueError, match="chain must be"):
        BlockDraftHeadsConfig(token_input="previous", chain="rnn")


def test_token_input_config_values():
    from hf_bpd.drafting.heads import BlockDraftHeadsConfig

    assert BlockDraftHeadsConfig(use_next_token=True).token_input == "next"  # checkpoints before token_input
    assert BlockDraftHeadsConfig().token_input == ""
    assert BlockDraftHeadsConfig(token_input="previous").use_next_token is False
    with pytest.raises(ValueError, match="token_input"):
        BlockDraftHeadsConfig(token_input="hydra")


def test_random_heads_differ_from_each_other(model):
    heads = random_heads(model, num_heads=3)
    out = heads(hidden(4))
    assert not torch.allclose(out[:, 0], out[:, 1])
    assert not torch.allclose(out[:, 1], out[:, 2])


def zero_residual_heads(model, num_heads: int) -> BlockDraftHeads:
    return BlockDraftHeads.for_base_model(model, num_heads=num_heads)  # untrained heads start at zero


def test_for_base_model_starts_with_zero_residuals(model):
    heads = BlockDraftHeads.for_base_model(model, num_heads=2)
    for name, p in heads.named_parameters():
        assert torch.count_nonzero(p) == 0, name


def test_untrained_tied_heads_repeat_base_lm_head(model):
    heads = zero_residual_heads(model, num_heads=4)
    assert heads.config.tie_lm_head and heads.lm_head is None
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1]  # final-norm output: what the LM head sees
        draft = heads(h)
    assert draft.shape == (2, 7, 4, VOCAB)
    for i in range(4):
        assert torch.equal(heads.head_states(h)[..., i, :], h)
        torch.testing.assert_close(draft[..., i, :], out.logits, rtol=0, atol=1e-5)
        assert torch.equal(draft[..., i, :].argmax(-1), out.logits.argmax(-1))
    # Bit-identical to the LM head applied to h copies of the hidden state (same matmul shape).
    x = hidden(1)[0]
    with torch.no_grad():
        assert torch.equal(heads(x), model.lm_head(x.expand(4, HIDDEN)))
        torch.testing.assert_close(heads(x), model.lm_head(x).expand(4, VOCAB), rtol=0, atol=1e-5)


def test_tied_forward_without_bind_raises(model):
    config = BlockDraftHeads.for_base_model(model, num_heads=2).config
    with pytest.raises(RuntimeError, match="bind"):
        BlockDraftHeads(config)(hidden(1))


def test_tied_heads_borrow_lm_head_not_copy(model):
    heads = BlockDraftHeads.for_base_model(model, num_heads=2)
    names = [n for n, _ in heads.named_parameters()]
    assert not any("lm_head" in n for n in names)
    assert all(p.data_ptr() != model.lm_head.weight.data_ptr() for p in heads.parameters())
    assert heads.project(hidden(1)).shape == (1, VOCAB)


# ---------------------------------------------------------------------------------------------- save / load


def test_save_load_tied_round_trip(model, tmp_path):
    heads = random_heads(model, num_heads=3, seed=4)
    heads.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob("*.bin"))

    saved = load_file(tmp_path / "model.safetensors")
    assert not any("lm_head" in k for k in saved)
    assert not any("lm_head" in k for k in heads.state_dict())
    assert sum(t.numel() for t in saved.values()) == 3 * (HIDDEN * HIDDEN + HIDDEN)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "block_draft_heads"
    assert (config["hidden_size"], config["vocab_size"], config["num_heads"]) == (HIDDEN, VOCAB, 3)
    assert config["tie_lm_head"] is True
    assert config["base_lm_head_fingerprint"] == pytest.approx(heads.config.base_lm_head_fingerprint)

    loaded = BlockDraftHeads.from_pretrained(tmp_path)
    assert isinstance(loaded.config, BlockDraftHeadsConfig)
    assert loaded.lm_head is None
    # the draft vocabulary of full-vocabulary heads is not saved: it must come back as the identity
    # (transformers leaves unsaved buffers uninitialised; validation maps head outputs through it)
    assert torch.equal(loaded.draft_vocab, torch.arange(VOCAB))
    assert_same_params(heads, loaded)
    with pytest.raises(RuntimeError, match="bind"):
        loaded(hidden(1))
    assert loaded.bind(model) is loaded
    x = hidden(3, 2)
    with torch.no_grad():
        assert torch.equal(loaded(x), heads(x))


def test_save_load_untied_round_trip(model, tmp_path):
    heads = BlockDraftHeads.for_base_model(model, num_heads=2, tie_lm_head=False)
    assert heads.lm_head is not None
    assert torch.equal(heads.lm_head.weight, model.lm_head.weight)
    assert heads.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()  # a copy, not shared
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for block in heads.heads:
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    heads.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight)

    loaded = BlockDraftHeads.from_pretrained(tmp_path)  # no bind: it has its own softmax layer
    assert loaded.config.tie_lm_head is False
    assert_same_params(heads, loaded)
    x = hidden(4)
    with torch.no_grad():
        out = loaded(x)
        assert torch.equal(out, heads(x))
        torch.testing.assert_close(out[:, 0], model.lm_head(heads.heads[0][0](x)))


def test_drafter_from_pretrained_loads_saved_heads(model, tmp_path):
    heads = random_heads(model, num_heads=3, seed=5)
    heads.save_pretrained(tmp_path)
    drafter = hf_bpd.BlockDrafter.from_pretrained(tmp_path, top_k=3)
    assert isinstance(drafter, hf_bpd.BlockDrafter)
    assert drafter.top_k == 3
    assert drafter.num_heads == 3
    assert_same_params(heads, drafter.heads)
    hf_bpd.prepare(drafter, model)
    lat = drafter.lattice(hidden(2), torch.tensor([1, 2]))
    assert lat.tokens.shape == (2, 3, 3)
    with torch.no_grad():
        want = hf_bpd.Lattice.from_logits(heads(hidden(2)), top_k=3)
    assert torch.equal(lat.tokens, want.tokens)
    assert torch.equal(lat.logprobs, want.logprobs)


# ---------------------------------------------------------------------------------------------- compatibility


def test_check_compatible_same_model_passes(model):
    heads = random_heads(model)
    heads.check_compatible(model)
    heads.check_compatible(tiny_model(seed=0))  # an identical re-creation has the same fingerprint


@pytest.mark.parametrize(
    ("change", "message"), [({"hidden_size": 48}, "hidden size"), ({"vocab_size": 101}, "vocabulary size")]
)
def test_check_compatible_other_shape(model, change, message):
    heads = random_heads(model)
    other = tiny_model(**change)
    with pytest.raises(ValueError, match=message):
        heads.check_compatible(other)
    with pytest.raises(ValueError, match=message):
        heads.bind(other)


def test_check_compatible_other_weights_same_shape(model, tmp_path):
    heads = random_heads(model)
    other = tiny_model(seed=1)
    assert other.lm_head.weight.shape == model.lm_head.weight.shape
    with pytest.raises(ValueError, match="fingerprint"):
        heads.check_compatible(other)
    # The saved config carries the fingerprint, so a reloaded copy refuses too, and keeps its old binding.
    heads.save_pretrained(tmp_path)
    loaded = BlockDraftHeads.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fingerprint"):
        loaded.bind(other)
    with pytest.raises(RuntimeError, match="bind"):
        loaded(hidden(1))


@pytest.mark.parametrize("num_heads", [0, -1, MAX_HEADS + 1])
def test_num_heads_out_of_range(model, num_heads):
    assert MAX_HEADS == 32
    with pytest.raises(ValueError, match="num_heads"):
        BlockDraftHeads.for_base_model(model, num_heads=num_heads)
    with pytest.raises(ValueError, match="num_heads"):
        BlockDraftHeads(BlockDraftHeadsConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=num_heads))


@pytest.mark.parametrize("num_heads", [1, MAX_HEADS])
def test_num_heads_at_bounds(model, num_heads):
    heads = BlockDraftHeads.for_base_model(model, num_heads=num_heads)
    assert heads(hidden(1)).shape == (1, num_heads, VOCAB)


def test_zero_init_survives_a_bare_config_construction():
    from hf_bpd import BlockDraftHeadsConfig

    heads = BlockDraftHeads(BlockDraftHeadsConfig(hidden_size=8, vocab_size=11, num_heads=2))
    assert all(torch.count_nonzero(p) == 0 for p in heads.parameters())


def test_first_heads_keeps_the_first_n_heads_exactly(model):
    heads = random_heads(model, num_heads=4)
    fewer = heads.first_heads(2)
    assert fewer.num_heads == 2 and fewer.config.num_heads == 2
    for i in range(2):  # the kept heads' weights are copied exactly
        for a, b in zip(fewer.heads[i].parameters(), heads.heads[i].parameters()):
            assert torch.equal(a, b)
    x = torch.randn(3, model.config.hidden_size)
    # outputs agree up to float rounding (a different GEMM shape may round differently with 2 threads)
    torch.testing.assert_close(fewer(x), heads(x)[:, :2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="n must be"):
        heads.first_heads(5)
