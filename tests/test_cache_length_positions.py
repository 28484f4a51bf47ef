"""Models whose attention reads a query's position from the cache's length and its index in the forward, not
from `position_ids`: Llama-4's NoPE layers scale each query by the block of floor_scale positions its cache
index falls in. A tree's node i sits at cache index past + i but at position past + depth(i), so trees are kept
inside one block (`support.index_position_room`) and batches are refused, as are Inkling's (relative biases by
cache index). And LongRoPE, which picks its rotary frequencies per forward by its largest position: trees stay
below its switch, a generation passing it is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from transformers import Llama4ForCausalLM, Llama4TextConfig

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads
from hf_bpd.decode.support import index_position_block, index_position_room
from hf_bpd.drafting.tree import DraftTree

# the test suite's tiny shapes (tests/conftest.py)
SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)

FLOOR_SCALE = 4
NEW_TOKENS = 16


def tiny_llama4(floor_scale: int = FLOOR_SCALE, temperature_tuning: bool = True, seed: int = 0) -> Llama4ForCausalLM:
    """A tiny random Llama-4 whose second layer is a NoPE layer with attention temperature tuning, scaled
    strongly enough (attn_scale 1, sharp queries and keys) that a query scaled for the wrong block moves the
    logits and the greedy tokens."""
    torch.manual_seed(seed)
    config = Llama4TextConfig(
        **{k: TINY[k] for k in SHAPE},
        intermediate_size_mlp=64,
        head_dim=8,
        no_rope_layers=[1, 0],  # 0: the layer takes no rotary embedding (NoPE)
        attn_temperature_tuning=temperature_tuning,
        floor_scale=floor_scale,
        attn_scale=1.0,
        num_local_experts=2,
        moe_layers=[],
        attention_chunk_size=None,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    model = Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # greedy choices far from ties, attention far from uniform
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


class DecoyOracle(BlockDrafter):
    """Knows the true greedy continuation and drafts it after `decoys` wrong children of the root, so every
    true node sits at a tree index past its depth (a plain oracle puts its path first, index = depth)."""

    def __init__(self, model, reference: torch.Tensor, decoys: int = 2, depth: int = 6, **kw):
        kw.setdefault("max_tree_tokens", 1 + decoys + depth)
        super().__init__(BlockDraftHeads.for_base_model(model, num_heads=4), top_k=3, calibrate=False, **kw)
        self.reference = reference[0].tolist()
        self.decoys, self.depth, self.vocab = decoys, depth, model.config.vocab_size

    def draft(self, hidden_last, context, max_depth=None, max_tokens=None, warp=None, **kwargs):
        seen = context.shape[1]  # the sequence so far, root included
        truth = self.reference[seen : seen + min(self.depth, max_depth or self.depth)]
        budget = self.tree_budget if max_tokens is None else max(1, min(self.tree_budget, max_tokens))
        tree = DraftTree.root_only(int(context[0, -1]))
        wrong = [t for t in range(3, self.vocab) if not truth or t != truth[0]][: self.decoys]
        for token in wrong:
            tree.add_path([token], budget)
        tree.add_path(truth, budget)
        self._verified = [None]
        return [tree]


GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)


def generate_both(model, ids, drafter):
    ref = model.generate(ids, **GREEDY)
    out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **GREEDY)
    return ref, out


def assert_exact(ref, out, what):
    assert out.sequences.tolist() == ref.sequences.tolist(), what
    assert len(out.logits) == len(ref.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        where = f"{what}, new token {step}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, where=where: f"{where}: {m}")


def assert_trees_within_block(drafter, prompt_len: int, block: int):
    """Every step's tree fits the block of its root: its size <= index_position_room at that step's cache."""
    past = prompt_len  # the cache holds the prompt; the first generated token is the first root
    for size, accepted in zip(drafter.stats.tree_sizes, drafter.stats.accepted_lengths):
        assert 1 <= size <= index_position_room(block, past), (past, size)
        past += accepted


def test_llama4_nope_temperature_is_detected():
    assert index_position_block(tiny_llama4()) == FLOOR_SCALE
    assert index_position_block(tiny_llama4(temperature_tuning=False)) is None
    # the bound: root-only steps always fit, a tree at the start of a block may fill it
    assert [index_position_room(4, past) for past in range(8)] == [3, 2, 1, 4, 3, 2, 1, 4]


@pytest.mark.parametrize("floor_scale", [4, 5])
def test_trees_whose_nodes_sit_past_their_depth_are_exact(floor_scale):
    """Every prompt length over two block boundaries: the true path sits behind decoys (index > depth),
    straddling block boundaries without the bound, and every token and raw logit equals plain greedy's."""
    model = tiny_llama4(floor_scale)
    g = torch.Generator().manual_seed(1)
    for prompt_len in range(1, 2 * floor_scale + 2):
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        ref = model.generate(ids, **GREEDY)
        drafter = DecoyOracle(model, ref.sequences)
        out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **GREEDY)
        assert_exact(ref, out, f"prompt of {prompt_len}")
        assert_trees_within_block(drafter, prompt_len, floor_scale)
        assert max(drafter.stats.accepted_lengths) > 1  # true nodes behind the decoys were accepted


def test_static_cache_trees_are_exact_and_within_block():
    """On a static cache the trees fit both its free slots and the block."""
    model = tiny_llama4()
    g = torch.Generator().manual_seed(3)
    for prompt_len in range(1, 2 * FLOOR_SCALE + 2):
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        ref = model.generate(ids, **GREEDY)
        drafter = DecoyOracle(model, ref.sequences)
        out = model.generate(
            ids, custom_generate=hf_bpd.generate, assistant=drafter, cache_implementation="static", **GREEDY
        )
        assert_exact(ref, out, f"prompt of {prompt_len}")
        assert_trees_within_block(drafter, prompt_len, FLOOR_SCALE)


def test_copying_heads_with_grown_trees_are_exact_and_within_block():
    """The shipped path: "previous" heads grow the next tree during the accept, before its cache length is
    known; the loop cuts it to the block."""
    model = tiny_llama4()
    g = torch.Generator().manual_seed(2)
    for prompt_len in range(1, 2 * FLOOR_SCALE + 2):
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        heads = BlockDraftHeads.for_base_model(model, num_heads=4, token_input="previous")
        drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=12)
        ref, out = generate_both(model, ids, drafter)
        assert_exact(ref, out, f"prompt of {prompt_len}")
        assert_trees_within_block(drafter, prompt_len, FLOOR_SCALE)


def test_batches_are_refused_before_any_forward():

    model = tiny_llama4()
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=4), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    assert_batch_refused_before_any_forward(model, drafter, ids)
    # without temperature tuning its NoPE layers read no position: batches are served
    model = tiny_llama4(temperature_tuning=False)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=4), top_k=3, max_tree_tokens=8)
    mask = (ids != 0).long()
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=8, custom_generate=hf_bpd.generate, assistant=drafter
    )
    assert out.tolist() == ref.tolist()


def test_inkling_batches_are_refused_before_any_forward():
    """Inkling biases attention by the distance in cache indices: one row's chains sit at their positions,
    a batch's holes would stretch the distances."""
    from all_architectures import build

    model = build("inkling_text")
    assert index_position_block(model) == 1
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    assert_batch_refused_before_any_forward(model, drafter, torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]))


def tiny_longrope(switch: int = 12):
    """A tiny random Phi-3 with LongRoPE: short rotary frequencies below `switch`, very different long ones."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(
        **{k: TINY[k] for k in SHAPE if k != "max_position_embeddings"},
        max_position_embeddings=64,
        original_max_position_embeddings=switch,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [4.0, 5.0, 6.0, 7.0],
            "original_max_position_embeddings": switch,
            "rope_theta": 10000.0,
        },
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_longrope_trees_stay_below_the_switch_and_crossing_it_is_refused():
    """LongRoPE takes the long frequencies for a whole forward once its largest position passes the switch
    (and Phi-3's generate then recomputes the cache): trees are drafted below it, a generation that would pass
    it is refused before any forward, and one starting past it is served."""
    from conftest import random_heads
    from test_decoding import OracleDrafter

    from hf_bpd.decode.support import rope_switch_position
    from hf_bpd.tools.forward_counter import ForwardCounter

    model = tiny_longrope(switch=12)
    assert rope_switch_position(model) == 12
    g = torch.Generator().manual_seed(1)
    for prompt_len, new in ((2, 11), (5, 8), (9, 4), (13, 20), (20, 20)):
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        kw = dict(do_sample=False, max_new_tokens=new, output_logits=True, return_dict_in_generate=True)
        ref = model.generate(ids, **kw)
        drafter = OracleDrafter(random_heads(model, num_heads=4), ref.sequences, top_k=4, max_tree_tokens=12)
        out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
        assert out.sequences.tolist() == ref.sequences.tolist(), prompt_len
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    ids = torch.randint(3, 97, (1, 2), generator=g)
    counter = ForwardCounter(model)
    with counter, pytest.raises(ValueError, match="LongRoPE switch at position 12"):
        drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
        model.generate(ids, do_sample=False, max_new_tokens=12, custom_generate=hf_bpd.generate, assistant=drafter)
    assert counter.count == 0


def assert_batch_refused_before_any_forward(model, drafter, ids: torch.Tensor) -> None:
    """The batch `ids` (left padding 0) is refused for reading positions by cache index, with no forward run."""
    from hf_bpd.tools.forward_counter import ForwardCounter

    counter = ForwardCounter(model)
    with counter, pytest.raises(ValueError, match="cache index"):
        kw = dict(custom_generate=hf_bpd.generate, assistant=drafter, pad_token_id=0)
        model.generate(ids, attention_mask=(ids != 0).long(), do_sample=False, max_new_tokens=4, **kw)
    assert counter.count == 0
