"""The device walk of sampled steps (`hf_bpd.decode.sampled_walk`): the tokens of plain seeded sampling, the random
stream left where plain sampling leaves it, and one device-to-host copy per step, drafting included."""

import pytest
import torch
from conftest import tiny_model
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.decode.cost import ForwardCost
from hf_bpd.decode.sampled_walk import walk_serves

OPTIONS = {
    "t0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t1.0": dict(temperature=1.0),
    "top-k, repetition penalty": dict(temperature=0.5, top_k=5, repetition_penalty=1.3),
    "min-p, min new tokens": dict(temperature=0.8, min_p=0.05, min_new_tokens=12),
}


def _drafter(model, fused: bool | None = True, max_tree_tokens=8) -> BlockDrafter:
    # zero residuals: every head repeats the base model's next-token guess, often drawn on a sharpened model
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=4, token_input="previous")
    flat = ForwardCost((1, 64), (0.01, 0.01)) if max_tree_tokens == "auto" else None
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=max_tree_tokens, forward_cost=flat)
    drafter.fused_sampling = fused
    drafter.count_host_syncs = True
    return drafter


def _sample(model, ids, seed: int, drafter: BlockDrafter | None = None, **kw) -> tuple[list, list]:
    """The tokens of a seeded sampling call (plain, or hf_bpd's with `drafter`) and the next draws of the
    global stream after it."""
    if drafter is not None:
        kw.update(custom_generate=hf_bpd.generate, assistant=drafter)
    torch.manual_seed(seed)
    out = model.generate(ids, do_sample=True, **kw)
    return out.tolist(), torch.rand(3).tolist()


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_the_device_walk_draws_plain_sampling_s_tokens_and_leaves_the_stream_as_it_does(options):
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    accepted = []
    for seed in range(4):
        ref = _sample(model, ids, seed, max_new_tokens=40, **options)
        drafter = _drafter(model)
        out = _sample(model, ids, seed, drafter, max_new_tokens=40, **options)
        assert out == ref, seed
        assert drafter.stats.host_syncs_per_step()["accept"] == 1.0, drafter.stats.host_syncs
        accepted += drafter.stats.accepted_lengths
    assert max(accepted) > 1  # drafts were accepted, so draws past a walk's end were made and undone


@pytest.mark.parametrize("max_tree_tokens", [8, 16, "auto"])
def test_a_sampled_step_synchronises_once_drafting_included(max_tree_tokens):
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    ref = _sample(model, ids, 0, max_new_tokens=60, temperature=0.3, top_p=0.9)
    drafter = _drafter(model, max_tree_tokens=max_tree_tokens)
    out = _sample(model, ids, 0, drafter, max_new_tokens=60, temperature=0.3, top_p=0.9)
    assert out == ref
    syncs, steps = drafter.stats.host_syncs, drafter.stats.steps
    per_call = sum(v for k, v in syncs.items() if k != "prefill") - 1  # less the first tree's own copy
    assert steps > 10 and per_call <= steps, syncs
    assert max(drafter.stats.accepted_lengths) > 1


def test_processors_the_walk_cannot_serve_take_the_host_walk_with_the_same_tokens():
    cpu = torch.device("cpu")
    assert walk_serves(LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]), cpu)
    assert not walk_serves(LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)]), cpu)  # reads the host
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = _sample(model, ids, 1, max_new_tokens=30, no_repeat_ngram_size=2)
    drafter = _drafter(model)
    out = _sample(model, ids, 1, drafter, max_new_tokens=30, no_repeat_ngram_size=2)
    assert out == ref
    assert drafter.stats.host_syncs_per_step()["accept"] > 1.0  # a read per reached node, and the processor's


def test_auto_walks_on_the_host_on_a_cpu_and_both_walks_agree():
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8]])
    runs = {}
    for fused in (None, True, False):
        drafter = _drafter(model, fused=fused)
        out = _sample(model, ids, 2, drafter, max_new_tokens=40, temperature=0.7)
        runs[fused] = (out, drafter.stats.host_syncs_per_step()["accept"], max(drafter.stats.accepted_lengths))
    assert runs[None][0] == runs[True][0] == runs[False][0]
    assert runs[True][1] == 1.0
    assert runs[None][1] == runs[False][1] > 1.0  # auto: the host walk, one read per reached node
    assert runs[True][2] > 1
